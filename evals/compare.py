"""Compare evaluation runs: one quality-vs-TTFT plot and one table over several results.json.

Typical use: the same model and questions at 5 and at 10 passages, to see how
each selector holds up as prompts grow::

    python -m blend.evals.compare docs/results/musique5 docs/results/musique10 \\
        --selectors combo,v,query --out docs/results/compare_passages.png

One panel per quality field (first-token KL and teacher-forced agreement by
default) against the TTFT ratio; colour is the selector, line style the run.
The table printed (markdown) names the lowest-KL selector at each budget in
each run, with its KL and TTFT ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from blend.evals.plot import draw_methods, series
from blend.evals.report import best_by_budget
from blend.evals.results_schema import SchemaError, validate_results
from blend.evals.rows import MAX_ROWS_BYTES
from blend.evals.splits import items_caption
from blend import safeio

LINESTYLES = ("-", "--", ":", "-.")
FIELDS = {"kl": "mean KL(full || method), first token (nats)", "tf_agreement": "teacher-forced agreement with full",
          "f1": "mean F1 vs gold", "agreement": "share of answers equal to full's", "top1": "top-1 agreement with full"}


@dataclass(frozen=True)
class Run:
    """One evaluation run to compare.

    Attributes:
        label: legend name (from --labels, else "<passages> passages").
        results: its validated results object.
    """

    label: str
    results: dict[str, Any]


def load_run(path: Path, label: str | None = None) -> Run:
    """Read ``results.json`` from a run folder (or the file itself) and validate it.

    Args:
        path: an ``--out`` folder of ``kvblend eval`` or a results.json.
        label: legend name; default ``"<passages> passages"``.

    Raises:
        SchemaError: the file is not a valid results object, or not a regular file of JSON under
            MAX_ROWS_BYTES (message names the file).
        FileNotFoundError: no results.json there.
    """
    f = path / "results.json" if path.is_dir() else path
    try:  # a regular file under the rows' cap (a FIFO is refused, not waited on)
        results = json.loads(safeio.read_regular(f, MAX_ROWS_BYTES, follow_symlinks=True).decode("utf-8"))
    except FileNotFoundError:
        raise
    except (OSError, ValueError, RecursionError) as e:  # not regular, too large; not UTF-8 or JSON; nested
        raise SchemaError(f"{f}: cannot read it as results ({type(e).__name__}: {str(e)[:200]})") from None
    try:
        validate_results(results)
    except SchemaError as e:
        raise SchemaError(f"{f}: {e}") from e
    return Run(label or f"{results['config'].get('passages')} passages", results)


def mismatches(runs: Sequence[Run]) -> list[str]:
    """What makes the runs' aggregates incomparable: other models, or other items (index and id)."""
    out = []
    models = {r.results["model"]["name"] for r in runs}
    if len(models) > 1:
        out.append(f"models differ: {sorted(models)}")
    items = [{(i["index"], i["id"]) for i in r.results["items"]} for r in runs]
    if any(s != items[0] for s in items[1:]):
        out.append("item sets differ: " + "; ".join(f"{r.label}: {len(s)} items" for r, s in zip(runs, items)))
    return out


def comparison_table(runs: Sequence[Run]) -> str:
    """Markdown: per run and budget, the lowest-KL selector, its KL and TTFT ratio.

    Returns:
        The table (header included); budgets with fewer than two selectors are left out.
    """
    lines = ["| run | budget | selectors | lowest KL | KL | TTFT ratio |", "|---|---|---|---|---|---|"]
    for run in runs:
        methods = run.results["methods"]
        for b in best_by_budget(methods):
            ratio = methods[b.by_kl].get("ttft_ratio")
            shown = "–" if ratio is None else f"{ratio:.3f}"
            lines.append(f"| {run.label} | {b.ratio:g} | {b.candidates} | `{b.by_kl}` | {b.kl:.4g} | {shown} |")
    return "\n".join(lines) + "\n"


