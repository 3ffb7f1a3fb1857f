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
import sys
from pathlib import Path
from typing import Any

from blend import safeio
from blend.evals import metrics as M
from blend.evals.methods import MethodKind
from blend.evals.rows import (
    MAX_ROWS_BYTES, FieldTypes, ItemRow, RowError, brief, brief_list, check_fields, is_count, is_number, is_str,
    read_jsonl,
)
from blend.evals.splits import ItemRangeError, parse_item_range, range_split


_FIGURES = ("kl", "top1", "share")  # a research row's {variant: figure} maps
# a research row's fields read here (it holds others too: id, prompt_tokens, residual, ...; kept unchecked)
RESEARCH_ROW_TYPES: FieldTypes = {
    "index": (is_count, "a non-negative integer"),
    **{f: (lambda x: isinstance(x, dict) and all(is_str(k) and is_number(v) for k, v in x.items()),
           "an object of finite numbers (names of valid Unicode)") for f in _FIGURES},
}


def research_row(d: Any, where: str) -> dict:
    """A research JSONL row, checked: ``index``, and ``kl``, ``top1``, ``share`` maps of finite numbers, the
    last two holding every variant of ``kl``.

    Args:
        d: the decoded line.
        where: ``PATH:LINE``, for the message.

    Returns:
        The row (a dict, as the research tool wrote it).

    Raises:
        RowError: naming ``where`` and the field.
    """
    row = check_fields(d, RESEARCH_ROW_TYPES, where, others=True)
    for f in ("top1", "share"):
        lacks = [k for k in row["kl"] if k not in row[f]]
        if lacks:
            raise RowError(f"{where}.{f}: lacks variant(s) {brief_list(lacks)} of kl")
    return row


