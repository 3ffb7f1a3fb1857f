"""The engine: prompt in, answer plus ReuseReport out.

One request runs in three phases: a prefill that reuses what the policy
allows (exact prefix segments, or blended canonical chunks), greedy
decoding over the resulting KV cache, and a report of what was reused.
"""

from __future__ import annotations

import hashlib
import sys
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Sequence

import torch

from blend.errors import InvalidPolicyError, InvalidRequestError, PromptTooLongError
from blend.keys import Namespace, Provenance, canonical_key, exact_chain, key_hex
from blend.kvcache import KVCache
from blend.models import LoadedModel, load_model
from blend.policy import ReuseMode, ReusePolicy
from blend.prompt import (
    Prompt, Segment, SegmentKind, build_prompt, document_text, preamble_segment, tokenize_segment,
)
from blend.report import ReuseClass, ReuseReport, SegmentReport
from blend.rope import rope_config_json
from blend.runner import ModelRunner, SegmentKV
from blend.store.base import KVEntry, KVStore, Lookup, LookupStatus
from blend.store.memory import MemoryStore
from blend.store.prefetch import Prefetcher
from blend.semantic import register_donor

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    """Engine-wide settings (per-request state goes in the policy and arguments)."""

    model: str = "smollm2-135m"
    dtype: str = "float32"
    kv_dtype: str | None = None  # storage dtype of KV; None = dtype
    device: str = "cpu"
    experimental_semantic: bool = False
    quality_gate: bool = True  # run/consult `kvblend check` before the first blend
    overlap_loading: bool = True  # fetch chunk KV in background threads while computing


@dataclass
class Answer:
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    first_logits: torch.Tensor  # (V,) float32: the logits that chose the first answer token
    ttft_s: float
    report: ReuseReport
    # The request's KV cache, kept only when asked (``generate(keep_cache=True)``):
    # rows [0, len(prompt_token_ids)) are the prompt, as prefilled under the policy.
    cache: KVCache | None = field(default=None, repr=False, compare=False)

    def release_cache(self) -> None:
        """Drop the kept KV cache (frees its memory)."""
        self.cache = None

    def logits_sha256(self) -> str:
        """sha256 of the float32 bytes of :attr:`first_logits`."""
        return hashlib.sha256(self.first_logits.float().contiguous().numpy().tobytes()).hexdigest()


def _dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise InvalidRequestError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def build_provenance(loaded: LoadedModel, cfg: EngineConfig, device: torch.device) -> Provenance:
    """Every field that changes the KV this engine produces."""
    config = loaded.model.config
    arch = hashlib.sha256(config.to_json_string(use_diff=False).encode()).hexdigest()[:16]
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        device_class = f"cuda:sm{major}{minor}"
    else:
        device_class = device.type
    return Provenance(
        model_arch=f"{config.model_type}:{arch}",
        weights_sha256=loaded.weights_sha256,
        tokenizer_sha256=loaded.tokenizer_sha256,
        dtype=cfg.dtype,
        kv_dtype=cfg.kv_dtype or cfg.dtype,
        device_class=device_class,
        backend=f"kvblend-layers/torch-{torch.__version__}/sdpa",
        rope=rope_config_json(config),
    )


