"""Sampling settings and the per-request sampler.

    logits (V,) ── - penalties + logit_bias ──/ temperature──► top-k ──► top-p (nucleus)
                ──► multinomial(generator)
    temperature 0 (or below MIN_SAMPLING_TEMPERATURE): argmax (greedy) of the adjusted logits,
    no randomness used

Penalties as OpenAI defines them, over the answer's tokens so far:
``logit[t] -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0)``;
``logit_bias`` adds its value to its tokens' logits at every step.

Each request owns a ``torch.Generator`` seeded from its ``seed``, so a sampled
answer depends only on the request's own logits and seed, never on which other
requests were decoded beside it or in which order.
"""

from __future__ import annotations

import secrets

import torch

from blend.generation_config import (  # the settings live apart (no torch): parsers check them before a model loads
    DEFAULT_MAX_TOKENS, MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_TOKENS, MAX_PENALTY, MAX_STOP_CHARS, MAX_STOP_STRINGS,
    MAX_TOP_LOGPROBS, GenerationConfig, InvalidSettingError,
)

__all__ = ["DEFAULT_MAX_TOKENS", "MAX_LOGIT_BIAS", "MAX_LOGIT_BIAS_TOKENS", "MAX_PENALTY", "MAX_STOP_CHARS",
           "MAX_STOP_STRINGS", "MAX_TOP_LOGPROBS", "GenerationConfig", "InvalidSettingError", "Sampler",
           "adjust_logits", "sample", "sampling_distribution"]

class Sampler:
    """Picks tokens for one request.

    Args:
        config: the request's settings (temperature, top_p, top_k, seed).
    """

    def __init__(self, config: GenerationConfig) -> None:
        self.config = config
        self.seed = config.seed if config.seed is not None else secrets.randbits(63)
        self._gen = torch.Generator().manual_seed(self.seed)  # a negative seed as its unsigned 64-bit twin (torch)

    def __call__(self, logits: torch.Tensor, counts: dict[int, int] | None = None) -> int:
        """Next token from next-token logits (V,) float32, given the answer's token counts so far."""
        return sample(logits, self.config, self._gen, counts)


def adjust_logits(logits: torch.Tensor, config: GenerationConfig, counts: dict[int, int] | None) -> torch.Tensor:
    """Logits after the penalties and the logit bias (a new tensor when anything changes).

    Args:
        logits: next-token logits (V,) float32.
        config: the penalties and bias.
        counts: how often each token occurs in the answer so far.

    Returns:
        (V,) float32.
    """
    if not config.adjusts_logits:
        return logits
    out = logits.clone()  # (V,)
    if counts and (config.presence_penalty or config.frequency_penalty):
        ids = torch.tensor(list(counts), dtype=torch.long)  # (n,)
        n = torch.tensor(list(counts.values()), dtype=torch.float32)  # (n,) each >= 1: every token is present
        out[ids] -= config.frequency_penalty * n + config.presence_penalty
    for tok, bias in config.logit_bias:  # ids checked against the vocabulary (check_vocabulary) first
        if tok < out.shape[0]:
            out[tok] += bias
    return out


def sample(logits: torch.Tensor, config: GenerationConfig, generator: torch.Generator,
           counts: dict[int, int] | None = None) -> int:
    """One token from logits (V,) under ``config``, drawing from ``generator``.

    Args:
        logits: next-token logits (V,), any float dtype (computed in float32).
        config: penalties, logit bias, temperature / top_k / top_p.
        generator: the request's CPU generator (advanced by one draw unless greedy).
        counts: the answer's token counts so far (for the penalties).

    Returns:
        The token id.
    """
    logits = adjust_logits(logits.detach().float().cpu(), config, counts)  # (V,)
    if config.greedy:
        return int(torch.argmax(logits))
    return int(torch.multinomial(_truncated_softmax(logits, config), 1, generator=generator))


def sampling_distribution(logits: torch.Tensor, config: GenerationConfig,
                          counts: dict[int, int] | None = None) -> torch.Tensor:
    """The distribution :func:`sample` draws the next token from.

    Args:
        logits: next-token logits (V,), any float dtype (computed in float32).
        config: penalties, logit bias, temperature / top_k / top_p.
        counts: the answer's token counts so far (for the penalties).

    Returns:
        (V,) float32 probabilities (their sum is 1 up to rounding): softmax of the adjusted logits over
        the temperature, cut to the top-k and then to the nucleus; greedy: all of it on the argmax.
    """
    logits = adjust_logits(logits.detach().float().cpu(), config, counts)  # (V,)
    if config.greedy:
        return torch.zeros_like(logits).index_fill_(0, torch.argmax(logits).reshape(1), 1.0)  # (V,)
    probs = _truncated_softmax(logits, config)  # (V,)
    return probs / probs.sum()


def _truncated_softmax(logits: torch.Tensor, config: GenerationConfig) -> torch.Tensor:
    """Probabilities of adjusted logits (V,) under temperature, top-k and top-p, not renormalized after
    the nucleus cut (multinomial takes weights)."""
    scaled = logits / config.temperature  # (V,)
    if 0 < config.top_k < scaled.shape[0]:
        kth = torch.topk(scaled, config.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)  # (V,)
    if config.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)  # (V,) each
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass of the more likely tokens
        drop = before >= config.top_p  # keeps the smallest prefix reaching top_p
        drop[0] = False  # and always the most likely token (top_p 0 keeps only it)
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_p)  # (V,)
    return probs
