"""Query-probed selection: scoring math over the question's attention at depth.

The *query probe* runs the question's rows alone through the layers after the
check layer, over the re-positioned cached KV of every document (a ratio-0
blend that keeps the check layer's fresh KV; a few percent of a full
prefill), and records the question's attention to every document row at
every layer. ``combo`` weighs a row's V deviation by one layer's attention;
the probe sees where the question reads at depth.

Everything here is a pure function over per-candidate tensors, so an engine
can call it from its check layer and a laboratory can replay it offline:

- :func:`probe_weight`: one weight per row from the per-layer attention.
- :func:`probe_score`: weight^alpha x ||dV||^beta (``alpha=beta=1``: the first-order
  error a stale row adds to the question's attention output, summed over depth).
- :func:`dilate`: spans: a row's score becomes the max over its neighbours in
  the same document (CacheClip: a stale row's neighbours are usually stale too).
- :func:`doc_budgets` / :func:`select_by_doc`: the budget split across
  documents by the question's attention mass to each.
- :func:`with_sinks`: the first rows of every document on top of a selection.
- :func:`stop_count`: the adaptive budget, the smallest prefix of the ranking
  whose left-over estimated error falls below a target.
"""

from __future__ import annotations

from enum import Enum

import torch


class LayerReduce(Enum):
    """How per-layer attention becomes one weight per row."""

    MEAN = "mean"  # mean over the probed layers
    MAX = "max"  # max over the probed layers


def probe_weight(attn: torch.Tensor, first: int = 0, reduce: LayerReduce = LayerReduce.MEAN) -> torch.Tensor:
    """One attention weight per row from the probe's per-layer attention.

    Args:
        attn: (L', N) attention per probed layer and row.
        first: skip the first ``first`` probed layers.
        reduce: mean or max over the kept layers.

    Returns:
        (N,) float32 weights.
    """
    a = attn[first:]  # (L'', N)
    if a.shape[0] == 0:
        raise ValueError(f"no probed layer left after skipping {first} of {attn.shape[0]}")
    return a.mean(dim=0) if reduce is LayerReduce.MEAN else a.max(dim=0).values


def probe_score(weight: torch.Tensor, dev_v: torch.Tensor, alpha: float = 1.0, beta: float = 1.0) -> torch.Tensor:
    """weight^alpha * dev_v^beta (beta = 0: attention alone). (N,).

    Args:
        weight: the probe's attention weight per candidate row (:func:`probe_weight`), (N,).
        dev_v: each row's V deviation at the check layer, (N,).
        alpha: the attention's exponent.
        beta: the deviation's exponent (0: the deviation is left out).

    Returns:
        The score per row, (N,); negative inputs count as 0.
    """
    return weight.clamp_min(0).pow(alpha) * (dev_v.clamp_min(0).pow(beta) if beta else 1.0)


def dilate(score: torch.Tensor, doc: torch.Tensor, window: int) -> torch.Tensor:
    """Each row's score becomes the max over rows within ``window`` of it in the same document.

    Args:
        score: (N,) scores, rows in prompt order.
        doc: (N,) document index (rows of one document are contiguous).
        window: neighbours on each side (0: unchanged).

    Returns:
        (N,) dilated scores; the original score breaks ties (added at 1e-6 weight).
    """
    if window <= 0:
        return score
    n = score.numel()
    out = score.clone()
    for s in range(1, window + 1):
        same_r = torch.zeros(n, dtype=torch.bool)
        same_r[:-s] = doc[:-s] == doc[s:]
        right = torch.zeros(n, dtype=score.dtype)
        right[:-s] = score[s:]
        out = torch.where(same_r, torch.maximum(out, right), out)
        same_l = torch.zeros(n, dtype=torch.bool)
        same_l[s:] = doc[s:] == doc[:-s]
        left = torch.zeros(n, dtype=score.dtype)
        left[s:] = score[:-s]
        out = torch.where(same_l, torch.maximum(out, left), out)
    return out + 1e-6 * score


def top(score: torch.Tensor, budget: int) -> torch.Tensor:
    """Positions of the ``budget`` largest scores (stable ties), unsorted.

    Args:
        score: one score per row, (N,).
        budget: how many rows (clamped to [0, N]).

    Returns:
        Their positions, (min(budget, N),) int64, highest score first.
    """
    return torch.argsort(score, descending=True, stable=True)[: max(0, min(budget, score.numel()))]


