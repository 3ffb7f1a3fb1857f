"""Summarise the guard-mode runs in this folder: every item, and the items whose guard fired.

    .venv/bin/python docs/results/issue14/guard_widen/summarize.py > docs/results/issue14/guard_widen/summary.md

Reads ``items_*/rows.jsonl`` (``kvblend eval``). An item's guard fired where the default method
recomputed more than its 0.15 (the second pass's rows are in its report).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from blend.evals.metrics import percentile

HERE = Path(__file__).parent
DEFAULT = "blend@0.15:probe"  # restart, the default before this run
METHODS = {DEFAULT: "restart (default before)", "blend@0.15:probe:gmode=widen": "widen",
           "blend@0.15:probe:gmode=extend": "extend", "blend@0.15:probe:guard=off": "no guard"}


def q(xs: list[float], p: float) -> float:
    """The ``p`` quantile, linearly interpolated: the harness's own (:func:`blend.evals.metrics.percentile`).
    Until 2026-12-08 this was nearest-rank, unlike every other p90 of the project."""
    return percentile(xs, 100.0 * p)


def table(rows: list[dict], title: str) -> list[str]:
    out = [f"### {title} ({len(rows)} items)", "",
           "| guard | mean KL | median | p90 | max | top-1 | TF agree | TTFT ratio median | mean | p90 | max |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, label in METHODS.items():
        ms = [r["methods"][name] for r in rows]
        kl, tt = [m["kl"] for m in ms], [m["ttft_ratio"] for m in ms]
        out.append(f"| {label} | {statistics.mean(kl):.4f} | {statistics.median(kl):.4f} | {q(kl, 0.9):.4f} | "
                   f"{max(kl):.4f} | {statistics.mean(m['top1'] for m in ms):.3f} | "
                   f"{statistics.mean(m['tf_agreement'] for m in ms):.3f} | {statistics.median(tt):.3f} | "
                   f"{statistics.mean(tt):.3f} | {q(tt, 0.9):.3f} | {max(tt):.3f} |")
    return out + [""]


def main() -> None:
    lines = ["# The near-tie guard's second pass: restart, widen, extend", "",
             "SmolLM2-135M fp32, musique_dev, 5 passages, blend@0.15 with the default guard (0.7 nats @ 0.3); "
             "one TTFT sample per item and method, two threads (see BENCHMARKS.md for what else ran).", ""]
    for folder in sorted(HERE.glob("items_*")):
        rows = [json.loads(x) for x in (folder / "rows.jsonl").read_text().splitlines() if x.strip()]
        fired = [r for r in rows if r["methods"][DEFAULT]["recomputed_frac"] > 0.2]
        split = folder.name.removeprefix("items_")
        lines += [f"## items {split}", ""]
        lines += table(rows, "every item")
        lines += table(fired, "the items whose guard fired")
        lines += ["| item | full's gap | " + " | ".join(f"KL {v}" for v in METHODS.values()) + " | flips |",
                  "|---|---|" + "---|" * len(METHODS) + "---|"]
        for r in fired:
            ms = [r["methods"][n] for n in METHODS]
            flips = ", ".join(v for v, m in zip(METHODS.values(), ms) if m["top1"] < 1) or "-"
            lines.append(f"| {r['index']} | {r['ref_margin']:.2f} | " + " | ".join(f"{m['kl']:.4f}" for m in ms)
                         + f" | {flips} |")
        lines.append("")
    sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
