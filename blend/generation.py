"""Token-by-token generation: sampling, stop rules, streamed text, usage.

:class:`TokenStream` is one answer's decoding state, independent of how its
logits are computed: the Python iterator below feeds it one sequence at a
time, the server's scheduler feeds it rows of a batched decode step. Both use
:func:`blend.batch_decode.decode_batch`, so an answer is the same program
either way.

Stop rules, checked on every sampled token:

    EOS token                      -> stop   (the token is not part of the answer)
    stop_at_newline and "\\n" in it -> stop   (idem; the engine's single-line answers)
    a stop string in the text      -> stop   (text cut before it; its tokens are counted)
    max_tokens reached             -> length

Streamed text never shows what a later token could take back: a trailing
incomplete UTF-8 sequence (decoded as U+FFFD) and a trailing partial match of
a stop string are held back until resolved. An answer that ends inside a
character ends with its U+FFFD (the text is ``decode(token_ids)``, cut at a
stop string), in the stream, the response body and the Python API alike.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from enum import Enum
from typing import Iterator, Sequence

import torch

from blend.batch_decode import DecodeBatching, decode_batch
from blend.detokenize import REPLACEMENT, IncrementalText
from blend.kvcache import KVCache
from blend.logprobs import TokenLogprob, token_logprob
from blend.prompt import Prompt
from blend.policy import ReusePolicy
from blend.report import ReuseReport
from blend.sampling import GenerationConfig, Sampler


class FinishReason(Enum):
    STOP = "stop"  # EOS, a stop string or the newline rule
    LENGTH = "length"  # max_tokens


@dataclass(frozen=True)
class Usage:
    """Token counts, as OpenAI reports them."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt rows whose KV came from the store (ReuseReport.reused_tokens)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


def _host_row(logits: torch.Tensor) -> torch.Tensor:
    """One logits row as float32 on the CPU, contiguous (a no-op for a CPU float32 row; a GPU
    engine's rows are copied, since only a CPU tensor has a numpy view)."""
    return logits.detach().float().cpu().contiguous()


def logits_sha256(logits: torch.Tensor) -> str:
    """sha256 of the float32 bytes of one logits row (as ``kvblend ask --json`` reports).

    Args:
        logits: (V,) on any device, any float dtype.

    Returns:
        The hex digest.
    """
    return hashlib.sha256(_host_row(logits).numpy().tobytes()).hexdigest()


