"""results.md, and results.json's schema (below; its fields and validator are
:mod:`blend.evals.results_schema`).

results.json, schema_version 1::

    {
      "schema_version": 1,
      "config":  {data, limit, passages, methods: [str], model, dtype, store, max_new_tokens,
                  repeats, warmup, seed, system, bootstrap},
      "model":   {"name": str, "dtype": str, "provenance": {...}},   # blend.keys.Provenance fields
      "versions": {"python": str, "kvblend": str|null, "torch": ..., ...},
      "machine": {"platform": str, "cpu_count": int, "accelerator": str|null, ...},
      "reference": "full",
      "methods": {
        "<name>": {                          # one per method, "full" first; name as given
          "f1", "em", "rouge_l":  mean over items, best over gold answers (SQuAD normalisation)
          "contains":             fraction of items whose answer contains a gold answer (normalised)
          "agreement":            fraction of items whose normalised answer equals full's
          "kl":                   mean KL(full || method) of the first answer token, nats
          "top1":                 fraction of items whose first-token argmax equals full's
          "tf_agreement":         mean fraction of full's answer tokens the method predicts
                                  when teacher-forced along full's answer
          "tf_kl":                mean KL(full || method) along full's answer (teacher-forced)
          "ttft_median_s", "ttft_p90_s":  over items (each item: median of its repeats)
          "ttft_ratio":           median over items of method TTFT / full TTFT (same item)
          "ttft_ratio_mean":      mean of the same ratios
          "f1_ci", "ttft_ratio_ci":  [low, high] 95% bootstrap over items (mean F1, median ratio)
          "recomputed_frac":      mean recomputed tokens / prompt tokens (reused rows recomputed)
          "computed_frac":        mean fraction of prompt rows with fresh KV above the check layer
                                  ((prompt - reused + recomputed) / prompt; 1.0 for full prefill)
          "recomputed_tokens", "prompt_tokens":  means
          "n":                    items scored
          "threads":              [int] distinct intra-op thread counts its TTFTs were timed with
                                  (a resumed run may differ from the first; empty if unrecorded)
          "spec":                 {kind, ratio, selector, check_layers}
        }                                    # every number may be null when undefined (n = 0)
      },
      "items": [                             # one per item, by index: the rows of rows.jsonl,
        {"index": int, "id": str, "question": str, "item_sha256": str, "answers": [str],
         "prompt_tokens": int, "full_answer": str, "ref_margin": float,
         "methods": {"<name>": {prediction, answer_tokens, f1, ..., computed_frac}}}
                                # every field, and those absent in rows written before they existed:
                                # blend.evals.rows (ItemRow, MethodRow); ttft_ref_s: full's TTFT timed
                                # beside this method (the ratio's denominator; after --resume, not
                                # necessarily the full row's ttft_s)
      ]
    }

Everything except the ``ttft*`` fields, ``machine`` and ``versions`` is a
function of the inputs (same inputs, same file).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from blend import safeio
from blend.defaults import DEFAULT_BOOTSTRAP_RESAMPLES, DEFAULT_BOOTSTRAP_SEED
from blend.evals import answer_survival as S
from blend.evals import guard_curve as G
from blend.evals.methods import REFERENCE, MethodKind
from blend.evals.report_warnings import applied_lines, thread_lines
from blend.evals.rows import ItemRow
from blend.evals.splits import SPLIT_DATA, TUNING, VALIDATION, items_caption, range_split

WORST_ITEMS = 5  # results.md lists this many worst items with their KL under each method
NEAR_TIE_NATS = 0.1  # a first-token flip where full's own top-2 gap is under this is called a near tie


def _items_line(results: dict[str, Any], rows: list[ItemRow]) -> str:
    """results.md's item range and split, e.g. ``items 0-29 (30 items), tuning split``."""
    idx = sorted(r.index for r in rows)
    text = items_caption(results["config"].get("data"), idx)
    if not idx:
        return text
    split = range_split(idx[0], idx[-1], results["config"].get("data"))
    if split == "tuning":
        text += f" (the selectors were tuned on {SPLIT_DATA} {TUNING[0]}-{TUNING[1]}; validation is " \
                f"--items {VALIDATION[0]}-{VALIDATION[1]})"
    elif split == "mixed":
        text += f" (spans more than one of {SPLIT_DATA}'s splits: tuning {TUNING[0]}-{TUNING[1]}, " \
                f"validation {VALIDATION[0]}-{VALIDATION[1]}; report them apart)"
    return text


