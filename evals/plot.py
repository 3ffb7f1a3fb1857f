"""pareto.png: quality against TTFT ratio, one line per selector over ratios.

Three panels share the x axis (TTFT / full prefill TTFT, median over items):
F1 against gold, answer agreement with full prefill, and first-token
KL(full || method). Blend methods are grouped by selector (and check layers)
and joined in ratio order; ``full``, ``reuse`` and ``prefix`` are reference
markers.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

PANELS = (("f1", "F1 vs gold"), ("agreement", "answer agreement with full"), ("kl", "KL(full || method)"))
REFERENCE_STYLE = {"full": ("*", "black"), "reuse": ("X", "tab:red"), "prefix": ("s", "tab:gray")}


def series(methods: dict[str, dict[str, Any]]) -> dict[str, list[tuple[float, str]]]:
    """Blend methods grouped into plot lines.

    Args:
        methods: ``results["methods"]``.

    Returns:
        ``{label: [(ratio, method name), ...]}`` sorted by ratio; label is the
        selector (plus ``check=``), ``default`` when none was given.
    """
    out: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for name, agg in methods.items():
        spec = agg.get("spec") or {}
        if spec.get("kind") != "blend":
            continue
        label = spec.get("selector") or "default"
        if spec.get("check_layers"):
            label += " check=" + ",".join(map(str, spec["check_layers"]))
        out[label].append((float(spec.get("ratio") or 0.0), name))
    return {k: sorted(v) for k, v in sorted(out.items())}


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
    lines = series(methods)
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5.2 * len(PANELS), 4.2), squeeze=False)
    for ax, (field, title) in zip(axes[0], PANELS):
        for label, pts in lines.items():
            xy = [
                (methods[n]["ttft_ratio"], methods[n][field], r)
                for r, n in pts
                if methods[n].get("ttft_ratio") is not None and methods[n].get(field) is not None
            ]
            if not xy:
                continue
            xs, ys, rs = zip(*xy)
            ax.plot(xs, ys, marker="o", label=label)
            for x, y, r in xy:
                ax.annotate(f"{r:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        for name, (marker, color) in REFERENCE_STYLE.items():
            agg = methods.get(name)
            if agg and agg.get("ttft_ratio") is not None and agg.get(field) is not None:
                ax.scatter([agg["ttft_ratio"]], [agg[field]], marker=marker, color=color, s=70, zorder=3,
                           label=name)
        ax.set_xlabel("TTFT / full prefill TTFT")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), fontsize=8)
    cfg = results.get("config", {})
    fig.suptitle(f"{results['model']['name']} on {cfg.get('data')} ({len(results['items'])} items)", fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
