"""Selectors: which reused rows to recompute, at a given budget.

Every selector sees the same :class:`SelectionInputs` (one entry per
candidate row) and returns positions into the candidate list, so the
evaluation compares them at equal budgets.

- ``v`` / ``k`` / ``kv``: largest deviation between fresh and cached V, K, or
  both (normalised and summed) at the check layer (CacheBlend; LMCache uses K).
- ``lead``: the first tokens of each document, round-robin (EPIC's fix for
  attention sinks at chunk starts).
- ``query``: largest attention mass from the question's tokens at the check layer.
- ``random``: a seeded uniform baseline.
- ``combo``: attention-weighted V deviation, a_j * ||dV_j||: to first order the
  error a stale row j adds to the question's attention output is its attention
  weight times its value error, so rows that are both stale and looked at
  rank first.
- ``probe`` (issue 14): the query probe's attention (the question's rows run
  alone from the check layer to the top over the re-positioned cached KV;
  mean over those layers, heads and question tokens) times the V deviation:
  ``combo`` with the attention the question pays at depth instead of at the
  check layer only.
- ``probe_attn``: the query probe's attention alone (no V deviation), so it
  also works at check layer 0, where fresh and cached V are the same numbers
  (layer 0's K/V depend on the token only) and no row needs layer 0 computed
  in full before selecting.
- ``split``: half the budget by ``combo``, the rest by ``v`` among the rows
  combo left: combo follows the question's attention, which misses stale rows
  whose change matters through another document (two-hop prompts), and V
  deviation sees those.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from blend.policy import SELECTOR_NAMES
from blend.probe import probe_score, stop_count


@dataclass(frozen=True)
class SelectionInputs:
    """Per-candidate signals at a check layer. All tensors are (N,)."""

    dev_k: torch.Tensor  # float32 ||K_fresh - K_cached|| over heads and dims
    dev_v: torch.Tensor  # float32 ||V_fresh - V_cached||
    rel_v: torch.Tensor  # float32 dev_v / ||V_cached|| (scale-free, for thresholds)
    doc: torch.Tensor  # int64 document index of the row
    offset: torch.Tensor  # int64 token offset of the row inside its document
    query_attn: torch.Tensor | None  # float32 attention mass from the question's tokens
    seed: int = 0
    probe_attn: torch.Tensor | None = None  # float32 query probe's attention, mean over probed layers
    v_norm: torch.Tensor | None = None  # float32 ||V_cached|| (scale of the adaptive budget's estimate)


def _top(score: torch.Tensor, budget: int) -> torch.Tensor:
    budget = min(budget, score.numel())
    # stable tie-break by candidate order keeps selection deterministic
    order = torch.argsort(score, descending=True, stable=True)
    return order[:budget]


def _norm(x: torch.Tensor) -> torch.Tensor:
    return x / x.mean().clamp_min(1e-12)


def _lead(inp: SelectionInputs, budget: int) -> torch.Tensor:
    # round-robin over documents: offset 0 of every document, then offset 1, ...
    key = inp.offset.double() * (int(inp.doc.max()) + 1 if inp.doc.numel() else 1) + inp.doc.double()
    return torch.argsort(key, stable=True)[: min(budget, key.numel())]


def _random(inp: SelectionInputs, budget: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(inp.seed)
    return torch.randperm(inp.dev_v.numel(), generator=g)[: min(budget, inp.dev_v.numel())]


def _need_query(inp: SelectionInputs) -> torch.Tensor:
    if inp.query_attn is None:
        raise ValueError("this selector needs the question's attention at the check layer")
    return inp.query_attn


def _combo_score(inp: SelectionInputs) -> torch.Tensor:
    return _need_query(inp) * inp.dev_v  # (N,) a_j * ||dV_j||


def _need_probe(inp: SelectionInputs) -> torch.Tensor:
    if inp.probe_attn is None:
        raise ValueError("this selector needs the query probe's attention")
    return inp.probe_attn  # (N,)


def _probe_score(inp: SelectionInputs) -> torch.Tensor:
    return probe_score(_need_probe(inp), inp.dev_v)  # (N,) a_probe_j * ||dV_j||


def _split(inp: SelectionInputs, budget: int) -> torch.Tensor:
    n = inp.dev_v.numel()
    budget = min(budget, n)
    first = _top(_combo_score(inp), (budget + 1) // 2)  # (ceil(b/2),)
    taken = torch.zeros(n, dtype=torch.bool)
    taken[first] = True
    by_v = torch.argsort(inp.dev_v, descending=True, stable=True)  # (N,)
    return torch.cat([first, by_v[~taken[by_v]][: budget - first.numel()]])


SELECTORS: dict[str, Callable[[SelectionInputs, int], torch.Tensor]] = {
    "v": lambda inp, b: _top(inp.dev_v, b),
    "k": lambda inp, b: _top(inp.dev_k, b),
    "kv": lambda inp, b: _top(_norm(inp.dev_k) + _norm(inp.dev_v), b),
    "lead": _lead,
    "query": lambda inp, b: _top(_need_query(inp), b),
    "random": _random,
    "combo": lambda inp, b: _top(_combo_score(inp), b),
    "split": _split,
    "probe": lambda inp, b: _top(_probe_score(inp), b),
    "probe_attn": lambda inp, b: _top(_need_probe(inp), b),
}
NEEDS_QUERY_ATTENTION = frozenset({"query", "combo", "split"})
assert set(SELECTORS) == set(SELECTOR_NAMES)


def select(name: str, inp: SelectionInputs, budget: int) -> torch.Tensor:
    """Pick ``budget`` candidates.

    Args:
        name: selector name (see module docstring).
        inp: per-candidate signals.
        budget: how many rows to keep (clipped to the candidate count).

    Returns:
        (min(budget, N),) int64 positions into the candidate list, sorted ascending.
    """
    if budget <= 0 or inp.dev_v.numel() == 0:
        return torch.empty(0, dtype=torch.long)
    return torch.sort(SELECTORS[name](inp, budget)).values


def select_threshold(inp: SelectionInputs, threshold: float, cap: int) -> torch.Tensor:
    """Every candidate whose relative V deviation exceeds ``threshold``, at most ``cap`` (largest first).

    Args:
        inp: the check layer's per-candidate signals (its ``rel_v``).
        threshold: the relative V deviation a row must exceed.
        cap: the most rows taken (``max_ratio`` x reused tokens).

    Returns:
        (K,) int64 positions into the candidate list, sorted ascending.
    """
    over = torch.nonzero(inp.rel_v > threshold).flatten()  # (M,)
    if over.numel() > cap:
        over = over[_top(inp.rel_v[over], cap)]
    return torch.sort(over).values


def select_auto(inp: SelectionInputs, target: float, cap: int, sensitivity: float = 1.0) -> torch.Tensor:
    """Adaptive budget (issue 14): the fewest rows, ranked by the probe score, whose left-over
    estimated error is <= ``target``, at most ``cap``. The estimate: ``sensitivity`` (the entropy of
    the probe's first-token distribution: a peaked answer barely moves) x the sum of
    probe_attn x ||dV|| over the rows not taken, over the mean ||V_cached||.

    Args:
        inp: the check layer's per-candidate signals (``probe_attn`` needed; no ``v_norm``: nothing taken).
        target: the acceptable left-over estimate.
        cap: the most rows taken (``max_ratio`` x reused tokens).
        sensitivity: the estimate's factor (the probe's first-token entropy; 1: none).

    Returns:
        (K,) int64 positions into the candidate list, sorted ascending.

    Raises:
        ValueError: ``inp`` carries no probe attention.
    """
    score = _probe_score(inp)  # (N,)
    if inp.v_norm is None or score.numel() == 0:
        return torch.empty(0, dtype=torch.long)
    est = sensitivity * score.double() / inp.v_norm.double().mean().clamp_min(1e-12)  # (N,) scale-free
    return torch.sort(_top(score, stop_count(est, target, 0, cap))).values
