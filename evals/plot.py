"""pareto.png: quality against TTFT ratio, one line per selector over ratios.

Three panels share the x axis (TTFT / full prefill TTFT, median over items):
F1 against gold, answer agreement with full prefill, and first-token
KL(full || method). Blend methods are grouped by selector (with check layers and
any other option: guard, auto, probe, cand, temp) and joined in ratio order;
``full``, ``reuse`` and ``prefix`` are reference markers.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any, Container

from blend import safeio
from blend.evals.methods import Method, MethodKind
from blend.evals.splits import items_caption

PANELS = (("f1", "mean F1 vs gold"), ("agreement", "share of answers equal to full's"),
          ("kl", "mean KL(full || method), first token (nats)"))
X_LABEL = "TTFT / full prefill TTFT (median over items)"
REFERENCE_STYLE = {"full": ("*", "black"), "reuse": ("X", "tab:red"), "prefix": ("s", "tab:gray")}


def series(methods: dict[str, dict[str, Any]]) -> dict[str, list[tuple[float, str]]]:
    """Blend methods grouped into plot lines.

    Args:
        methods: ``results["methods"]``.

    Returns:
        ``{label: [(ratio, method name), ...]}`` sorted by ratio; label is
        :meth:`Method.series`'s: the selector (``default`` when none was given) and its options.
    """
    out: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for name, agg in methods.items():
        spec = agg.get("spec") or {}
        if spec.get("kind") != MethodKind.BLEND.value:
            continue
        out[_series_label(spec)].append((float(spec.get("ratio") or 0.0), name))
    return {k: sorted(v) for k, v in sorted(out.items())}


def _series_label(spec: dict[str, Any]) -> str:
    """A blend spec's line label, :meth:`Method.series`'s: the selector, check layers and every other option
    (auto, probe, cand, temp, guard), so methods that differ in any of them are separate lines (specs written
    before an option existed lack it: the default)."""
    return Method.from_dict(spec).series()


def draw_methods(ax: Any, methods: dict[str, dict[str, Any]], field: str, labels: Container[str] | None = None, style: str = "-",
                 colors: dict[str, Any] | None = None, suffix: str = "", ref_alpha: float = 1.0,
                 ref_size: int = 70) -> None:
    """Draw one run's methods on one panel: a line per selector over ratios (each point
    annotated with its ratio) and the reference methods as markers, ``field`` against TTFT ratio.

    Args:
        ax: a matplotlib axes.
        methods: ``results["methods"]``.
        field: the quality field on the y axis.
        labels: selector lines to draw (default: all of :func:`series`).
        style: line style.
        colors: colour per line label (default: matplotlib's cycle).
        suffix: appended to every legend label (e.g. ", 10 passages").
        ref_alpha, ref_size: the reference markers' opacity and size.
    """
    for label, pts in series(methods).items():
        if labels is not None and label not in labels:
            continue
        xy = [
            (methods[n]["ttft_ratio"], methods[n][field], r)
            for r, n in pts
            if methods[n].get("ttft_ratio") is not None and methods[n].get(field) is not None
        ]
        if not xy:
            continue
        xs, ys, _ = zip(*xy)
        color = {} if colors is None else {"color": colors[label]}
        ax.plot(xs, ys, style, marker="o", label=label + suffix, **color)
        for x, y, r in xy:
            ax.annotate(f"{r:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    for name, (marker, color) in REFERENCE_STYLE.items():
        agg = methods.get(name)
        if agg and agg.get("ttft_ratio") is not None and agg.get(field) is not None:
            ax.scatter([agg["ttft_ratio"]], [agg[field]], marker=marker, color=color, s=ref_size,
                       zorder=4 if name == "full" else 3,  # prefix sits at ~1.0x too: full's star stays on top
                       alpha=ref_alpha, label=name + suffix)


def write_pareto(results: dict[str, Any], path: Path) -> None:
    """Draw pareto.png (matplotlib, Agg backend).

    Args:
        results: a results object.
        path: where to write the PNG.
    """
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    methods = results["methods"]
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5.2 * len(PANELS), 4.2), squeeze=False)
    for ax, (field, title) in zip(axes[0], PANELS):
        draw_methods(ax, methods, field)
        ax.set_xlabel(X_LABEL)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), fontsize=8)
    cfg = results.get("config", {})
    fig.suptitle(run_title(results), fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 0.95))
    safeio.save_figure(fig, path, dpi=110)
    plt.close(fig)


def run_title(results: dict[str, Any]) -> str:
    """A run's figure title: the model, the data, and which items of it in which split (tuning and validation
    numbers must not be read as each other's).

    Args:
        results: a results object.

    Returns:
        e.g. ``smollm2-135m on musique_dev.json, items 30-99 (70 items), validation split``.
    """
    data = results.get("config", {}).get("data")
    return (f"{results['model']['name']} on {data}, "
            f"{items_caption(data, [int(r['index']) for r in results['items']])}")
