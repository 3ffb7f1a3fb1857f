"""Attention that hands back its probabilities: the query probe's, and the mass a selector ranks rows by.

Plain torch on every device (no Triton kernel): a few queries over every key, with the (Hq, S, T)
probabilities or their mean per key, causal by absolute position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .checks import nondecreasing, same_positions


def query_attention_mass(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, k_pos: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """Mean attention probability from a set of queries to every key (a selection signal).

    Args:
        q: (Hq, S, D) queries after RoPE; q_pos: (S,) their absolute positions.
        k: (Hkv, T, D) keys after RoPE; k_pos: (T,) their absolute positions.
        scale: softmax scale.

    Returns:
        (T,) float32 attention mass, averaged over heads and queries (causal by position).
    """
    group = q.shape[0] // k.shape[0]
    kr = k.float().repeat_interleave(group, dim=0)  # (Hq, T, D)
    scores = torch.matmul(q.float(), kr.transpose(1, 2)) * scale  # (Hq, S, T)
    scores = scores.masked_fill(~(k_pos[None, :] <= q_pos[:, None]), float("-inf"))
    return torch.softmax(scores, dim=-1).mean(dim=(0, 1))  # (T,)


@dataclass(frozen=True)
class HiddenKeys:
    """The keys some query of :func:`attention_probs` cannot see: columns [seen, T) where ``hide``."""

    seen: int  # keys [0, seen) are visible to every query
    hide: torch.Tensor  # (S, T - seen) bool: key hidden from the query (k_pos > q_pos)
    q_pos: torch.Tensor  # (S,) the positions it was made for
    k_pos: torch.Tensor  # (T,)

    def made_for(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> bool:
        """Whether these are the positions it was made from (the same tensors: free; else compared)."""
        return same_positions(self.q_pos, q_pos) and same_positions(self.k_pos, k_pos)


def hidden_keys(q_pos: torch.Tensor, k_pos: torch.Tensor) -> HiddenKeys:
    """The causal mask of :func:`attention_probs` for these positions (made once by a caller that
    attends at them layer after layer: the probe's question rows).

    Args:
        q_pos: (S,) query positions; k_pos: (T,) key positions.

    Returns:
        Where the mask starts and what it hides.
    """
    # keys up to the first query's position are seen by every query when k_pos is sorted (the probe's
    # layout); only the rest is masked (the same numbers as masking every column)
    seen = int(torch.searchsorted(k_pos, q_pos.min(), right=True)) if q_pos.numel() and nondecreasing(k_pos) else 0
    return HiddenKeys(seen, ~(k_pos[None, seen:] <= q_pos[:, None]), q_pos, k_pos)


def attention_probs(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pos: torch.Tensor,
                    scale: float, hidden: HiddenKeys | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a few queries, with its probabilities (for the query probe).

    Args:
        q: (Hq, S, D) queries after RoPE; q_pos: (S,) their positions.
        k, v: (Hkv, T, D), K after RoPE; k_pos: (T,) their positions.
        scale: softmax scale.
        hidden: :func:`hidden_keys` of these positions (None: made here).

    Returns:
        output (Hq, S, D) in q's dtype, and probabilities (Hq, S, T) float32 (causal by position).

    Raises:
        ValueError: ``hidden`` made for other positions.
    """
    hq, s, dd = q.shape
    hkv = k.shape[0]
    if hidden is None:
        hidden = hidden_keys(q_pos, k_pos)
    elif not hidden.made_for(q_pos, k_pos):
        raise ValueError("hidden keys made for other positions than the call's")
    qg = q.float().reshape(hkv, (hq // hkv) * s, dd)  # (Hkv, g S, D): query head h reads KV head h // g
    scores = torch.matmul(qg, k.float().transpose(1, 2)).view(hq, s, -1).mul_(scale)  # (Hq, S, T)
    scores[:, :, hidden.seen:].masked_fill_(hidden.hide, float("-inf"))  # in place, only where some query is blind
    probs = torch.softmax(scores, dim=-1)  # (Hq, S, T)
    out = torch.matmul(probs.reshape(hkv, (hq // hkv) * s, -1), v.float()).view(hq, s, dd)  # (Hq, S, D)
    return out.to(q.dtype), probs
