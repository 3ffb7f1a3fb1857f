"""Quality metrics of the evaluation harness.

Two families:

* against ground truth: SQuAD-normalised token F1 and exact match, Rouge-L
  (LCS F-measure over normalised tokens), each the best over the gold answers;
* against full prefill (the reference every method is compared to): answer
  agreement on normalised strings, KL(full || method) of the first answer
  token's distribution (fp64, from logits), its top-1 agreement, and
  teacher-forced agreement along full prefill's answer.

Plus the small statistics the report needs (median, percentile, bootstrap CI).
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from typing import Callable, Sequence

import numpy as np
import torch

from blend.defaults import DEFAULT_BOOTSTRAP_RESAMPLES, DEFAULT_BOOTSTRAP_SEED
from blend.divergence import kl_divergence, top1_agree  # noqa: F401 - the evals' metrics, defined once

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCT = frozenset(string.punctuation)


def normalize_answer(s: str) -> str:
    """SQuAD normalisation: lower case, drop punctuation and articles, squeeze spaces.

    Args:
        s: an answer string.

    Returns:
        The normalised string (tokens joined by single spaces).
    """
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def _tokens(s: str) -> list[str]:
    return normalize_answer(s).split()


def token_f1(prediction: str, gold: str) -> float:
    """SQuAD token F1 between one prediction and one gold answer.

    When either side normalises to no tokens, F1 is 1.0 if both do, else 0.0.

    Args:
        prediction: the model's answer.
        gold: a reference answer.

    Returns:
        F1 in [0, 1].
    """
    pred, ref = _tokens(prediction), _tokens(gold)
    if not pred or not ref:
        return float(pred == ref)
    same = sum((Counter(pred) & Counter(ref)).values())
    if same == 0:
        return 0.0
    p, r = same / len(pred), same / len(ref)
    return 2 * p * r / (p + r)


def exact_match(prediction: str, gold: str) -> float:
    """1.0 when the normalised strings are equal, else 0.0."""
    return float(normalize_answer(prediction) == normalize_answer(gold))


def contains_answer(prediction: str, gold: str) -> float:
    """1.0 when the normalised gold tokens occur as a contiguous run in the prediction.

    A small model often answers in a sentence ("Mara Quill lives in Varnholm."),
    which token F1 penalises; this measures whether the answer is in it.
    """
    pred, ref = _tokens(prediction), _tokens(gold)
    if not ref:
        return float(not pred)
    n = len(ref)
    return float(any(pred[i:i + n] == ref for i in range(len(pred) - n + 1)))


def _lcs_len(a: Sequence[str], b: Sequence[str]) -> int:
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l(prediction: str, gold: str) -> float:
    """Rouge-L F-measure (beta = 1) over normalised tokens.

    Args:
        prediction: the model's answer.
        gold: a reference answer.

    Returns:
        2PR/(P+R) with P = LCS/len(pred), R = LCS/len(gold); 0.0 when either is empty.
    """
    pred, ref = _tokens(prediction), _tokens(gold)
    if not pred or not ref:
        return 0.0
    lcs = _lcs_len(pred, ref)
    if lcs == 0:
        return 0.0
    p, r = lcs / len(pred), lcs / len(ref)
    return 2 * p * r / (p + r)


def best_over(metric: Callable[[str, str], float], prediction: str, answers: Sequence[str]) -> float:
    """The best score of ``prediction`` over every gold answer.

    Args:
        metric: e.g. :func:`token_f1`.
        prediction: the model's answer.
        answers: non-empty list of gold answers.

    Returns:
        max over answers.
    """
    if not answers:
        raise ValueError("best_over needs at least one gold answer")
    return max(metric(prediction, a) for a in answers)


def answers_agree(a: str, b: str) -> float:
    """1.0 when two answers are equal after SQuAD normalisation."""
    return exact_match(a, b)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two answers share.

    Args:
        a: one answer's token ids.
        b: the other's.

    Returns:
        The length of their longest common prefix (``len(a)`` when ``a == b``).
    """
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def teacher_forced_agreement(method_logits: torch.Tensor, continuation: Sequence[int]) -> float:
    """Fraction of steps where the method's greedy token equals full prefill's.

    Row i of ``method_logits`` is the method's next-token distribution after
    the prompt and ``continuation[:i]``; it agrees when its argmax equals
    ``continuation[i]`` (full prefill's greedy answer). The last row (after the
    whole continuation) has no reference token and is ignored.

    Args:
        method_logits: (len(continuation)+1, V) or more rows.
        continuation: full prefill's answer token ids; must be non-empty.

    Returns:
        Agreement in [0, 1].
    """
    n = len(continuation)
    if n == 0:
        raise ValueError("teacher-forced agreement needs a non-empty continuation")
    if method_logits.dim() != 2 or method_logits.shape[0] < n:
        raise ValueError(f"need at least {n} rows of logits, got shape {tuple(method_logits.shape)}")
    pred = torch.argmax(method_logits[:n], dim=-1)  # (n,)
    ref = torch.as_tensor(list(continuation), dtype=pred.dtype)
    return float((pred == ref).to(torch.float64).mean())