class TokenStream:
    """The decoding state of one answer.

    Args:
        tokenizer: decodes the answer's tokens.
        eos_ids: tokens that end the answer.
        config: sampling and stop settings.
    """

    def __init__(self, tokenizer, eos_ids: set[int], config: GenerationConfig) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.config = config
        self.sampler = Sampler(config)
        self.tokens: list[int] = []  # the answer's tokens (completion_tokens)
        self._text = IncrementalText(tokenizer)  # decode(tokens), a window per token (not the whole answer)
        self.text = ""  # text emitted so far; the whole answer once finished
        self.finish_reason: FinishReason | None = None
        self._hash = hashlib.sha256()  # over every logits row a token was sampled from
        self._steps = 0
        self.counts: dict[int, int] = {}  # occurrences of each answer token (the penalties')
        self.logprobs: list[TokenLogprob] = []  # one per answer token, when config.logprobs is set
        self._logprobs_taken = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def generated(self) -> int:
        """Tokens sampled so far: the answer's and the one that ended it (an EOS, a newline under
        ``stop_at_newline``), which a decode step computed though the answer leaves it out. Usage's
        ``completion_tokens`` (as vLLM counts: a forced EOS is one generated token, not zero)."""
        return self._steps

    @property
    def next_input(self) -> int:
        """The token to feed to the next decode step (the last accepted one)."""
        return self.tokens[-1]

    @property
    def steps_sha256(self) -> str:
        """sha256 over the float32 bytes of every logits row sampled so far (first token included)."""
        return self._hash.copy().hexdigest()

    def step(self, logits: torch.Tensor) -> str:
        """Sample from next-token logits (V,) and apply the stop rules.

        Returns:
            Text that became final with this token (often "", e.g. while a
            multi-byte character or a possible stop string is incomplete).
        """
        if self.finished:
            raise RuntimeError("step() on a finished TokenStream")
        self._hash.update(memoryview(_host_row(logits).numpy()))  # no copy of a CPU float32 row
        self._steps += 1
        tok = self.sampler(logits, self.counts)
        cfg = self.config
        if tok in self.eos_ids and not cfg.ignore_eos:
            return self._finish(FinishReason.STOP, self._decoded())
        if cfg.stop_at_newline and "\n" in self.tokenizer.decode([tok]):
            return self._finish(FinishReason.STOP, self._decoded())
        self.tokens.append(tok)
        self.counts[tok] = self.counts.get(tok, 0) + 1
        if cfg.logprobs is not None:
            self.logprobs.append(token_logprob(logits, tok, cfg.logprobs))
        full = self._text.push(tok)
        # a stop string is looked for in text no later token can change: a trailing U+FFFD may be a character
        # still incomplete (a stop string holding U+FFFD matched it, and a character the next token completed
        # ended the answer before it); it is looked for there once decided, at the latest when the answer ends
        cut = self._stop_index(full[: self._settled_end(full)])
        if cut is not None:
            return self._finish(FinishReason.STOP, full[:cut])
        if len(self.tokens) >= cfg.max_tokens:
            return self._finish(FinishReason.LENGTH, full)
        return self._emit(full[: self._safe_end(full)])

    @property
    def answer_logprobs(self) -> tuple[TokenLogprob, ...] | None:
        """Every answer token's log-probability, or None when the config did not ask for them."""
        return tuple(self.logprobs) if self.config.logprobs is not None else None

    def take_logprobs(self) -> tuple[TokenLogprob, ...]:
        """The answer tokens' log-probabilities recorded since the last call (for a stream's chunks)."""
        new = tuple(self.logprobs[self._logprobs_taken:])
        self._logprobs_taken = len(self.logprobs)
        return new

    def finish_length(self) -> str:
        """End the answer for lack of room (the context is full); returns the flushed text."""
        return self._finish(FinishReason.LENGTH, self._decoded())

    # ---- text ------------------------------------------------------------------------

    def _decoded(self) -> str:
        return self._text.text

    def _stop_index(self, full: str) -> int | None:
        hits = [i for s in self.config.stop if (i := full.find(s, max(0, len(self.text) - len(s)))) >= 0]
        return min(hits) if hits else None

    def _settled_end(self, full: str) -> int:
        """End of the text that no later token can change: before trailing U+FFFDs not shown yet (the bytes of
        a multi-byte character may still be incomplete)."""
        end = len(full)
        while end > len(self.text) and full[end - 1] == REPLACEMENT:
            end -= 1
        return end

    def _safe_end(self, full: str) -> int:
        """End of the text that no later token can change or cut."""
        end = self._settled_end(full)
        hold = 0
        for s in self.config.stop:  # the longest suffix that may still grow into a stop string
            for k in range(min(len(s) - 1, end), 0, -1):
                if full[end - k:end] == s[:k]:
                    hold = max(hold, k)
                    break
        return max(end - hold, len(self.text))

    def _emit(self, upto: str) -> str:
        if not upto.startswith(self.text):  # a tokenizer re-spelled earlier text: keep what was shown
            return ""
        delta, self.text = upto[len(self.text):], upto
        return delta

    def _finish(self, reason: FinishReason, final: str) -> str:
        """End the answer at ``final`` and return what of it was not streamed yet.

        A trailing U+FFFD stays: the answer's last tokens are bytes of a character it ended inside
        (max_tokens, EOS, the context's end), and the text reads as ``decode(token_ids)`` does (as
        transformers' TextStreamer flushes it, and as ``Engine.generate`` answers). Dropping it left
        tokens counted in usage and listed in logprobs (text_offset past the end) with no text. The text's last
        U+FFFDs are final then, so a stop string that holds them cuts the answer there (a stop, not a length)."""
        cut = self._stop_index(final)
        if cut is not None:
            reason, final = FinishReason.STOP, final[:cut]
        self.finish_reason = reason
        return self._emit(final)

    def completion(self, prompt: Prompt, first_logits: torch.Tensor, report: ReuseReport, ttft_s: float,
                   e2e_s: float) -> Completion:
        """The finished answer of this stream (the API's generation and the server's requests alike).

        Args:
            prompt: what was answered.
            first_logits: (V,) float32, the logits that chose the first token.
            report: the prefill's reuse report.
            ttft_s: time to the first token.
            e2e_s: time to the last token.

        Returns:
            The completion: text, token ids, finish reason, timings, report, usage and logprobs.
        """
        return Completion(
            text=self.text, token_ids=list(self.tokens), prompt_token_ids=prompt.token_ids,
            finish_reason=self.finish_reason, first_logits=first_logits, steps_sha256=self.steps_sha256,
            ttft_s=ttft_s, e2e_s=e2e_s, report=report,
            usage=Usage(len(prompt), self.generated, report.reused_tokens), seed=self.sampler.seed,
            logprobs=self.answer_logprobs,
        )