def load_rows(paths: list[Path], items: str | None = None) -> list[dict]:
    """Rows of several files (research JSONL, or a harness results.json) merged by item index.

    Args:
        paths: the files (``.json``: a harness results.json; else research JSONL).
        items: keep the rows of this item range (``A-B``) only.

    Returns:
        One row per item, in item order.

    Raises:
        RowError: a file that cannot be read, or a row that is not one (the message names the file, and the
            line of a JSONL file).
    """
    rows: dict[int, dict] = {}
    for p in paths:
        if p.suffix == ".json":
            new = rows_from_results(p)
        else:
            new = [research_row(value, where) for where, value in read_jsonl(p)]
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
    methods never share a row. A method whose KL or top-1 is null on an item (not finite) is left out of
    that item's row (the summary counts its items, ``n``).

    Raises:
        RowError: the file cannot be read, is not JSON, or is not a results object as far as read here (its
            items, :class:`~blend.evals.rows.ItemRow` JSON, and the specs of their methods); the message
            names the file.
    """
    res = _read_results(path)
    out = []
    for i, d in enumerate(res["items"]):
        try:
            item = ItemRow.from_json(d)
        except RowError as e:
            raise RowError(f"{path}: results.items[{i}]: {e}") from None
        kl, top1, share = {}, {}, {}
        for name, m in item.methods.items():
            spec = _spec(path, res["methods"], name)
            if m.kl is None or m.top1 is None:
                continue
            if (spec.get("kind") == MethodKind.BLEND.value and spec.get("selector") in selectors
                    and not spec.get("check_layers")):
                key = f"{name.partition(':')[2]}@{spec['ratio']:g}"  # the selector and any options after it
                kl[key], top1[key], share[key] = m.kl, m.top1, spec["ratio"]
            elif spec.get("kind") == MethodKind.REUSE.value:
                kl["reuse@0"], top1["reuse@0"], share["reuse@0"] = m.kl, m.top1, 0.0
        out.append({"index": item.index, "kl": kl, "top1": top1, "share": share})
    return out


def _read_results(path: Path) -> dict[str, Any]:
    """A results.json's object, with its ``items`` a list and its ``methods`` an object.

    Raises:
        RowError: naming the file.
    """
    try:
        res = json.loads(safeio.read_regular(path, MAX_ROWS_BYTES, follow_symlinks=True).decode("utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise RowError(f"{path}: cannot read it ({type(e).__name__}: {str(e)[:200]})") from None
    except (ValueError, RecursionError) as e:  # not JSON (an integer of too many digits, nesting too deep)
        raise RowError(f"{path}: not JSON ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(res, dict) or not isinstance(res.get("items"), list) or not isinstance(res.get("methods"), dict):
        raise RowError(f"{path}: not a results object (no items list or methods object)")
    return res


def _spec(path: Path, methods: dict[str, Any], name: str) -> dict[str, Any]:
    """The spec of method ``name`` in a results object's ``methods`` ({} where it has none).

    Raises:
        RowError: the method is not there, or its spec is not an object (a blend's without a finite ratio).
    """
    where = f"{path}: results.methods[{brief(name)}]"
    if not isinstance(methods.get(name), dict):
        raise RowError(f"{where}: missing or not an object")
    spec = methods[name].get("spec") or {}
    if not isinstance(spec, dict):
        raise RowError(f"{where}.spec: not an object")
    if spec.get("kind") == MethodKind.BLEND.value and not is_number(spec.get("ratio")):
        raise RowError(f"{where}.spec.ratio: not a finite number")
    return spec


def partial_variants(rows: list[dict]) -> dict[str, int]:
    """The variants some rows lack, each with the count of rows that hold it (what ``--all`` would show them
    over); the summary leaves them out by default, and :func:`main` names them."""
    names = sorted({k for r in rows for k in r["kl"]})
    counts = {n: sum(1 for r in rows if n in r["kl"]) for n in names}
    return {n: c for n, c in counts.items() if c < len(rows)}


def summarise(rows: list[dict], common_only: bool = True) -> list[dict]:
    """One dict per variant (name, n, mean, ci, median, p90, max, top1, share), by mean KL: the harness's own
    statistics (:mod:`blend.evals.metrics`: linear percentiles, its bootstrap at its default resamples/seed).

    Args:
        rows: research rows (:func:`load_rows`).
        common_only: only the variants every row holds (the others' figures would be over other items).

    Returns:
        The summaries, lowest mean KL first.
    """
    names = sorted({k for r in rows for k in r["kl"]})
    if common_only:
        names = [n for n in names if all(n in r["kl"] for r in rows)]
    out = []
    for n in names:
        kl = [r["kl"][n] for r in rows if n in r["kl"]]
        out.append({
            "name": n, "n": len(kl), "mean": M.mean(kl), "ci": M.bootstrap_ci(kl),
            "median": M.median(kl), "p90": M.percentile(kl, 90.0), "max": max(kl),
            "top1": M.mean([r["top1"][n] for r in rows if n in r["kl"]]),
            "share": M.mean([r["share"][n] for r in rows if n in r["kl"]]),
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
    try:
        rows = load_rows(a.rows, a.items)
    except RowError as e:
        print(f"research_summary: error: {e}", file=sys.stderr)
        return 2
    stats = summarise(rows, common_only=not a.all)
    keep = a.only.split(",") if a.only else None
    if keep:
        if a.complete:
            rows = [r for r in rows if all(k in r["kl"] for k in keep)]
            stats = summarise(rows, common_only=True)
        stats = sorted([s for s in stats if s["name"] in keep], key=lambda s: keep.index(s["name"]))
    print(f"{len(rows)} items of {lo}-{hi}, {range_split(lo, hi)} split")
    print(table(stats))
    shown = {s["name"] for s in stats}
    partial = {n: c for n, c in partial_variants(rows).items() if n not in shown and (keep is None or n in keep)}
    if partial:  # a variant on fewer items (a null KL in a harness run, rows not merged) is not silently gone
        print("Left out, not on every item (--all summarises each over its own items): "
              + ", ".join(f"`{n}` ({c} of {len(rows)})" for n, c in partial.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