def mean_kl_rows(p_logits: torch.Tensor, q_logits: torch.Tensor, rows: int) -> float:
    """Mean KL(P || Q) over the first ``rows`` rows of two (T, V) logit matrices."""
    rows = min(rows, p_logits.shape[0], q_logits.shape[0])
    if rows <= 0:
        raise ValueError("mean_kl_rows needs at least one row")
    return sum(kl_divergence(p_logits[i], q_logits[i]) for i in range(rows)) / rows


def finite(values: Sequence[float | None]) -> list[float]:
    """The values that are not None and finite."""
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]


def mean(values: Sequence[float | None]) -> float | None:
    """Mean of the finite values, None when there are none."""
    vals = finite(values)
    return sum(vals) / len(vals) if vals else None


def percentile(values: Sequence[float | None], q: float) -> float | None:
    """Linear-interpolated percentile ``q`` in [0, 100] of the finite values, None when empty."""
    vals = finite(values)
    return float(np.percentile(np.asarray(vals, dtype=np.float64), q)) if vals else None


def median(values: Sequence[float | None]) -> float | None:
    """Median of the finite values, None when empty."""
    return percentile(values, 50.0)


# the statistics :func:`kl_cells` can give, by the name a table's header calls them
KL_STATS: dict[str, Callable[[Sequence[float]], float | None]] = {
    "mean": mean, "median": median, "p90": lambda v: percentile(v, 90.0), "max": lambda v: max(v),
}


def kl_cells(values: Sequence[float], stats: Sequence[str] = ("mean", "median", "p90", "max")) -> str:
    """Markdown cells (``mean | median | p90 | max`` by default) of per-item KLs (the tail beside the mean);
    an inf or NaN KL makes every cell "–" with the count (dropping it would flatter the method, as in
    aggregate.py). Every table of KLs (sweep, benches) goes through here, so they agree.

    Args:
        values: one KL per item (or request).
        stats: which cells, in order: names of :data:`KL_STATS`.

    Returns:
        The cells joined by `` | `` (no outer bars).
    """
    bad = len(values) - len(finite(values))
    if bad:
        return " | ".join("–" for _ in stats) + f" ({bad} not finite)"
    return " | ".join(f"{KL_STATS[s](values):.4f}" for s in stats)


def bootstrap_ci(
    values: Sequence[float | None],
    stat: Callable[[np.ndarray], float] = np.mean,
    n: int = DEFAULT_BOOTSTRAP_RESAMPLES,
    seed: int = DEFAULT_BOOTSTRAP_SEED,
    level: float = 0.95,
) -> tuple[float, float] | None:
    """Percentile bootstrap confidence interval of ``stat`` over items.

    Args:
        values: one value per item (None / non-finite values are dropped).
        stat: statistic of a 1-D array (mean, median, ...).
        n: number of resamples.
        seed: seed of the resampling generator (same inputs, same interval).
        level: coverage, e.g. 0.95.

    Returns:
        (low, high), or None when there are no values.
    """
    vals = np.asarray(finite(values), dtype=np.float64)
    if vals.size == 0:
        return None
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, vals.size, size=(n, vals.size))
    stats = np.array([stat(vals[row]) for row in idx], dtype=np.float64)
    alpha = (1.0 - level) / 2.0
    lo, hi = np.quantile(stats, [alpha, 1.0 - alpha])
    return float(lo), float(hi)
