"""How long each method's answer stays full prefill's, from ``kvblend eval`` rows.

First-token KL and top-1 score one token. Teacher-forced agreement scores every token of full's answer,
each given full's own tokens before it. A user reads the free-running answer, which is full prefill's
only up to its first different token; after that token the two answers go their own ways. This module
gives, for every k, the share of items whose first k answer tokens are full's own (a survival curve),
from each row's ``same_tokens`` (the leading tokens it shares with full's answer; written by
:mod:`blend.evals.harness` since 2026-12-06 (17)).

An answer the same as full's to its end counts at every k, also past its length (both stopped at the
same place). An answer that shares all of full's tokens and goes on (or stops early) differs at the
token after the shorter one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from blend import safeio
from blend.defaults import DEFAULT_BOOTSTRAP_RESAMPLES, DEFAULT_BOOTSTRAP_SEED
from blend.evals.metrics import bootstrap_ci, median
from blend.evals.methods import REFERENCE
from blend.evals.plot import run_title
from blend.evals.rows import ItemRow

# the answer lengths (tokens) results.md shows a share for; the plot draws every k up to the longest answer
SURVIVAL_TOKENS = (1, 2, 4, 8, 16, 32)


@dataclass(frozen=True)
class Survival:
    """One method's answers against full prefill's over a run's items."""

    method: str
    n: int  # items scored (those whose rows record same_tokens)
    shares: tuple[float, ...]  # per k of ``ks``: the share of items whose first k tokens are full's
    ks: tuple[int, ...]
    whole: float  # the share whose whole answer is full's
    median_same: float  # the median leading tokens in common
    whole_ci: tuple[float, float] | None = None  # 95% bootstrap CI of ``whole`` over items


def same_through(same: int, length: int, ref_length: int, k: int) -> bool:
    """Whether an answer's first ``k`` tokens are full prefill's.

    Args:
        same: leading tokens the answer shares with full's.
        length: the answer's tokens.
        ref_length: full's answer's tokens.
        k: how many leading tokens to compare.

    Returns:
        True when the answer is full's to its end, or its first ``k`` tokens are.
    """
    return (same == length == ref_length) or same >= k


def _outcomes(rows: Sequence[ItemRow], method: str) -> list[tuple[int, int, int]]:
    """Each scored item's (tokens in common with full's, the answer's tokens, full's answer's tokens); items
    whose ``method`` row lacks ``same_tokens`` (written before it existed) are left out."""
    got = []
    for r in rows:
        m, ref = r.methods.get(method), r.methods.get(REFERENCE)
        if m is None or ref is None or m.same_tokens is None:
            continue
        got.append((m.same_tokens, m.answer_tokens, ref.answer_tokens))
    return got


def _shares(got: Sequence[tuple[int, int, int]], ks: Sequence[int]) -> tuple[float, ...]:
    """Per k, the share of ``got`` (non-empty) whose first k tokens are full's."""
    return tuple(sum(same_through(s, a, b, k) for s, a, b in got) / len(got) for k in ks)


def survival(rows: Sequence[ItemRow], method: str, ks: Sequence[int] = SURVIVAL_TOKENS,
             n_boot: int = DEFAULT_BOOTSTRAP_RESAMPLES, seed: int = DEFAULT_BOOTSTRAP_SEED) -> Survival | None:
    """A method's survival over a run's item rows.

    Args:
        rows: a run's item rows (results.json's ``items``, or rows.jsonl's lines, read by
            :meth:`ItemRow.from_json`).
        method: a method name in them.
        ks: the answer lengths to give a share for.
        n_boot: bootstrap resamples of the whole-answer share's CI (a run's ``--bootstrap``).
        seed: their seed (a run's ``--seed``).

    Returns:
        The survival, or None where no row of ``method`` records ``same_tokens``.
    """
    got = _outcomes(rows, method)
    if not got:
        return None
    whole_each = [float(s == a == b) for s, a, b in got]  # (n,) 1.0 where the whole answer is full's
    return Survival(method, len(got), _shares(got, ks), tuple(ks), sum(whole_each) / len(got),
                    median([s for s, _, _ in got]), bootstrap_ci(whole_each, n=n_boot, seed=seed))


def curve_points(rows: Sequence[ItemRow], method: str, longest: int) -> list[float]:
    """The share for every k in 1..``longest`` (the plot's curve; no CI, so no bootstrap)."""
    got = _outcomes(rows, method)
    return list(_shares(got, range(1, longest + 1))) if got else []


def table_lines(survivals: Sequence[Survival]) -> list[str]:
    """Markdown table rows: a row per method, a column per k, then the whole answer."""
    if not survivals:
        return []
    ks = survivals[0].ks
    lines = ["| method | n | " + " | ".join(f"first {k}" for k in ks)
             + " | whole answer [95% CI] | median tokens in common |",
             "|---|---|" + "---|" * len(ks) + "---|---|"]
    for s in survivals:
        ci = f" [{s.whole_ci[0]:.3f}, {s.whole_ci[1]:.3f}]" if s.whole_ci else ""
        lines.append(f"| `{s.method}` | {s.n} | " + " | ".join(f"{x:.3f}" for x in s.shares)
                     + f" | {s.whole:.3f}{ci} | {s.median_same:g} |")
    return lines


def markdown_lines(rows: Sequence[ItemRow], order: Sequence[str], max_new_tokens: int | None = None,
                   n_boot: int = DEFAULT_BOOTSTRAP_RESAMPLES, seed: int = DEFAULT_BOOTSTRAP_SEED) -> list[str]:
    """results.md's section: every method but full, in ``order``; none where no row records the field.

    Args:
        rows: the run's item rows.
        order: method names, in the table's order.
        max_new_tokens: the run's decoding budget (no share past it).
        n_boot: bootstrap resamples of the CIs (the run's ``--bootstrap``, as every other CI of the run).
        seed: their seed (the run's ``--seed``).

    Returns:
        Markdown lines (a blank line first), or none.
    """
    # a share past the decoding budget would count answers cut at the budget as full's for tokens never decoded
    ks = [k for k in SURVIVAL_TOKENS if max_new_tokens is None or k <= max_new_tokens] or [1]
    survivals = [s for s in (survival(rows, n, ks, n_boot, seed) for n in order if n != REFERENCE) if s is not None]
    if not survivals:
        return []
    return ["", "## How long the answer stays full prefill's: share of items whose first k answer tokens are full's",
            "", "Free-running greedy answers; one different token and the rest of the answer is the method's own "
            "(`answer_survival.png` draws every k).", "", *table_lines(survivals)]


def write_plot(results: dict[str, Any], path: Path) -> Path | None:
    """``answer_survival.png``: the share against k, a line per method. Nothing where no row has the field.

    Args:
        results: a validated results object.
        path: where to write.

    Returns:
        ``path``, or None when there was nothing to draw.
    """
    rows = [ItemRow.from_json(r) for r in results["items"]]
    longest = max((m.answer_tokens for r in rows for m in r.methods.values()), default=0)
    names = [n for n in results["methods"] if n != REFERENCE]
    curves = {n: curve_points(rows, n, max(longest, 1)) for n in names}
    curves = {n: c for n, c in curves.items() if c}
    if not curves:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, c in curves.items():
        ax.step(range(1, len(c) + 1), c, where="post", label=name)
    ax.set_xlabel("answer tokens k")
    ax.set_ylabel("share of answers whose first k tokens are full's")
    ax.set_ylim(0, 1.02)
    ax.set_title(run_title(results), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    safeio.save_figure(fig, path, dpi=120)
    plt.close(fig)
    return path
