"""Sampling settings and the per-request sampler.

    logits (V,) ──/ temperature──► top-k ──► top-p (nucleus) ──► multinomial(generator)
    temperature 0: argmax (greedy), no randomness used

Each request owns a ``torch.Generator`` seeded from its ``seed``, so a sampled
answer depends only on the request's own logits and seed, never on which other
requests were decoded beside it or in which order.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import torch

from blend.errors import InvalidRequestError

DEFAULT_MAX_TOKENS = 32  # the Python API's and the CLI's budget (the server has its own, see blend.serve.config)
MAX_STOP_STRINGS = 4  # as OpenAI allows
MAX_STOP_CHARS = 64
MAX_TOP_LOGPROBS = 20  # alternatives per token at most (OpenAI's chat limit, vLLM's default)


@dataclass(frozen=True)
class GenerationConfig:
    """How one request decodes (validated on construction).

    Attributes:
        max_tokens: generated tokens at most (>= 1).
        temperature: 0 = greedy; otherwise logits are divided by it (<= 2).
        top_p: nucleus sampling: the smallest set of tokens whose probability reaches it (0 < p <= 1).
        top_k: keep only the k most likely tokens (0 = off).
        seed: sampling seed; None draws one (answers then differ run to run).
        stop: strings that end the answer; the answer's text stops before the first one.
        stop_at_newline: end the answer before the first token containing a newline
            (the engine's historical single-line answers).
        ignore_eos: keep going past end-of-sequence tokens (fixed-length answers for
            benchmarks, as vLLM's ``ignore_eos``).
        logprobs: None = off; N = record each answer token's log-probability and the N
            most likely alternatives of its step (0..MAX_TOP_LOGPROBS; see :mod:`blend.logprobs`).
    """

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_at_newline: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _finite(self.temperature) or not 0.0 <= self.temperature <= 2.0:
            raise InvalidRequestError(f"temperature must be in [0, 2], got {self.temperature!r}")
        if not _finite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**63):
            raise InvalidRequestError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if isinstance(self.stop, str) or not isinstance(self.stop, tuple):
            raise InvalidRequestError("stop must be a tuple of strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_CHARS:
                raise InvalidRequestError(f"each stop string must be 1..{MAX_STOP_CHARS} characters, got {s!r}")
        n = self.logprobs
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_TOP_LOGPROBS):
            raise InvalidRequestError(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}] (alternatives per "
                                      f"token) or None, got {n!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class Sampler:
    """Picks tokens for one request.

    Args:
        config: the request's settings (temperature, top_p, top_k, seed).
    """

    def __init__(self, config: GenerationConfig) -> None:
        self.config = config
        self.seed = config.seed if config.seed is not None else secrets.randbits(63)
        self._gen = torch.Generator().manual_seed(self.seed)

    def __call__(self, logits: torch.Tensor) -> int:
        """Next token from next-token logits (V,) float32."""
        return sample(logits, self.config, self._gen)


def sample(logits: torch.Tensor, config: GenerationConfig, generator: torch.Generator) -> int:
    """One token from logits (V,) under ``config``, drawing from ``generator``.

    Args:
        logits: next-token logits (V,), any float dtype (computed in float32).
        config: temperature / top_k / top_p.
        generator: the request's CPU generator (advanced by one draw unless greedy).

    Returns:
        The token id.
    """
    logits = logits.detach().float().cpu()  # (V,)
    if config.greedy:
        return int(torch.argmax(logits))
    scaled = logits / config.temperature  # (V,)
    if 0 < config.top_k < scaled.shape[0]:
        kth = torch.topk(scaled, config.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)  # (V,)
    if config.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)  # (V,) each
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass of the more likely tokens
        drop = before >= config.top_p  # keeps the smallest prefix reaching top_p (never the first token)
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_p)  # (V,)
    return int(torch.multinomial(probs, 1, generator=generator))
