"""Log-probabilities of the answer's tokens (OpenAI's ``logprobs``).

A token's log-probability is read from the model's own distribution for that
step: ``log_softmax`` of the logits row it was sampled from, before
temperature, top-k or top-p (vLLM's default, "raw" log-probabilities), so a
blended answer's log-probabilities compare directly with an exact one's. The
alternatives are that row's most likely tokens, most likely first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """One answer token's log-probability and the step's most likely alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, log-probability), most likely first


def token_logprob(logits: torch.Tensor, token_id: int, top_n: int) -> TokenLogprob:
    """The log-probability of ``token_id`` under one step's logits.

    Args:
        logits: (V,) the step's next-token logits (any float dtype).
        token_id: the token that was sampled.
        top_n: how many alternatives to keep (0: none).

    Returns:
        The token's entry.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)  # (V,)
    top: tuple[tuple[int, float], ...] = ()
    if top_n > 0:
        vals, ids = torch.topk(logp, min(top_n, logp.shape[0]))  # (n,) each
        top = tuple(zip(ids.tolist(), vals.tolist()))
    return TokenLogprob(int(token_id), float(logp[token_id]), top)