def write_comparison(runs: Sequence[Run], path: Path, fields: Sequence[str] = ("kl", "tf_agreement"),
                     selectors: Sequence[str] | None = None, xmax: float | None = None) -> None:
    """Draw the comparison PNG (matplotlib, Agg backend).

    Args:
        runs: the runs, in legend order (at most four: one line style each).
        path: where to write the PNG.
        fields: quality fields, one panel each (keys of :data:`FIELDS`).
        selectors: selectors to draw (default: all); reference methods are always drawn.
        xmax: zoom the TTFT-ratio axis to [0, xmax] (full and prefix, near 1.0, fall outside).

    Raises:
        ValueError: an unknown field, or more runs than line styles.
    """
    bad = [f for f in fields if f not in FIELDS]
    if bad:
        raise ValueError(f"unknown field(s) {bad}; choose from {sorted(FIELDS)}")
    if len(runs) > len(LINESTYLES):
        raise ValueError(f"at most {len(LINESTYLES)} runs per plot")
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    labels = sorted({lab for r in runs for lab in series(r.results["methods"])})
    if selectors:
        labels = [lab for lab in labels if lab.split(" ")[0] in selectors]
    colors = {lab: plt.get_cmap("tab10")(i % 10) for i, lab in enumerate(labels)}
    fig, axes = plt.subplots(1, len(fields), figsize=(6 * len(fields), 4.6), squeeze=False)
    for ax, field in zip(axes[0], fields):
        for run, style in zip(runs, LINESTYLES):
            draw_methods(ax, run.results["methods"], field, labels=colors, style=style, colors=colors,
                         suffix=f", {run.label}", ref_alpha=1.0 if style == "-" else 0.5, ref_size=60)
        if xmax is not None:
            ax.set_xlim(0.0, xmax)
        ax.set_xlabel("TTFT / full prefill TTFT (same item, same process; median over items)")
        ax.set_title(FIELDS[field])
        ax.grid(alpha=0.3)
    handles, names = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, names, loc="lower center", ncol=min(len(names), 4), fontsize=8)
    model = runs[0].results["model"]["name"] if runs else ""
    fig.suptitle(f"{model}: " + " vs ".join(f"{r.label} ({_items(r)})" for r in runs), fontsize=10)
    rows = -(-len(handles) // 4) if handles else 0
    fig.tight_layout(rect=(0, min(0.4, 0.045 * rows + 0.02), 1, 0.95))
    safeio.save_figure(fig, path, dpi=110)
    plt.close(fig)


def _items(run: Run) -> str:
    """A run's item range and split (``items 30-99 (70 items), validation split``)."""
    return items_caption(run.results.get("config", {}).get("data"), [int(i["index"]) for i in run.results["items"]])


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m blend.evals.compare RUN... --out PNG``: plot, then print the table."""
    p = argparse.ArgumentParser(prog="python -m blend.evals.compare", description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, help="kvblend eval --out folders (or results.json files)")
    p.add_argument("--out", type=Path, required=True, help="PNG to write")
    p.add_argument("--labels", default=None, help="comma-separated legend names, one per run")
    p.add_argument("--fields", default="kl,tf_agreement", help=f"panels, from {','.join(FIELDS)}")
    p.add_argument("--selectors", default=None, help="comma-separated selectors to draw (default: all)")
    p.add_argument("--xmax", type=float, default=None, help="zoom the TTFT-ratio axis to [0, XMAX]")
    args = p.parse_args(argv)
    labels = args.labels.split(",") if args.labels else [None] * len(args.runs)
    if len(labels) != len(args.runs):
        print(f"compare: error: {len(labels)} labels for {len(args.runs)} runs", file=sys.stderr)
        return 2
    try:
        runs = [load_run(path, lab) for path, lab in zip(args.runs, labels)]
        for problem in mismatches(runs):  # aggregates over other items are not a like-for-like comparison
            print(f"compare: warning: {problem}", file=sys.stderr)
        write_comparison(runs, args.out, args.fields.split(","),
                         args.selectors.split(",") if args.selectors else None, args.xmax)
    except (OSError, ValueError, SchemaError) as e:
        print(f"compare: error: {e}", file=sys.stderr)
        return 2
    print(comparison_table(runs), end="")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
