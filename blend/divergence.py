"""How far a method's next-token distribution is from full prefill's: one definition for every
consumer (the quality gate that decides whether a model may blend, and the evals that calibrated it).
"""

from __future__ import annotations

import math

import torch


def kl_divergence(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """KL(P || Q) in nats between the softmax distributions of two logit vectors.

    Computed in float64 from log-softmax; terms where P is zero contribute 0 (a token the reference
    masks to -inf is not a NaN).

    Args:
        p_logits: (V,) logits of the reference (full prefill).
        q_logits: (V,) logits of the method.

    Returns:
        KL >= 0 (inf if Q puts zero mass where P does not; NaN if either side holds a NaN).

    Raises:
        ValueError: not two (V,) vectors of one shape.
    """
    if p_logits.shape != q_logits.shape or p_logits.dim() != 1:
        raise ValueError(f"need two (V,) logit vectors, got {tuple(p_logits.shape)} and {tuple(q_logits.shape)}")
    if bool(torch.isnan(p_logits).any()) or bool(torch.isnan(q_logits).any()):
        return math.nan  # a NaN logit on either side: no divergence to report (a NaN reference read as 0)
    lp = torch.log_softmax(p_logits.detach().to(torch.float64), dim=-1)  # (V,)
    lq = torch.log_softmax(q_logits.detach().to(torch.float64), dim=-1)  # (V,)
    p = lp.exp()  # (V,)
    terms = torch.where(p > 0, p * (lp - lq), torch.zeros_like(p))  # (V,)
    kl = float(terms.sum())
    return max(kl, 0.0) if not math.isnan(kl) else kl


def top1_agree(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """1.0 when both logit vectors have the same argmax, else 0.0.

    Args:
        p_logits: one position's logits, (V,).
        q_logits: the other run's logits at that position, (V,).

    Returns:
        1.0 or 0.0, to be averaged over positions.
    """
    return float(int(torch.argmax(p_logits)) == int(torch.argmax(q_logits)))