# Markdown table: (header, field, format, better: "high" | "low" | None, vs-reference metric).
COLUMNS: tuple[tuple[str, str, str, str | None, bool], ...] = (
    ("F1", "f1", "{:.3f}", "high", False),
    ("EM", "em", "{:.3f}", "high", False),
    ("Rouge-L", "rouge_l", "{:.3f}", "high", False),
    ("has gold", "contains", "{:.3f}", "high", False),
    ("agree", "agreement", "{:.3f}", "high", True),
    ("KL", "kl", "{:.4g}", "low", True),
    ("top-1", "top1", "{:.3f}", "high", True),
    ("TF agree", "tf_agreement", "{:.3f}", "high", True),
    ("TTFT med (s)", "ttft_median_s", "{:.4f}", None, False),
    ("TTFT ratio", "ttft_ratio", "{:.3f}", "low", False),
    ("recomp", "recomputed_frac", "{:.3f}", None, False),
    ("fresh KV", "computed_frac", "{:.3f}", None, False),
)


def sort_key(name: str, agg: dict[str, Any]) -> tuple[Any, ...]:
    """Table order: full first, then by KL to full (lower first), then TTFT ratio, then name."""
    inf = float("inf")
    kl = agg.get("kl")
    ratio = agg.get("ttft_ratio")
    return (name != REFERENCE, inf if kl is None else kl, inf if ratio is None else ratio, name)


def best_per_column(methods: dict[str, dict[str, Any]]) -> dict[str, set[str]]:
    """Methods holding the best value of each column (ties included).

    Metrics measured against full prefill exclude ``full`` itself (it is
    perfect by definition); so does the TTFT ratio (1.0 by definition).
    """
    best: dict[str, set[str]] = {}
    for _, field, _, better, vs_ref in COLUMNS:
        if better is None:
            continue
        cand = {
            n: a[field] for n, a in methods.items()
            if a.get(field) is not None and not ((vs_ref or field == "ttft_ratio") and n == REFERENCE)
        }
        if not cand:
            best[field] = set()
            continue
        target = max(cand.values()) if better == "high" else min(cand.values())
        best[field] = {n for n, v in cand.items() if math.isclose(v, target, rel_tol=1e-9, abs_tol=1e-12)}
    return best


@dataclass(frozen=True)
class BudgetBest:
    """The best blend selector at one recompute budget (same check layers), by three measures."""

    ratio: float
    check_layers: tuple[int, ...]
    candidates: int  # selectors compared at this budget
    by_kl: str  # method with the lowest first-token KL to full
    kl: float
    by_tf: str  # method with the highest teacher-forced agreement along full's answer
    tf_agreement: float
    by_f1: str  # method with the highest F1 against gold
    f1: float


def _pick(group: dict[str, dict[str, Any]], field: str, high: bool) -> tuple[str, float] | None:
    vals = {n: a[field] for n, a in group.items() if a.get(field) is not None}
    if not vals:
        return None
    name = sorted(vals, key=lambda n: ((-vals[n]) if high else vals[n], n))[0]
    return name, vals[name]