def doc_budgets(mass: torch.Tensor, counts: torch.Tensor, budget: int, floor: float = 0.0) -> torch.Tensor:
    """Split ``budget`` across documents in proportion to ``mass`` (largest remainder), capped by size.

    Args:
        mass: (K,) non-negative weight per document (e.g. the question's attention mass).
        counts: (K,) int64 candidate rows per document.
        budget: total rows.
        floor: share of the budget spread evenly by size first (0: all by mass).

    Returns:
        (K,) int64 rows per document, summing to min(budget, counts.sum()).
    """
    budget = int(min(budget, int(counts.sum())))
    cnt = counts.double()
    share = mass.double().clamp_min(0)
    share = share / share.sum() if float(share.sum()) > 0 else cnt / cnt.sum()
    share = floor * cnt / cnt.sum() + (1 - floor) * share
    alloc = torch.zeros_like(counts)
    left = budget
    while left > 0:  # water-filling: documents at their size give their share to the others
        room = counts - alloc  # (K,)
        active = room > 0
        w = torch.where(active, share, torch.zeros_like(share))
        if float(w.sum()) <= 0:  # only massless documents have room: fill them by size
            w = room.double()
        want = w / w.sum() * left
        add = torch.minimum(torch.floor(want).long(), room)
        if int(add.sum()) == 0:  # one row to the largest remaining claim
            add = torch.zeros_like(counts)
            add[int(torch.argmax(torch.where(active, want, torch.full_like(want, -1.0))))] = 1
        alloc += add
        left = budget - int(alloc.sum())
    return alloc


def select_by_doc(score: torch.Tensor, doc: torch.Tensor, budgets: torch.Tensor) -> torch.Tensor:
    """The top ``budgets[d]`` rows of each document ``d`` by ``score``. Returns positions, sorted.

    Args:
        score: one score per candidate row, (N,).
        doc: each row's document index, (N,) int64.
        budgets: rows to pick per document, (n_docs,) int (:func:`doc_budgets`).

    Returns:
        The picked rows' positions, (sum of budgets, at most,) int64, ascending.
    """
    picked = []
    for d in range(budgets.numel()):
        idx = torch.nonzero(doc == d).flatten()  # (N_d,)
        picked.append(idx[top(score[idx], int(budgets[d]))])
    return torch.sort(torch.cat(picked)).values if picked else torch.empty(0, dtype=torch.long)


def with_sinks(picked: torch.Tensor, offset: torch.Tensor, sinks: int) -> torch.Tensor:
    """``picked`` plus every row with offset < ``sinks`` (the first rows of each document). Sorted, distinct.

    Args:
        picked: positions already selected, (P,) int64.
        offset: each candidate row's offset inside its document, (N,) int64.
        sinks: how many first rows of each document to add (0: none).

    Returns:
        The positions, (P',) int64, ascending, without repeats.
    """
    extra = torch.nonzero(offset < sinks).flatten()
    return torch.unique(torch.cat([picked, extra]))


def residual(score: torch.Tensor, count: int) -> torch.Tensor:
    """Left-over estimated error after keeping the ``count`` best rows: sum of the rest.

    Args:
        score: (N,) per-row error estimates (e.g. :func:`probe_score`).
        count: rows kept.

    Returns:
        scalar tensor.
    """
    s = torch.sort(score, descending=True).values
    return s[count:].sum()


def stop_count(score: torch.Tensor, target: float, min_count: int, max_count: int) -> int:
    """Adaptive budget: the fewest top rows whose left-over sum of ``score`` is <= ``target``.

    Args:
        score: (N,) per-row error estimates.
        target: acceptable left-over estimate (calibrated against measured KL).
        min_count, max_count: bounds on the answer (max: ``max_ratio`` x reused tokens).

    Returns:
        count in [min_count, max_count] (max_count when the target is never met).
    """
    s = torch.sort(score, descending=True).values.double()  # (N,)
    tail = torch.flip(torch.cumsum(torch.flip(s, [0]), 0), [0])  # tail[k] = sum s[k:]
    tail = torch.cat([tail, torch.zeros(1, dtype=tail.dtype)])  # (N+1,) left-over after keeping k
    ok = torch.nonzero(tail <= target).flatten()
    k = int(ok[0]) if ok.numel() else s.numel()
    return max(min_count, min(k, max_count))


def entropy(logits: torch.Tensor) -> float:
    """Entropy (nats) of the softmax of a (V,) logit vector (the adaptive budget's sensitivity factor:
    a peaked first-token distribution barely moves under a small logit error).

    Args:
        logits: one position's logits, (V,).

    Returns:
        The entropy in nats (computed in float64).
    """
    lp = torch.log_softmax(logits.double(), dim=-1)  # (V,)
    return float(-(lp.exp() * lp).sum())


def top2_margin(logits: torch.Tensor) -> float:
    """Log-probability gap (nats) between the two most likely tokens of a (V,) logit vector (the
    near-tie guard's signal: a small gap is where a small logit error flips the first token).

    Args:
        logits: one position's logits, (V,) (at least two entries).

    Returns:
        The gap in nats, >= 0 (computed in float64).
    """
    top = torch.topk(logits.double(), 2).values  # (2,)
    return float(top[0] - top[1])  # log-softmax differences equal logit differences