class Engine:
    """Answers prompts with KV reuse.

    Args:
        loaded: the model (see :func:`blend.models.load_model`).
        config: engine settings.
        store: KV store (default: an unbounded in-memory store).
    """

    def __init__(self, loaded: LoadedModel, config: EngineConfig, store: KVStore | None = None) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = _dtype(config.dtype)
        self.kv_dtype = _dtype(config.kv_dtype or config.dtype)
        self.runner = ModelRunner(loaded, self.dtype, self.device)
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        self.store: KVStore = store if store is not None else MemoryStore()
        self.provenance = build_provenance(loaded, config, self.device)
        self.provenance_json = self.provenance.canonical_json()  # what every stored entry must carry
        cfg = loaded.model.config
        eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, list) else [cfg.eos_token_id]
        self.eos_ids = {int(e) for e in eos if e is not None}
        self._gate = None  # recorded quality-gate result, loaded lazily
        self._prefetcher: Prefetcher | None = None
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            self.eos_ids.add(int(self.tokenizer.eos_token_id))

    @classmethod
    def load(cls, model: str = "smollm2-135m", dtype: str = "float32", store: KVStore | None = None,
             **config) -> "Engine":
        """Load a model by name or path and build an engine.

        Args:
            model: see :mod:`blend.models`.
            dtype: float32, bfloat16 or float16.
            store: a KV store; default in-memory.
            **config: other :class:`EngineConfig` fields.
        """
        cfg = EngineConfig(model=model, dtype=dtype, **config)
        _dtype(dtype)
        return cls(load_model(model), cfg, store)

    @property
    def prefetcher(self) -> Prefetcher:
        """Background loader over the current store (rebuilt if the store was swapped)."""
        if self._prefetcher is None or self._prefetcher.store is not self.store:
            if self._prefetcher is not None:
                self._prefetcher.close()
            self._prefetcher = Prefetcher(self.store, device=self.device if self.device.type == "cuda" else None)
        return self._prefetcher

    @property
    def dims(self):
        return self.runner.dims

    # ---- prompts --------------------------------------------------------------------------

    def build_prompt(self, question: str, documents: Sequence[str], system: str | None = None) -> Prompt:
        """Segment a question and documents into a prompt (see :mod:`blend.prompt`)."""
        return build_prompt(self.tokenizer, question, documents, system)

    def _check_length(self, prompt: Prompt, extra: int) -> None:
        limit = self.dims.max_positions
        if len(prompt) + extra > limit:
            raise PromptTooLongError(
                f"prompt of {len(prompt)} tokens plus {extra} new tokens exceeds the model's context of {limit}"
            )

    # ---- store helpers --------------------------------------------------------------------

    def _entry(self, kv: SegmentKV) -> KVEntry:
        return KVEntry(kv.k.to(self.kv_dtype).cpu(), kv.v.to(self.kv_dtype).cpu(), self.provenance_json)

    def _as_stored(self, kv: SegmentKV) -> SegmentKV:
        """The segment exactly as a later load would see it (storage dtype round trip)."""
        if self.kv_dtype == self.dtype:
            return kv
        return SegmentKV(kv.k.to(self.kv_dtype).to(self.dtype), kv.v.to(self.kv_dtype).to(self.dtype))

    def _compute_stored(self, cache: KVCache, seg: Segment) -> SegmentKV:
        """Compute a segment whose KV will be stored; leave exactly the stored rows in the cache."""
        start = cache.length
        _, kv = self.runner.prefill(cache, self._ids(seg.token_ids))
        if self.kv_dtype != self.dtype:  # cold must equal warm: continue from the rounded rows
            cache.length = start
            kv = self._as_stored(kv)
            self.runner.load(cache, kv)
        return kv

    def _ids(self, ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(ids), dtype=torch.long, device=self.device)

    def lookup(self, ns: Namespace, key, tokens: int, report: ReuseReport,
               pending: Future[Lookup] | None = None) -> tuple[KVEntry | None, str | None]:
        """Look a segment's KV up (or collect a background lookup), timed into ``report``.

        Args:
            ns: namespace of the key.
            key: the segment's store key.
            tokens: the segment's length (an entry of another length is unusable).
            report: the request's report (``timings.lookup_s``).
            pending: a lookup already started by the prefetcher, if any.

        Returns:
            ``(entry, None)`` on a usable hit; ``(None, None)`` on a miss;
            ``(None, reason)`` when an entry was found but rejected.
        """
        t0 = time.perf_counter()
        found = pending.result() if pending is not None else self.store.get(ns, key, self.provenance_json)
        report.timings.lookup_s += time.perf_counter() - t0
        if found.status is LookupStatus.HIT and found.entry.num_tokens == tokens:
            return found.entry, None
        if found.status is LookupStatus.MISS:
            return None, None
        return None, found.reason or "stored entry has the wrong length"

    def _exact_segment(self, cache: KVCache, seg: Segment, key, report: ReuseReport) -> SegmentReport:
        """Append one prefix segment: load it on an exact hit, else compute and store it."""
        start = cache.length
        entry, rejected = self.lookup(Namespace.EXACT, key, len(seg), report)
        rep = SegmentReport(seg.kind, ReuseClass.COMPUTED, len(seg), start, key_hex(key))
        if entry is not None:
            self.runner.load(cache, SegmentKV(entry.k, entry.v))
            rep.reuse_class = ReuseClass.EXACT
            return rep
        if rejected is not None:
            rep.reuse_class, rep.note = ReuseClass.REJECTED, rejected
        kv = self._compute_stored(cache, seg)
        self.store.put(Namespace.EXACT, key, self._entry(kv))
        return rep

    # ---- prefill --------------------------------------------------------------------------

    def prefill_refused(self, prompt: Prompt, cache: KVCache, report: ReuseReport, reason: str,
                        kinds: frozenset[SegmentKind]) -> torch.Tensor:
        """Reuse refused: compute the whole prompt; segments of ``kinds`` are reported as fallback.

        Args:
            reason: why (``report.gate`` and each fallback segment's note).
            kinds: the segment kinds that would have been reused.

        Returns:
            first-token logits (V,) float32.
        """
        report.gate = reason
        logits = self._prefill_full(prompt, cache, report)
        for rep in report.segments:
            if rep.kind in kinds:
                rep.reuse_class, rep.note = ReuseClass.FALLBACK, reason
        return logits

    def _prefill_full(self, prompt: Prompt, cache: KVCache, report: ReuseReport) -> torch.Tensor:
        h, _ = self.runner.prefill(cache, self._ids(prompt.token_ids), keep_kv=False)
        start = 0
        for seg in prompt.segments:
            report.segments.append(SegmentReport(seg.kind, ReuseClass.COMPUTED, len(seg), start))
            start += len(seg)
        return self.runner.logits(h[-1:])[0]

    def _prefill_exact(self, prompt: Prompt, policy: ReusePolicy, cache: KVCache,
                       report: ReuseReport) -> torch.Tensor:
        """Prefix reuse: each segment but the question is looked up, else computed and stored."""
        cacheable = prompt.segments[:-1]
        if policy.prefix_limit is not None:
            cacheable = cacheable[: policy.prefix_limit]
        keys = exact_chain(self.provenance, [s.token_ids for s in cacheable], policy.cache_salt)
        for i, seg in enumerate(cacheable):
            report.segments.append(self._exact_segment(cache, seg, keys[i], report))
        # Everything after the reusable prefix (the question included) is one block:
        # one causal pass is cheaper than segment-by-segment masked attention.
        tail = prompt.segments[len(cacheable):]
        start = cache.length
        ids = [t for seg in tail for t in seg.token_ids]
        h, _ = self.runner.prefill(cache, self._ids(ids), keep_kv=False)
        for seg in tail:
            report.segments.append(SegmentReport(seg.kind, ReuseClass.COMPUTED, len(seg), start))
            start += len(seg)
        return self.runner.logits(h[-1:])[0]

    def prefill(self, prompt: Prompt, policy: ReusePolicy, extra_capacity: int = 0
                ) -> tuple[torch.Tensor, KVCache, ReuseReport]:
        """Run the prompt under ``policy``.

        Args:
            prompt: the segmented prompt.
            policy: what may be reused.
            extra_capacity: rows to reserve for decoding.

        Returns:
            first-token logits (V,) float32, the filled cache, the report.
        """
        self._check_length(prompt, extra_capacity)
        report = ReuseReport(policy=policy.describe())
        cache = self.runner.new_cache(len(prompt) + extra_capacity)
        t0 = time.perf_counter()
        past = self.runner.rope.length_dependent_after
        refuse = policy.mode is not ReuseMode.NONE and past is not None and len(prompt) > past
        with torch.inference_mode():
            if refuse:  # no stored KV is valid for this request, and none it computes is reusable
                logits = self.prefill_refused(
                    prompt, cache, report,
                    f"dynamic-NTK RoPE rescales past {past} positions: KV depends on the request's "
                    f"length ({len(prompt)}), so nothing is reused or stored",
                    frozenset({SegmentKind.PREAMBLE, SegmentKind.DOCUMENT}))
            elif policy.mode is ReuseMode.NONE:
                logits = self._prefill_full(prompt, cache, report)
            elif policy.mode is ReuseMode.EXACT:
                logits = self._prefill_exact(prompt, policy, cache, report)
            else:
                from blend.blending import prefill_blend

                logits = prefill_blend(self, prompt, policy, cache, report)
        report.timings.ttft_s = time.perf_counter() - t0
        report.timings.compute_s = report.timings.ttft_s - report.timings.lookup_s
        return logits, cache, report

    def gate_verdict(self, policy: ReusePolicy) -> str:
        """Why blending is refused for this model ('' when allowed).

        The first blend request for a provenance with no recorded gate result runs
        the gate (see :mod:`blend.gate`) and records it.
        """
        if policy.force or not self.config.quality_gate:
            return ""
        from blend import gate

        if self._gate is None:
            self._gate = gate.load_record(self)
        if self._gate is None:
            print(f"kvblend: first blend request for {self.model_name}: running the quality gate "
                  "(kvblend check) once", file=sys.stderr, flush=True)
            self._gate = gate.run_gate(self)
            gate.record(self, self._gate)
        if self._gate.passed:
            return ""
        return (f"model failed the blend quality gate ({self._gate.summary()}); "
                "computed fully; force blending with --force-blend / ReusePolicy.blend(force=True)")

    # ---- public API -----------------------------------------------------------------------

    def generate(self, prompt: Prompt, policy: ReusePolicy | None = None, max_new_tokens: int = 32,
                 stop_at_newline: bool = True, keep_cache: bool = False) -> Answer:
        """Answer a prompt greedily.

        Args:
            prompt: from :meth:`build_prompt`.
            policy: reuse policy (default: exact).
            max_new_tokens: decoding budget (>= 1).
            stop_at_newline: stop before a token containing a newline.
            keep_cache: keep the request's KV cache on the answer, so that
                :meth:`teacher_forced_logits` can score a continuation without
                prefilling the prompt again.

        Returns:
            The answer with its first-token logits, TTFT and reuse report.
        """
        policy = policy or ReusePolicy.exact()
        if max_new_tokens < 1:
            raise InvalidRequestError("max_new_tokens must be >= 1")
        t0 = time.perf_counter()
        logits, cache, report = self.prefill(prompt, policy, max_new_tokens)
        tok = int(torch.argmax(logits))
        ttft = time.perf_counter() - t0
        out: list[int] = []
        with torch.inference_mode():
            while True:
                if tok in self.eos_ids:
                    break
                if stop_at_newline and "\n" in self.tokenizer.decode([tok]):
                    break
                out.append(tok)
                if len(out) >= max_new_tokens:
                    break
                tok = int(torch.argmax(self.runner.decode_step(cache, tok)))
        text = self.tokenizer.decode(out, skip_special_tokens=True).strip()
        return Answer(text, out, prompt.token_ids, logits, ttft, report, cache if keep_cache else None)

    def teacher_forced_logits(self, prompt: Prompt, policy: ReusePolicy, continuation: Sequence[int],
                              answer: Answer | None = None) -> torch.Tensor:
        """Logits along a given continuation.

        Args:
            prompt: the prompt.
            policy: reuse policy of the prefill.
            continuation: token ids to feed after the prompt.
            answer: an answer to this prompt under this policy generated with
                ``keep_cache=True``; its prompt rows are reused instead of a second
                prefill (the same numbers: decoding only appends rows). Its cache
                is consumed.

        Returns:
            (len(continuation) + 1, V) float32; row 0 is the first-token logits,
            row i the next-token logits after feeding ``continuation[:i]`` (all rows
            of the continuation in one pass, so they match step-by-step decoding
            to float rounding, not bit for bit).
        """
        n = len(prompt)
        kept = answer.cache if answer is not None else None
        if (kept is not None and list(answer.prompt_token_ids) == list(prompt.token_ids)
                and kept.capacity >= n + len(continuation)):
            cache, logits = kept, answer.first_logits
            cache.length = n  # forget the decoded rows; the prompt rows are untouched
            answer.release_cache()
        else:
            logits, cache, _ = self.prefill(prompt, policy, len(continuation))
        if not continuation:
            return logits[None]  # (1, V)
        with torch.inference_mode():  # the whole continuation in one causal pass over the prompt rows
            h, _ = self.runner.prefill(cache, self._ids(list(continuation)), keep_kv=False)  # (S, C)
            rest = self.runner.logits(h)  # (S, V)
        return torch.cat([logits[None], rest])  # (S + 1, V)

    def precompute(self, prompt: Prompt, policy: ReusePolicy) -> None:
        """Store whatever KV ``policy`` would reuse for ``prompt`` (preamble, chunks)."""
        if policy.mode is ReuseMode.EXACT:
            self.prefill(prompt, policy)
        elif policy.mode is ReuseMode.BLEND:  # canonical chunks (this also stores the preamble)
            self.precompute_chunks([s.text for s in prompt.documents], preamble=prompt.preamble,
                                   salt=policy.cache_salt)

    def precompute_chunks(self, texts: Sequence[str], system: str | None = None,
                          preamble: Segment | None = None, salt: str = "") -> int:
        """Compute and store canonical chunk KV (each chunk alone after the preamble).

        Args:
            texts: chunk texts (as given to :meth:`build_prompt`, or already laid out).
            system: system prompt that defines the preamble.
            preamble: the preamble segment (overrides ``system``).
            salt: the cache salt of the requests that will reuse them.

        Returns:
            Bytes of KV written (0 when everything was already stored).
        """
        from blend.blending import canonical_chunk_kv

        preamble = preamble or preamble_segment(self.tokenizer, system)
        written = 0
        for text in texts:
            laid = text if text.endswith("\n\n") else document_text(text)
            ids = tokenize_segment(self.tokenizer, laid)
            key = canonical_key(self.provenance, preamble.token_ids, ids, salt)
            if not salt:
                register_donor(self, preamble.token_ids, ids, key)
            if self.store.contains(Namespace.CANONICAL, key):
                continue
            with torch.inference_mode():
                kv = canonical_chunk_kv(self, preamble, ids, salt)
            entry = self._entry(kv)
            self.store.put(Namespace.CANONICAL, key, entry)
            written += entry.nbytes
        return written