def best_by_budget(methods: dict[str, dict[str, Any]]) -> list[BudgetBest]:
    """For every blend budget with two or more selectors, the best one by KL, TF agreement and F1.

    Args:
        methods: the ``methods`` object of results.json (each with its ``spec``).

    Returns:
        One row per (ratio, check layers), ratios ascending; ties go to the first name.
    """
    groups: dict[tuple[float, tuple[int, ...], str], dict[str, dict[str, Any]]] = {}
    for name, agg in methods.items():
        spec = agg.get("spec") or {}
        if spec.get("kind") != MethodKind.BLEND.value or spec.get("ratio") is None or spec.get("auto"):
            continue
        # rivals differ in the selector alone: a guard, a temperature or other candidates spend or compute
        # differently, so such variants of one selector are never compared here as if they were selectors
        rest = json.dumps({k: v for k, v in spec.items() if k not in ("selector", "ratio", "check_layers")},
                          sort_keys=True)
        groups.setdefault((float(spec["ratio"]), tuple(spec.get("check_layers") or ()), rest), {})[name] = agg
    rows = []
    for (ratio, checks, _), group in sorted(groups.items()):
        picks = [_pick(group, "kl", False), _pick(group, "tf_agreement", True), _pick(group, "f1", True)]
        if len(group) < 2 or any(p is None for p in picks):
            continue
        (kl_n, kl), (tf_n, tf), (f1_n, f1) = picks  # type: ignore[misc]
        rows.append(BudgetBest(ratio, checks, len(group), kl_n, kl, tf_n, tf, f1_n, f1))
    return rows