@dataclass
class Completion:
    """A finished answer."""

    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: FinishReason
    first_logits: torch.Tensor  # (V,) float32: the logits that chose the first token
    steps_sha256: str  # sha256 over every sampled-from logits row
    ttft_s: float
    e2e_s: float  # start (the scheduler: submission) to the last token
    report: ReuseReport
    usage: Usage
    seed: int
    logprobs: tuple[TokenLogprob, ...] | None = None  # per answer token, when the config asked for them

    def logits_sha256(self) -> str:
        return logits_sha256(self.first_logits)


class Generation:
    """A streaming answer from the Python API: iterate for text as it is decided.

    Nothing runs until the first ``next()``; :meth:`result` runs to the end.

    Args:
        engine: a :class:`blend.engine.Engine`.
        prompt: from ``engine.build_prompt``.
        policy: reuse policy (default exact).
        config: sampling and stop settings (default greedy, 32 tokens).
        batching: decode GEMM mode (the server's, to get its exact numbers).
    """

    def __init__(self, engine, prompt: Prompt, policy: ReusePolicy | None = None,
                 config: GenerationConfig | None = None,
                 batching: DecodeBatching = DecodeBatching.THROUGHPUT) -> None:
        self.engine = engine
        self.prompt = prompt
        self.policy = policy or ReusePolicy.exact()
        self.config = config or GenerationConfig()
        self.config.check_vocabulary(engine.dims.vocab)
        self.batching = batching
        self.stream = TokenStream(engine.tokenizer, engine.eos_ids, self.config)
        self._completion: Completion | None = None
        self._iter = self._run()

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        return next(self._iter)

    def _run(self) -> Iterator[str]:
        t0 = time.perf_counter()
        first, cache, report = self.engine.prefill(self.prompt, self.policy, self.config.max_tokens)
        delta = self.stream.step(first)
        ttft = time.perf_counter() - t0 - report.timings.gate_s  # the quality gate's one-off run is not the request's
        if delta:
            yield delta
        while not self.stream.finished:
            delta = self.stream.step(self._decode(cache))
            if delta:
                yield delta
        self.engine.segments.flush()  # done means stored in every tier (write-behind)
        self._completion = self.stream.completion(self.prompt, first, report, ttft, time.perf_counter() - t0)

    def _decode(self, cache: KVCache) -> torch.Tensor:
        return decode_batch(self.engine.runner, [cache], [self.stream.next_input], self.batching)[0]

    def result(self) -> Completion:
        """Run to the end (if not yet) and return the answer."""
        for _ in self._iter:
            pass
        assert self._completion is not None
        return self._completion


def stream(engine, prompt: Prompt, policy: ReusePolicy | None = None, config: GenerationConfig | None = None,
           batching: DecodeBatching = DecodeBatching.THROUGHPUT) -> Generation:
    """Stream an answer: ``for text in stream(engine, prompt): print(text, end="")``.

    See :class:`Generation`; ``.result()`` gives the :class:`Completion` afterwards.

    Args:
        engine: a :class:`blend.engine.Engine`.
        prompt: from ``engine.build_prompt``.
        policy: reuse policy; None: exact reuse.
        config: sampling and stop settings; None: greedy, 32 tokens.
        batching: decode GEMM mode (the server's, to get its exact numbers).

    Returns:
        The :class:`Generation`; nothing runs until its first ``next()``.
    """
    return Generation(engine, prompt, policy, config, batching)


def generate(engine, prompt: Prompt, policy: ReusePolicy | None = None, config: GenerationConfig | None = None,
             batching: DecodeBatching = DecodeBatching.THROUGHPUT) -> Completion:
    """Generate a whole answer (see :func:`stream`).

    Args:
        engine: a :class:`blend.engine.Engine`.
        prompt: from ``engine.build_prompt``.
        policy: reuse policy; None: exact reuse.
        config: sampling and stop settings; None: greedy, 32 tokens.
        batching: decode GEMM mode (the server's, to get its exact numbers).

    Returns:
        The finished :class:`Completion`: text, token ids, finish reason, timings and reuse report.
    """
    return Generation(engine, prompt, policy, config, batching).result()


def stop_strings(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    """Normalize OpenAI's ``stop`` (a string, a list, or null) to a tuple.

    Args:
        stop: one stop string, a sequence of them, or None.

    Returns:
        The stop strings, in order (empty for None).
    """
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    return tuple(stop)
