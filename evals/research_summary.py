"""Summarise research_selectors rows: per variant mean / median / p90 / max KL, top-1, mean share.

    python -m blend.evals.research_summary ROWS.jsonl [...] --items 30-99

``--items`` is required: rows of musique_dev's tuning (0-29) and validation (30-99) splits are
often merged from several files, and pooling them would mix what the selectors were tuned on
with what they are judged on. The printed header names the range and its split (``mixed``
where the range spans both, e.g. ``--items 0-99`` on purpose).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from blend.evals import metrics as M
from blend.evals.methods import MethodKind
from blend.evals.rows import ItemRow
from blend.evals.splits import ItemRangeError, parse_item_range, range_split


def load_rows(paths: list[Path], items: str | None = None) -> list[dict]:
    """Rows of several files (research JSONL, or a harness results.json) merged by item index."""
    rows: dict[int, dict] = {}
    for p in paths:
        if p.suffix == ".json":
            new = rows_from_results(p)
        else:
            new = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
        for r in new:
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


def rows_from_results(path: Path, selectors: tuple[str, ...] = ("combo", "v", "k")) -> list[dict]:
    """Research-style rows from a harness results.json (``blend@R:S`` -> ``S@R``), e.g. the baselines
    of docs/results/musique5 (the lab replays the engine bit for bit, so these compare directly).
    A method with more options keeps them (``blend@R:S:guard=off`` -> ``S:guard=off@R``), so two
    methods never share a row."""
    res = json.loads(path.read_text())
    out = []
    for item in (ItemRow.from_json(r) for r in res["items"]):
        kl, top1, share = {}, {}, {}
        for name, m in item.methods.items():
            spec = res["methods"][name].get("spec") or {}
            if (spec.get("kind") == MethodKind.BLEND.value and spec.get("selector") in selectors
                    and not spec.get("check_layers")):
                key = f"{name.partition(':')[2]}@{spec['ratio']:g}"  # the selector and any options after it
                kl[key], top1[key], share[key] = m.kl, m.top1, spec["ratio"]
            elif spec.get("kind") == MethodKind.REUSE.value:
                kl["reuse@0"], top1["reuse@0"], share["reuse@0"] = m.kl, m.top1, 0.0
        out.append({"index": item.index, "kl": kl, "top1": top1, "share": share})
    return out


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m blend.evals.research_summary", description=__doc__.splitlines()[0])
    p.add_argument("rows", nargs="+", type=Path)
    p.add_argument("--items", required=True,
                   help="item range A-B, 0-based inclusive (required): musique_dev 0-29 is the tuning split, "
                        "30-99 the validation split; a range over both is labelled mixed")
    p.add_argument("--all", action="store_true", help="also variants not run on every item")
    p.add_argument("--only", default=None, help="comma list of variants to show")
    p.add_argument("--complete", action="store_true", help="only items that hold every --only variant")
    a = p.parse_args(argv)
    try:
        lo, hi = parse_item_range(a.items)
    except ItemRangeError as e:
        p.error(str(e))
    rows = load_rows(a.rows, a.items)
    stats = summarise(rows, common_only=not a.all)
    if a.only:
        keep = a.only.split(",")
        if a.complete:
            rows = [r for r in rows if all(k in r["kl"] for k in keep)]
            stats = summarise(rows, common_only=True)
        stats = sorted([s for s in stats if s["name"] in keep], key=lambda s: keep.index(s["name"]))
    print(f"{len(rows)} items of {lo}-{hi}, {range_split(lo, hi)} split")
    print(table(stats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
