"""The engine: prompt in, answer plus ReuseReport out.

One request runs in three phases. The engine first decides whether the
policy's reuse is allowed at all (dynamic-NTK RoPE past its trained length,
the blend's minimum length, the quality gate: :mod:`blend.refusals`) and refuses it before any
timing starts; then the prefill runs in the mode the policy names (full,
exact prefix segments through the :class:`~blend.segments.SegmentCache`, or
blended canonical chunks through :mod:`blend.blending`); then greedy
decoding runs over the resulting KV cache. The report is built once, at the
end of the prefill. The prefill paths themselves (unreused, exact segments, blended, and
the near-tie guard's recompute) are in :mod:`blend.prefill_paths`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Protocol, Sequence

import torch

from blend.cpu_features import warn_if_emulated
from blend.defaults import DEFAULT_DTYPE, DEFAULT_MAX_NEW_TOKENS, DEFAULT_MODEL, DEFAULT_PROBE_PRECISION
from blend.engine_setup import EngineConfig, build_provenance, eos_ids, fp32_precision_label, torch_dtype
from blend.errors import InvalidRequestError, PromptTooLongError
from blend.gate import GateVerdict, QualityGate
from blend.gemm import pick_gemm_backend
from blend.generation import logits_sha256
from blend.kvcache import KVCache
from blend.model import ModelRunner
from blend.models import load_model
from blend.policy import ProbePrecision, RecomputePrecision, ReuseMode, ReusePolicy
from blend.prefill_paths import guard, prefill_blended, prefill_segments, prefill_unreused
from blend.prefilled import Prefilled, build_report
from blend.prefix_cache import is_hot
from blend.probe import top2_margin
from blend.probe_pass import probe_gemm_dtype, recompute_dtype, resolve_precisions, resolve_recompute_precision
from blend.prompt import Prompt, Segment, Turn, build_prompt, preamble_segment
from blend.refusals import Refusal, refusal_for
from blend.report import ReuseReport, Timings
from blend.segments import SegmentCache
from blend.store.base import KVStore
from blend.store.memory import MemoryStore


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

    def prefill(self, prompt: Prompt, policy: ReusePolicy, extra_capacity: int = 0, question: bool = True,
                refusal: Refusal | None = None) -> tuple[torch.Tensor | None, KVCache, ReuseReport]:
        """Run the prompt under ``policy``.

        Args:
            prompt: the segmented prompt.
            policy: what may be reused.
            extra_capacity: rows to reserve for decoding.
            question: False for a caller that computes the question itself and only takes the
                context's KV (the vLLM connector): a blend then stops the question's rows after
                its check layer, its cache ends before the question and its logits are None
                (other modes compute the whole prompt as usual).
            refusal: :func:`blend.refusals.refusal_for` of this prompt and policy, decided by the caller
                ahead (the server's scheduler: the gate's first run outside the prefill); None: decided here.

        Returns:
            first-token logits (V,) float32 (None as above), the filled cache, the report. What the
            prefill stored is in the store's first tier on return and reaches its persistent tiers
            in the background (write-behind); ``engine.segments.flush()`` waits for that, as
            :meth:`generate`, :meth:`close` and the streaming API do.
        """
        limit = self.dims.max_positions
        if len(prompt) + extra_capacity > limit:
            raise PromptTooLongError(f"prompt of {len(prompt)} tokens plus {extra_capacity} new tokens exceeds "
                                     f"the model's context of {limit} ({self.dims.context_from})")
        if policy.mode is ReuseMode.BLEND:  # the report says what ran: AUTO becomes bf16 or compute
            policy = resolve_precisions(policy, self.runner.dtype, self.runner.device)
        refusal = refusal_for(self, prompt, policy) if refusal is None else refusal
        cache = self.runner.new_cache(len(prompt) + extra_capacity)
        t0 = time.perf_counter()
        with torch.inference_mode():
            done, cache = self._run(prompt, policy, cache, question, refusal)
        ttft = time.perf_counter() - t0
        # a blend that ran (not refused): its selector, the share it recomputed (0 where nothing was
        # re-positioned: every document exact, or the hot prefix) and its first-token gap
        blended = policy.mode is ReuseMode.BLEND and not refusal.reason
        if blended and not done.check_rows:
            # no pass with a check layer answers (every document exact, a hot prefix, the guard's exact path,
            # full reuse): nothing ran above a check layer, so nothing ran in another precision and no reused
            # row was tempered (the temperature applies above the first check layer only). A refused blend's
            # policy is reported as asked: its report's ``applied`` says that it ran none of it
            policy = replace(policy, attention_precision=RecomputePrecision.COMPUTE,
                             linear_precision=RecomputePrecision.COMPUTE, reused_temperature=1.0)
        return done.logits, cache, build_report(done, policy, blended, refusal.reason, Timings(
            lookup_s=done.lookup_s, compute_s=ttft - done.lookup_s, ttft_s=ttft, gate_s=refusal.gate_s))

    def _run(self, prompt: Prompt, policy: ReusePolicy, cache: KVCache, question: bool, refusal: Refusal
             ) -> tuple[Prefilled, KVCache]:
        """The prefill ``policy`` asks for (or the one a refusal leaves); returns it and its cache."""
        self._check_fp32_precision()
        if refusal.reason or policy.mode is ReuseMode.NONE:
            return prefill_unreused(self.runner, self.segments, prompt, cache, refusal.reason, refusal.kinds), cache
        if policy.mode is ReuseMode.EXACT:
            return prefill_segments(self.segments, prompt, policy.prefix_limit, True, cache, policy.cache_salt), cache
        if policy.take_exact and is_hot(self.segments, prompt.segments[:-1], prompt.question, policy.cache_salt):
            # every document exact at its place, found stored again: the exact path (what a blend of an
            # all-exact prompt computes), the hot prefix attached; its gap reported as the loaded one's
            done = prefill_segments(self.segments, prompt, None, True, cache, policy.cache_salt)
            return replace(done, margin=top2_margin(done.logits), ratio=0.0), cache  # nothing recomputed
        done = prefill_blended(self.runner, self.segments, prompt, policy, cache, question)
        return guard(self.runner, self.segments, prompt, policy, done, cache)

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