def _budget_lines(methods: dict[str, dict[str, Any]]) -> list[str]:
    rows = best_by_budget(methods)
    if not rows:
        return []
    lines = [
        "",
        "## Best selector per budget",
        "",
        "| budget | check | selectors | lowest KL | KL | highest TF agree | TF agree | highest F1 | F1 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        checks = ",".join(map(str, r.check_layers)) or "default"
        lines.append(f"| {r.ratio:g} | {checks} | {r.candidates} | `{r.by_kl}` | {r.kl:.4g} | `{r.by_tf}` | "
                     f"{r.tf_agreement:.3f} | `{r.by_f1}` | {r.f1:.3f} |")
    return lines


def _cell(agg: dict[str, Any], field: str, fmt: str) -> str:
    v = agg.get(field)
    if v is None:
        return "–"
    s = fmt.format(v)
    ci = agg.get(f"{field}_ci")
    if ci:
        s += f" [{fmt.format(ci[0])}, {fmt.format(ci[1])}]"
    return s


def _repeats_line(results: dict[str, Any], rows: list[ItemRow]) -> str:
    """TTFT samples per item and method: the config's repeats, or the range the rows hold where a resumed
    run measured its items with another ``--repeats``."""
    counts = {len(r.ttft_samples) for it in rows for r in it.methods.values()}
    if len(counts) > 1:
        return f"{min(counts)}-{max(counts)} (a resumed run changed --repeats)"
    return str(counts.pop() if counts else results["config"]["repeats"])


def markdown(results: dict[str, Any]) -> str:
    """results.md: a header (naming the item range and its split) and the method table, sorted, best
    values in bold.

    Args:
        results: a validated results object.

    Returns:
        Markdown text.
    """
    cfg, model = results["config"], results["model"]
    methods = results["methods"]
    rows = [ItemRow.from_json(r) for r in results["items"]]
    order = sorted(methods, key=lambda n: sort_key(n, methods[n]))
    best = best_per_column(methods)
    lines = [
        f"# kvblend eval: {cfg['data']}",
        "",
        f"model `{model['name']}` ({model['dtype']}), {_items_line(results, rows)}, {cfg['passages']} passages, "
        f"max {cfg['max_new_tokens']} new tokens, TTFT median of {_repeats_line(results, rows)} per item.",
        f"Machine: {results['machine'].get('platform')}, accelerator {results['machine'].get('accelerator')}.",
        "",
        "Sorted by KL(full ‖ method) of the first answer token. **Bold**: best in column "
        "(columns measured against full prefill, and the TTFT ratio, exclude `full`). "
        "Brackets: 95% bootstrap CI over items. TTFT ratio: the median over items of each item's ratio "
        "(the method's median TTFT over full prefill's, timed beside it), not a ratio of mean TTFTs; "
        "results.json's `ttft_ratio_mean` is the mean of the same ratios.",
        "",
        "| method | " + " | ".join(c[0] for c in COLUMNS) + " | n |",
        "|---|" + "---|" * len(COLUMNS) + "---|",
    ]
    for name in order:
        agg = methods[name]
        cells = []
        for _, field, fmt, _, _ in COLUMNS:
            c = _cell(agg, field, fmt)
            cells.append(f"**{c}**" if name in best.get(field, set()) else c)
        lines.append(f"| `{name}` | " + " | ".join(cells) + f" | {agg['n']} |")
    lines += thread_lines(methods, order)
    lines += applied_lines(rows, order, methods)
    lines += _budget_lines(methods)
    lines += _tail_lines(methods, order)
    lines += _worst_lines(methods, rows, order)
    lines += _flip_lines(rows, order)
    lines += S.markdown_lines(rows, order, cfg.get("max_new_tokens"), cfg.get("bootstrap", DEFAULT_BOOTSTRAP_RESAMPLES),
                              cfg.get("seed", DEFAULT_BOOTSTRAP_SEED))  # the run's own, as aggregate's CIs
    lines += _guard_lines(list(methods), rows)
    return "\n".join(lines) + "\n"


def _guard_lines(names: list[str], rows: list[ItemRow]) -> list[str]:
    """For each guarded blend run beside the same blend with ``guard=off``: the guard's outcome at every
    margin up to its own (:mod:`blend.evals.guard_curve`; rows from before the eval recorded first-token
    gaps give none)."""
    lines: list[str] = []
    for guarded, off in G.guard_pairs(names):
        both = [r for r in rows if guarded in r.methods and off in r.methods]
        try:
            points = G.curve(both, guarded, off, G.default_margins(G.guard_margin_of(guarded)))
        except G.CurveError as e:
            lines += ["", f"(No guard margin table for `{guarded}` against `{off}`: {e}.)"]
            continue
        lines += ["", f"## The near-tie guard by margin: `{guarded}` against `{off}`", "",
                  "At margin m an item is the guarded row where its first pass's top-2 gap is under m, else the "
                  "unguarded row (`python -m blend.evals.guard_curve` draws it).", "", *G.table_lines(points)]
    return lines


def _fmt_ci(agg: dict[str, Any], field: str, ci_field: str, fmt: str) -> str:
    v = agg.get(field)
    if v is None:
        return "–"
    ci = agg.get(ci_field)
    return fmt.format(v) + (f" [{fmt.format(ci[0])}, {fmt.format(ci[1])}]" if ci else "")


def _tail_lines(methods: dict[str, dict[str, Any]], order: list[str]) -> list[str]:
    """The KL distribution per method: mean, median (95% bootstrap CIs), p90, max; top-1, TF agreement."""
    shown = [n for n in order if n != REFERENCE and "kl_median" in methods[n]]
    if not shown:
        return []
    lines = ["", "## Tail of KL(full ‖ method), first answer token", "",
             "| method | mean KL | median KL | p90 KL | max KL | top-1 | TF agree | n |",
             "|---|---|---|---|---|---|---|---|"]
    for name in shown:
        a = methods[name]
        num = lambda f, fmt="{:.4f}": "–" if a.get(f) is None else fmt.format(a[f])  # noqa: E731
        lines.append(f"| `{name}` | {_fmt_ci(a, 'kl', 'kl_ci', '{:.4f}')} | {_fmt_ci(a, 'kl_median', 'kl_median_ci', '{:.4f}')} "
                     f"| {num('kl_p90')} | {num('kl_max')} | {_fmt_ci(a, 'top1', 'top1_ci', '{:.3f}')} "
                     f"| {_fmt_ci(a, 'tf_agreement', 'tf_agreement_ci', '{:.3f}')} | {a['n']}"
                     + (f" ({a['kl_nonfinite']} with an infinite or NaN KL)" if a.get("kl_nonfinite") else "")
                     + " |")
    return lines


def _judged(methods: dict[str, dict[str, Any]]) -> tuple[list[str], str]:
    """The methods whose mean KL ranks the worst items, and what results.md calls them: the blend methods, or
    every method but full where the run has no blend."""
    blend = [n for n, a in methods.items() if (a.get("spec") or {}).get("kind") == MethodKind.BLEND.value]
    if blend:
        return blend, "the blend methods"
    return [n for n in methods if n != REFERENCE], "every method but full (the run has no blend)"


def worst_items(methods: dict[str, dict[str, Any]], rows: Sequence[ItemRow], k: int = WORST_ITEMS) -> list[ItemRow]:
    """The ``k`` items with the highest mean KL over the blend methods (over every non-reference method
    when there is no blend method), worst first.

    Args:
        methods: the ``methods`` object of results.json (each with its ``spec``).
        rows: the run's item rows.
        k: how many.

    Returns:
        Their item rows.
    """
    judged, _ = _judged(methods)

    def badness(row: ItemRow) -> float:
        got = [row.methods[n].kl for n in judged if n in row.methods]
        if any(g is None or not math.isfinite(g) for g in got):
            return math.inf  # an infinite or NaN KL (null in the rows) is the worst there is
        return sum(got) / len(got) if got else -1.0

    return sorted(rows, key=lambda r: (-badness(r), r.index))[:k]


def _worst_lines(methods: dict[str, dict[str, Any]], rows: list[ItemRow], order: list[str]) -> list[str]:
    worst = worst_items(methods, rows)
    shown = [n for n in order if n != REFERENCE]
    if not worst or not shown:
        return []
    lines = ["", f"## The {len(worst)} worst items (highest mean KL over {_judged(methods)[1]}): KL under each method",
             "", "Ties: the lower item index first. An infinite or NaN KL (–) ranks its item worst.", "",
             "| item | id | " + " | ".join(f"`{n}`" for n in shown) + " |",
             "|---|---|" + "---|" * len(shown)]
    for r in worst:
        cells = []
        for n in shown:
            v = r.methods[n].kl if n in r.methods else None
            cells.append("–" if v is None else f"{v:.4f}")
        lines.append(f"| {r.index} | {r.id} | " + " | ".join(cells) + " |")
    return lines


def _flip_lines(rows: list[ItemRow], order: list[str]) -> list[str]:
    """Each method's first-token flips, with full prefill's own top-2 gap on those items: a flip where
    that gap is tiny (a near tie) says less about the method than one where full was sure."""
    lines = []
    for name in (n for n in order if n != REFERENCE):
        flips = [r for r in rows if name in r.methods and r.methods[name].top1 == 0.0]
        if not flips:
            continue
        gaps = [r.ref_margin for r in flips]
        ties = sum(1 for g in gaps if g is not None and g < NEAR_TIE_NATS)
        items = ", ".join(f"{r.index} ({'?' if g is None else f'{g:.2f}'})" for r, g in zip(flips, gaps))
        lines.append(f"| `{name}` | {len(flips)} | {ties} | {items} |")
    if not lines:
        return []
    return ["", "## First-token flips: item (full prefill's own top-2 gap, nats)", "",
            f"A near tie: full's gap under {NEAR_TIE_NATS} nats.", "",
            "| method | flips | near ties | items |", "|---|---|---|---|", *lines]


def write_markdown(results: dict[str, Any], path: Path) -> None:
    """Write results.md."""
    safeio.atomic_write_text(path, markdown(results))  # never through a link planted in --out
