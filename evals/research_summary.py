"""Summarise research_selectors rows: per variant mean / median / p90 / max KL, top-1, mean share.

    python -m blend.evals.research_summary ROWS.jsonl [...] [--items 30-99] [--md OUT.md]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from blend.evals import metrics as M
from blend.evals.items import parse_item_range


def load_rows(paths: list[Path], items: str | None = None) -> list[dict]:
    """Rows of several files merged by item index (later files add variants)."""
    rows: dict[int, dict] = {}
    for p in paths:
        for line in p.read_text().splitlines():
            if not line.strip():
                continue
            r = json.loads(line)
            old = rows.get(r["index"])
            if old is None:
                rows[r["index"]] = r
            else:
                for k in ("kl", "top1", "share"):
                    old.setdefault(k, {}).update(r.get(k, {}))
    if items:
        lo, hi = parse_item_range(items)
        rows = {i: r for i, r in rows.items() if lo <= i <= hi}
    return [rows[i] for i in sorted(rows)]


def summarise(rows: list[dict], common_only: bool = True) -> list[dict]:
    """One dict per variant (name, n, mean, ci, median, p90, max, top1, share), by mean KL."""
    names = sorted({k for r in rows for k in r["kl"]})
    if common_only:
        names = [n for n in names if all(n in r["kl"] for r in rows)]
    out = []
    for n in names:
        kl = [r["kl"][n] for r in rows if n in r["kl"]]
        out.append({
            "name": n, "n": len(kl), "mean": float(np.mean(kl)), "ci": M.bootstrap_ci(kl, n=1000),
            "median": float(np.median(kl)), "p90": float(np.percentile(kl, 90)), "max": float(np.max(kl)),
            "top1": float(np.mean([r["top1"][n] for r in rows if n in r["kl"]])),
            "share": float(np.mean([r["share"][n] for r in rows if n in r["kl"]])),
        })
    return sorted(out, key=lambda s: s["mean"])


def table(stats: list[dict]) -> str:
    lines = ["| variant | n | mean KL [95% CI] | median | p90 | max | top-1 | recompute share |",
             "|---|---|---|---|---|---|---|---|"]
    for s in stats:
        ci = s["ci"]
        lines.append(f"| `{s['name']}` | {s['n']} | {s['mean']:.4f} [{ci[0]:.4f}, {ci[1]:.4f}] | {s['median']:.4f} "
                     f"| {s['p90']:.4f} | {s['max']:.4f} | {s['top1']:.3f} | {s['share']:.3f} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("rows", nargs="+", type=Path)
    p.add_argument("--items", default=None)
    p.add_argument("--all", action="store_true", help="also variants not run on every item")
    a = p.parse_args()
    rows = load_rows(a.rows, a.items)
    print(f"{len(rows)} items")
    print(table(summarise(rows, common_only=not a.all)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
