"""The engine: prompt in, answer plus ReuseReport out.

One request runs in three phases. The engine first decides whether the
policy's reuse is allowed at all (dynamic-NTK RoPE past its trained length,
the blend's minimum length, the quality gate) and refuses it before any
timing starts; then the prefill runs in the mode the policy names (full,
exact prefix segments through the :class:`~blend.segments.SegmentCache`, or
blended canonical chunks through :mod:`blend.blending`); then greedy
decoding runs over the resulting KV cache. The report is built once, at the
end of the prefill.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Protocol, Sequence

import torch

from blend.blending import prefill_blend, widen_blend
from blend.cpu_features import warn_if_emulated
from blend.defaults import DEFAULT_DTYPE, DEFAULT_MAX_NEW_TOKENS, DEFAULT_MODEL, DEFAULT_PROBE_PRECISION
from blend.engine_setup import EngineConfig, build_provenance, eos_ids, fp32_precision_label, torch_dtype
from blend.errors import InvalidPolicyError, InvalidRequestError, PromptTooLongError
from blend.gate import GateVerdict, QualityGate
from blend.gemm import pick_gemm_backend
from blend.generation import logits_sha256
from blend.keys import key_hex
from blend.kvcache import KVCache
from blend.model import ModelRunner
from blend.models import load_model
from blend.policy import ProbePrecision, RecomputePrecision, ReuseMode, ReusePolicy
from blend.prefilled import (Prefilled, build_report, document_rows, keep_first_pass_misses, report_ratio,
                             with_forced)
from blend.prefix_cache import attach_hot, is_hot, remember_hot
from blend.probe import top2_margin
from blend.probe_pass import probe_gemm_dtype, recompute_dtype, resolve_precisions, resolve_recompute_precision
from blend.prompt import Prompt, Segment, SegmentKind, Turn, build_prompt, preamble_segment
from blend.report import ReuseClass, ReuseReport, SegmentReport, Timings
from blend.segment_values import prefix_namespaces
from blend.segments import SegmentCache
from blend.store.base import KVStore
from blend.store.memory import MemoryStore

_BLENDED_KINDS = frozenset({SegmentKind.DOCUMENT})  # what a refused blend reports as fallback
_STORED_KINDS = frozenset({SegmentKind.PREAMBLE, SegmentKind.DOCUMENT})  # what any reuse would have read


@dataclass
class Answer:
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    first_logits: torch.Tensor  # (V,) float32: the logits that chose the first answer token
    ttft_s: float  # the quality gate's one-off run excluded (see report.timings.gate_s)
    report: ReuseReport
    # The request's KV cache, kept only when asked (``generate(keep_cache=True)``):
    # rows [0, len(prompt_token_ids)) are the prompt, as prefilled under the policy.
    cache: KVCache | None = field(default=None, repr=False, compare=False)

    def release_cache(self) -> None:
        """Drop the kept KV cache (frees its memory)."""
        self.cache = None

    def logits_sha256(self) -> str:
        """sha256 of the float32 bytes of :attr:`first_logits` (copied to the CPU from an accelerator)."""
        return logits_sha256(self.first_logits)


class BlendGate(Protocol):
    """What the engine asks before blending (see :class:`blend.gate.QualityGate`)."""

    def verdict(self, engine: "Engine") -> GateVerdict: ...


# The guard's exact recompute reuses the preamble and the first document: both sit where their
# stored KV was computed (the first document's canonical chunk is its exact KV there). The rest is
# computed in one pass and not stored: exact-prefix entries would make every later blend of this order
# (another policy's, an evaluation's other methods) an exact hit.
GUARD_PREFIX_SEGMENTS = 2


class Engine:
    """Answers prompts with KV reuse.

    Args:
        runner: the model (weights, RoPE tables, layer loop).
        config: engine settings.
        store: KV store (default: an unbounded in-memory store).
        gate: consulted before blending (None: blending is never refused by a gate).
    """

    def __init__(self, runner: ModelRunner, config: EngineConfig, store: KVStore | None = None,
                 gate: BlendGate | None = None) -> None:
        if torch_dtype(config.dtype) != runner.dtype:  # the provenance names config.dtype: it must be what runs
            raise InvalidRequestError(f"engine config dtype {config.dtype} but the model runs in "
                                      f"{str(runner.dtype).removeprefix('torch.')}")
        self.config = config
        self.runner = runner
        self.device = runner.device
        self.dtype = runner.dtype
        self.kv_dtype = torch_dtype(config.kv_dtype or config.dtype)
        self.tokenizer = runner.loaded.tokenizer
        self.model_name = runner.loaded.name
        self._fp32_precision = fp32_precision_label()  # what the provenance records, read once
        self.provenance = build_provenance(runner.loaded, config, self.device, runner.gemm, self._fp32_precision)
        self.segments = SegmentCache(runner, store if store is not None else MemoryStore(), self.provenance,
                                     self.kv_dtype, config.overlap_loading, config.experimental_semantic)
        self.gate = gate
        self.eos_ids = eos_ids(runner.loaded.model, self.tokenizer)

    @classmethod
    def load(cls, model: str = DEFAULT_MODEL, dtype: str = DEFAULT_DTYPE, store: KVStore | None = None,
             **config) -> "Engine":
        """Load a model by name or path and build an engine (gated unless ``quality_gate=False``).

        Args:
            model: see :mod:`blend.models`.
            dtype: float32, bfloat16 or float16.
            store: a KV store; default in-memory.
            **config: other :class:`EngineConfig` fields.
        """
        cfg = EngineConfig(model=model, dtype=dtype, **config)
        compute, device = torch_dtype(dtype), torch.device(cfg.device)
        warn_if_emulated(compute, device)
        try:
            gemm = pick_gemm_backend(cfg.gemm, device, compute)
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None
        runner = ModelRunner(load_model(model), compute, device, gemm)
        return cls(runner, cfg, store, QualityGate() if cfg.quality_gate else None)

    def with_store(self, store: KVStore, gate: BlendGate | None = None) -> "Engine":
        """Another engine over the same weights with its own store (and no gate unless given)."""
        return Engine(self.runner, self.config, store, gate)

    def prepare_blend(self, precision: ProbePrecision = ProbePrecision(DEFAULT_PROBE_PRECISION),
                      linear: RecomputePrecision = RecomputePrecision.COMPUTE) -> torch.dtype:
        """Make what a blend request needs before the first one arrives: the query probe's
        lower-precision copy of the layers' GEMM matrices (and the recomputed rows' under ``linear``),
        and with semantic reuse the donor index read from its log (each built once, on first use
        otherwise, which the first blend request would pay: a full donor log takes seconds to replay).
        A server calls this at start-up.

        Args:
            precision: the probe precision requests will use (default: the engine's default).
            linear: the ``linear_precision`` requests will use.

        Returns:
            The dtype the probe's GEMMs run in on this engine.
        """
        runner = self.runner
        dtype = probe_gemm_dtype(precision, runner.dtype, runner.device)
        runner.layers_in(dtype)
        linear = resolve_recompute_precision(linear, runner.dtype, runner.device)
        runner.layers_in(recompute_dtype(linear, runner.dtype))
        if self.segments.donors.enabled:
            len(self.segments.donors.index)  # attaches the index to its log (once)
        return dtype

    def close(self) -> None:
        """Stop background loader threads (the engine stays usable: lookups then run inline)."""
        self.segments.close()

    @property
    def store(self) -> KVStore:
        return self.segments.store

    @property
    def provenance_json(self) -> str:
        return self.segments.provenance_json

    @property
    def dims(self):
        return self.runner.dims

    def build_prompt(self, question: str, documents: Sequence[str], system: str | None = None,
                     history: Sequence[Turn] = ()) -> Prompt:
        """Segment a question and documents into a prompt (see :func:`blend.prompt.build_prompt`).

        Args:
            question: the user's question.
            documents: document texts in prompt order.
            system: system prompt (default :data:`blend.prompt.DEFAULT_SYSTEM`).
            history: earlier turns of a conversation (``Turn(Role.USER | Role.ASSISTANT, text)``),
                oldest first.

        Returns:
            The segmented prompt.
        """
        return build_prompt(self.tokenizer, question, documents, system, history)

    # ---- prefill --------------------------------------------------------------------------

    def _length_dependent(self, prompt: Prompt) -> bool:
        """Dynamic-NTK RoPE past its trained length: every row's KV depends on the prompt's
        length, so the prompt is computed in one pass (and nothing is reused or stored)."""
        past = self.runner.rope.length_dependent_after
        return past is not None and len(prompt) > past

    def _refusal(self, prompt: Prompt, policy: ReusePolicy) -> tuple[str, frozenset[SegmentKind], float]:
        """Whether the policy's reuse is refused for this prompt, before anything is timed.

        Returns:
            (reason or "", the segment kinds reported as fallback, seconds the quality gate ran).
        """
        if policy.mode is not ReuseMode.NONE and self._length_dependent(prompt):
            name = "LongRoPE" if self.runner.rope.rope_type == "longrope" else "dynamic-NTK RoPE"
            return (f"{name} changes past "
                    f"{self.runner.rope.length_dependent_after} positions: KV "
                    f"depends on the request's length ({len(prompt)}), so nothing is reused or stored"), \
                _STORED_KINDS, 0.0
        if policy.mode is not ReuseMode.BLEND:
            return "", _BLENDED_KINDS, 0.0
        n = self.dims.num_layers
        if policy.check_layers[-1] >= n:
            raise InvalidPolicyError(f"check layers {policy.check_layers} outside the model's {n} layers (0..{n - 1})")
        if policy.semantic and not self.config.experimental_semantic:
            raise InvalidPolicyError(
                "semantic reuse is experimental: enable it in the engine (EngineConfig(experimental_semantic=True) "
                "or --experimental-semantic) as well as in the policy")
        if len(prompt) < policy.min_prompt_tokens:
            return (f"prompt of {len(prompt)} tokens < min_prompt_tokens={policy.min_prompt_tokens}",
                    _BLENDED_KINDS, 0.0)
        if policy.force or self.gate is None:
            return "", _BLENDED_KINDS, 0.0
        verdict = self.gate.verdict(self)
        return verdict.refused, _BLENDED_KINDS, verdict.ran_s

    def _prefill_unreused(self, prompt: Prompt, cache: KVCache, refused: str = "",
                          kinds: frozenset[SegmentKind] = frozenset()) -> Prefilled:
        """No reuse (asked for, or refused): the exact schedule with the store off, so it is
        bit-identical to an exact run; one pass where dynamic NTK makes KV length-dependent.
        Segments of ``kinds`` are reported as fallback when reuse was ``refused``."""
        if self._length_dependent(prompt):
            logits, rows = self.segments.compute_rest(cache, prompt.segments)
            done = Prefilled(logits, rows)
        else:
            done = self._prefill_segments(prompt, None, False, cache)
        if not refused:
            return done
        rows = tuple(replace(r, reuse_class=ReuseClass.FALLBACK, note=refused) if r.kind in kinds else r
                     for r in done.segments)
        return replace(done, segments=rows)

    def _prefill_segments(self, prompt: Prompt, prefix_limit: int | None, use_store: bool,
                          cache: KVCache, salt: str = "") -> Prefilled:
        """Segment by segment: each segment but the question is looked up, else computed and
        stored (exact reuse); without the store, the same schedule computes every segment."""
        cacheable = prompt.segments[:-1]
        if prefix_limit is not None:
            cacheable = cacheable[:prefix_limit]
        whole = len(cacheable) == len(prompt.segments) - 1  # the whole prefix: a conversation's turns too
        if use_store and whole:
            hot = attach_hot(self.segments, cache, cacheable, prompt.question, salt)
            if hot is not None:  # a prefix found stored again: attached, not loaded (the same rows)
                logits, tail, _ = self.segments.compute_question(cache, cacheable, prompt.question, True, salt,
                                                                 attached=True)
                return Prefilled(logits, (*hot, *tail), 0.0)
        keys = (self.segments.prefix_keys(cacheable, salt) if use_store
                else [(ns, None) for ns in prefix_namespaces(cacheable)])
        rows, lookup_s, start = [], 0.0, cache.length
        for seg, (_, key), done in zip(cacheable, keys, self.segments.append_run(cache, cacheable, keys)):
            rows.append(SegmentReport(seg.kind, done.reuse_class, len(seg), start, key_hex(key) if key else "",
                                      note=done.note))
            lookup_s += done.lookup_s
            start += len(seg)
        if whole:
            logits, tail, waited = self.segments.compute_question(cache, cacheable, prompt.question, use_store, salt)
            if use_store:
                remember_hot(self.segments, cache, cacheable, prompt.question, (*rows, *tail), salt)
            return Prefilled(logits, (*rows, *tail), lookup_s + waited)
        # Everything after the reusable prefix (the question included) is one block:
        # one causal pass is cheaper than segment-by-segment masked attention.
        logits, tail = self.segments.compute_rest(cache, prompt.segments[len(cacheable):])
        return Prefilled(logits, (*rows, *tail), lookup_s)

    def prefill(self, prompt: Prompt, policy: ReusePolicy, extra_capacity: int = 0, question: bool = True
                ) -> tuple[torch.Tensor | None, KVCache, ReuseReport]:
        """Run the prompt under ``policy``.

        Args:
            prompt: the segmented prompt.
            policy: what may be reused.
            extra_capacity: rows to reserve for decoding.
            question: False for a caller that computes the question itself and only takes the
                context's KV (the vLLM connector): a blend then stops the question's rows after
                its check layer, its cache ends before the question and its logits are None
                (other modes compute the whole prompt as usual).

        Returns:
            first-token logits (V,) float32 (None as above), the filled cache, the report. What the
            prefill stored is in the store's first tier on return and reaches its persistent tiers
            in the background (write-behind); ``engine.segments.flush()`` waits for that, as
            :meth:`generate`, :meth:`close` and the streaming API do.
        """
        limit = self.dims.max_positions
        if len(prompt) + extra_capacity > limit:
            raise PromptTooLongError(f"prompt of {len(prompt)} tokens plus {extra_capacity} new tokens exceeds "
                                     f"the model's context of {limit}")
        if policy.mode is ReuseMode.BLEND:  # the report says what ran: AUTO becomes bf16 or compute
            policy = resolve_precisions(policy, self.runner.dtype, self.runner.device)
        refused, kinds, gate_s = self._refusal(prompt, policy)
        cache = self.runner.new_cache(len(prompt) + extra_capacity)
        t0 = time.perf_counter()
        with torch.inference_mode():
            done, cache = self._run(prompt, policy, cache, question, refused, kinds)
        ttft = time.perf_counter() - t0
        # a blend that ran (not refused): its selector, the share it recomputed (0 where nothing was
        # re-positioned: every document exact, or the hot prefix) and its first-token gap
        blended = policy.mode is ReuseMode.BLEND and kinds is _BLENDED_KINDS and not refused
        if policy.mode is ReuseMode.BLEND and not done.check_rows:
            # no pass with a check layer answers (every document exact, a hot prefix, a refusal, the guard's
            # exact path, full reuse): nothing ran above a check layer, so nothing ran in another precision
            # and no reused row was tempered (the temperature applies above the first check layer only)
            policy = replace(policy, attention_precision=RecomputePrecision.COMPUTE,
                             linear_precision=RecomputePrecision.COMPUTE, reused_temperature=1.0)
        return done.logits, cache, build_report(done, policy, blended, refused, Timings(
            lookup_s=done.lookup_s, compute_s=ttft - done.lookup_s, ttft_s=ttft, gate_s=gate_s))

    def _run(self, prompt: Prompt, policy: ReusePolicy, cache: KVCache, question: bool, refused: str,
             kinds: frozenset[SegmentKind]) -> tuple[Prefilled, KVCache]:
        """The prefill ``policy`` asks for (or the one a refusal leaves); returns it and its cache."""
        self._check_fp32_precision()
        if refused or policy.mode is ReuseMode.NONE:
            return self._prefill_unreused(prompt, cache, refused, kinds), cache
        if policy.mode is ReuseMode.EXACT:
            return self._prefill_segments(prompt, policy.prefix_limit, True, cache, policy.cache_salt), cache
        if policy.take_exact and is_hot(self.segments, prompt.segments[:-1], prompt.question, policy.cache_salt):
            # every document exact at its place, found stored again: the exact path (what a blend of an
            # all-exact prompt computes), the hot prefix attached; its gap reported as the loaded one's
            done = self._prefill_segments(prompt, None, True, cache, policy.cache_salt)
            return replace(done, margin=top2_margin(done.logits), ratio=0.0), cache  # nothing recomputed
        return self._guard(prompt, policy, self._blend(prompt, policy, cache, question), cache)

    def _blend(self, prompt: Prompt, policy: ReusePolicy, cache: KVCache, question: bool = True) -> Prefilled:
        """A blended prefill into ``cache`` (see :func:`~blend.blending.prefill_blend`)."""
        out = prefill_blend(self.runner, self.segments, prompt, policy, cache, question=question)
        return Prefilled(out.logits, out.segments, out.lookup_s, out.deviation, out.ratio,
                          approximate=out.approximate, resume=out.resume, check_rows=out.check_rows)

    def _guard(self, prompt: Prompt, policy: ReusePolicy, done: Prefilled, cache: KVCache
               ) -> tuple[Prefilled, KVCache]:
        """The near-tie guard: a blend whose first token is a near tie is recomputed.

        Returns:
            The result to answer from (``done`` with its first-token gap, or the recompute's) and its cache.
        """
        if done.logits is None:  # the caller computes the question (and so its first token) itself
            return done, cache
        margin = top2_margin(done.logits)
        # decided by what the blend computed, not by where its KV came from: a cold request (chunks computed
        # canonically, then blended) guards exactly where the warm one does, so cold == warm holds
        if not policy.guarded or not done.approximate or margin >= policy.guard_margin:
            return replace(done, margin=margin, resume=None), cache
        # what the blend spent: the share an adaptive budget or a threshold selected, or the fixed ratio
        # (forced rows counted)
        spent = report_ratio(done, policy)
        _, base = document_rows(done.segments)  # the budget's rows
        target = policy.guard_ratio_for(spent, base)
        why = f"first-token gap {margin:.3g} < {policy.guard_margin:g} nats: recomputed at ratio {target:g}"
        if done.resume is not None and policy.guard_widens(target):  # on from the first pass's check layer
            out = widen_blend(self.runner, done.resume, cache, target)
            why += f" ({policy.guard_mode.value}: from check layer {done.resume.at.layer}"
            rows, _ = document_rows(out.segments)
            if rows < round(target * base):  # the candidates, sized before rounding, held fewer rows
                why += f", its candidates only {out.ratio:.3g} of the document rows"
            why += ")"
            return replace(done, logits=out.logits, segments=out.segments, deviation=out.deviation,
                           ratio=out.ratio, spent=spent + with_forced(out.segments, out.ratio), margin=margin,
                           guard=why, approximate=out.approximate, resume=None, check_rows=out.check_rows), cache
        with torch.inference_mode(False):  # a normal tensor, as the first cache: decoding writes it later
            again = self.runner.new_cache(cache.capacity)
        if target >= 1.0:  # the exact path: preamble and first document reused (both exact
            # there, the blend just fetched them), the rest computed, nothing else stored
            redo = self._prefill_segments(prompt, GUARD_PREFIX_SEGMENTS, True, again, policy.cache_salt)
        else:  # a fixed ratio: the recompute reports a share of its own only where it had fewer rows
            redo = self._blend(prompt, policy.at_guard_ratio(target), again)
        share = target if redo.ratio is None else redo.ratio  # what the recompute recomputed
        segments = keep_first_pass_misses(done.segments, redo.segments)
        return replace(redo, segments=segments, lookup_s=done.lookup_s + redo.lookup_s, ratio=share,
                       spent=spent + with_forced(segments, share), margin=margin, guard=why, resume=None), again

    # ---- answers --------------------------------------------------------------------------

    def generate(self, prompt: Prompt, policy: ReusePolicy | None = None,
                 max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, stop_at_newline: bool = True,
                 keep_cache: bool = False) -> Answer:
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
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be an integer >= 1, not {max_new_tokens!r}")
        t0 = time.perf_counter()
        logits, cache, report = self.prefill(prompt, policy, max_new_tokens)
        tok = int(torch.argmax(logits))
        ttft = time.perf_counter() - t0 - report.timings.gate_s
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
        self.segments.flush()  # done means stored in every tier (write-behind)
        text = self.tokenizer.decode(out, skip_special_tokens=True, clean_up_tokenization_spaces=False).strip()
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
            to float rounding, not bit for bit; a token at a time where RoPE depends
            on the sequence's length, as decoding feeds them).
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
        after = self.runner.rope.length_dependent_after
        with torch.inference_mode():
            if after is not None and n + len(continuation) > after:
                # dynamic-NTK / LongRoPE past its trained length: a pass's tables depend on its longest
                # position, so one pass would rotate every row for the last one; decoding rotates each
                # token for its own, so feed them as decoding does (0.42 apart in logits otherwise)
                rest = torch.stack([self.runner.decode_step(cache, int(t)) for t in continuation])  # (S, V)
            else:  # the whole continuation in one causal pass over the prompt rows
                h, _ = self.runner.prefill(cache, self.runner.ids(continuation), keep_kv=False)  # (S, C)
                rest = self.runner.logits(h)  # (S, V)
        return torch.cat([logits[None], rest])  # (S + 1, V)

    # ---- ahead of requests ----------------------------------------------------------------

    def precompute(self, prompt: Prompt, policy: ReusePolicy) -> None:
        """Store whatever KV ``policy`` would reuse for ``prompt`` (preamble, chunks)."""
        if policy.mode is ReuseMode.EXACT:
            self.prefill(prompt, policy)
            self.segments.flush()  # in every tier on return, as precompute_chunks
        elif policy.mode is ReuseMode.BLEND:  # canonical chunks (this also stores the preamble)
            self.precompute_chunks([s.text for s in prompt.documents], preamble=prompt.preamble,
                                   salt=policy.cache_salt)

    def _check_fp32_precision(self) -> None:
        """Refuse to compute under another float32 matmul precision than the provenance records (its KV
        would be stored, and found, under keys that say otherwise)."""
        now = fp32_precision_label()
        if now != self._fp32_precision:
            raise InvalidRequestError(f"torch's float32 matmul precision changed since this engine was built "
                                      f"({self._fp32_precision} -> {now}): its store keys record the first; "
                                      "set it before loading the engine")

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
        self._check_fp32_precision()
        head = preamble if preamble is not None else preamble_segment(self.tokenizer, system)  # (a Segment has len)
        return self.segments.precompute_chunks(texts, head, salt)
