"""First-token quality sweep over a cached full-prefill reference (research tool, issue 14).

``kvblend eval`` times every method against a full prefill run in the same
process and decodes answers; that is the figure of record, and it costs a full
prefill per item per run. Comparing selector variants only needs the
reference's first-token logits, which do not change between variants, so this
tool computes them once per (model, dtype, prompt tokens) and keeps them under
``--ref-cache``. Each variant then costs one blended prefill per item.

    python -m blend.evals.sweep --data ../shared/data/musique_dev.json --items 0-29 \
        --methods blend@0.15:probe,blend@0.15:probe:probe=bf16 --ref-cache out/ref --out DIR

Writes DIR/rows.jsonl (one row per item and method) and DIR/summary.md: per
split (tuning 0-29 / validation 30-99) mean, median, p90, max KL, top-1, the
blend's median milliseconds, and per method the items where it beats the first
method of its budget (``blend@R``). ``--from-rows A,B`` summarises rows that
earlier runs wrote (e.g. one item range per core) instead of running, and
``--plot`` then draws budget.png. Milliseconds are one sample per item and
method, interleaved, at the process's torch thread count: each is the request's
own TTFT from its reuse report (``report.timings.ttft_s``: the prefill up to
the first token's logits, store lookups included; the quality gate's one-off run
and the KV cache's allocation are outside it), as is ``--time-full``'s full
prefill.
Before the first item is timed, every method (and, with ``--time-full``, a full
prefill) runs once untimed on it, so one-off costs (the quality gate's
calibration run, the probe's low-precision weight copy, a cold first full
prefill) stay out of the samples. TTFT ratios of record come from ``kvblend eval``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path

import torch

from blend import safeio
from blend.defaults import DEFAULT_EVAL_DATA, DEFAULT_MODEL
from blend.engine import Engine
from blend.evals.data import load_item_range
from blend.evals.methods import MethodKind, Method, parse_method, split_specs
from blend.evals.ref_cache import reference_logits
from blend.evals.metrics import kl_cells, kl_divergence, mean, median, percentile, top1_agree
from blend.evals.report import NEAR_TIE_NATS
from blend.evals.rows import (
    FieldTypes, RowError, check_fields, is_count, is_real, is_str, or_null, read_jsonl,
)
from blend.evals.splits import ItemRangeError, has_splits, items_caption, parse_item_range, split_of
from blend.policy import ReusePolicy
from blend.probe import top2_margin
from blend.report import ReuseReport
from blend.store.memory import MemoryStore



@dataclass(frozen=True)
class SweepRow:
    """One method on one item."""

    item: int
    method: str
    kl: float
    top1: float
    ms: float  # the blend's TTFT, from its report (timings.ttft_s)
    share: float | None  # recomputed share of reused document rows (the report's ratio)
    prompt_tokens: int
    ref_margin: float | None = None  # the reference's first-token top-2 gap
    margin: float | None = None  # the blend's first-token top-2 gap (before a near-tie guard)
    guarded: bool = False  # the near-tie guard recomputed it
    full_ms: float | None = None  # with --time-full: this item's full prefill, timed in the same process
    spent: float | None = None  # share recomputed over every pass (a guarded item: both); None in older rows
    setup: str | None = None  # "<passages> passages, <model> <dtype>" it ran with; None in older rows


SWEEP_STORE_BYTES = 2 << 30  # chunk KV kept across items (LRU)


def request_ms(report: ReuseReport) -> float:
    """A request's TTFT in milliseconds, as its reuse report timed it (``timings.ttft_s``: the
    prefill itself, without the quality gate's one-off run or the KV cache's allocation)."""
    return report.timings.ttft_s * 1e3


def warm_up(engine: Engine, prompt, policies: list[ReusePolicy], time_full: bool) -> None:
    """Run every policy (and, when full prefill is timed, one full prefill) once, untimed, so
    one-off costs land here and not in the first item's samples: the quality gate's calibration
    run (on a gated engine, the first blend's), the probe's low-precision weight copy (built by the
    first blend of each probe precision) and a cold first full prefill. A gate refusal is not
    judged here: the timed request that follows reports it."""
    if time_full:
        engine.prefill(prompt, ReusePolicy.one_pass())
    for policy in policies:
        engine.prefill(prompt, policy)


def first_of_budget(method: str, methods: list[str]) -> str:
    """The first listed method with ``method``'s kind and budget (``blend@0.15:probe`` for
    ``blend@0.15:v``): what it is compared with."""
    spec = parse_method(method)
    return next(m for m in methods if (parse_method(m).kind, parse_method(m).ratio) == (spec.kind, spec.ratio))


_REAL, _REAL_OR_NULL = (is_real, "a number"), (or_null(is_real), "a number or null")
# SweepRow's fields as rows.jsonl holds them (its kl, top1 and ms as json.dumps writes them: NaN too)
SWEEP_ROW_TYPES: FieldTypes = {
    "item": (is_count, "a non-negative integer"), "method": (is_str, "a string"), "kl": _REAL, "top1": _REAL,
    "ms": _REAL, "share": _REAL_OR_NULL, "prompt_tokens": (is_count, "a non-negative integer"),
    "ref_margin": _REAL_OR_NULL, "margin": _REAL_OR_NULL, "guarded": (lambda x: isinstance(x, bool), "a boolean"),
    "full_ms": _REAL_OR_NULL, "spent": _REAL_OR_NULL, "setup": (or_null(is_str), "a string or null"),
    "probe_margin": _REAL_OR_NULL,
}
SWEEP_ROW_RETIRED = frozenset({"probe_margin"})  # written by the first near-tie guard's sweeps; read and dropped
SWEEP_ROW_SINCE = frozenset(f.name for f in fields(SweepRow) if f.default is not MISSING)  # older rows lack them


def read_rows(paths: list[Path]) -> list[SweepRow]:
    """Rows that earlier sweeps wrote (rows.jsonl files), in file order; a later row of the same item and
    method (a rerun) supersedes an earlier one, so no item counts twice.

    Args:
        paths: the rows files.

    Returns:
        The rows.

    Raises:
        RowError: a file that cannot be read, or a line that is not a sweep row (not JSON, a field missing,
            unknown or of the wrong type); the message names the file and the line.
    """
    rows: dict[tuple[int, str], SweepRow] = {}
    for p in paths:
        for where, value in read_jsonl(p):
            got = check_fields(value, SWEEP_ROW_TYPES, where, optional=SWEEP_ROW_SINCE | SWEEP_ROW_RETIRED)
            row = SweepRow(**{k: v for k, v in got.items() if k not in SWEEP_ROW_RETIRED})
            rows[(row.item, row.method)] = row
    return list(rows.values())


def summarise(rows: list[SweepRow], methods: list[str], splits: bool = True) -> str:
    """Markdown tables per split: KL mean / median / p90 / max, top-1, ms, wins against the first method.

    A method without rows on some of the split's items (merged runs, one that stopped early) is summarised
    over its own items, and its name says so (``(29 of 30 items)``): its figures are then not over the same
    items as the others'. Its wins count the items it shares with the method it is compared with.

    Args:
        rows: the sweep's rows.
        methods: method names, the first is the one others are compared with.
        splits: musique_dev's tuning / validation split (False: one table, e.g. synthetic sets).
    """
    out = []
    for split in ("tuning", "validation", "other"):
        mine = [r for r in rows if (split_of(r.item) if splits else "other") == split]
        if not mine:
            continue
        items = sorted({r.item for r in mine})
        timed = all(r.full_ms for r in mine)
        out += [f"### {split}: {len(items)} items ({items[0]}-{items[-1]})", "",
                "| method | mean KL | median | p90 | max | top-1 | share | spent | median ms | beats first of budget |"
                + (" TTFT ratio median | mean | p90 |" if timed else ""),
                "|---|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if timed else "")]
        by = {(r.item, r.method): r for r in mine}
        for m in methods:
            rs = [r for r in mine if r.method == m]
            if not rs:
                continue
            kls = [r.kl for r in rs]
            first = first_of_budget(m, methods)
            paired = [r for r in rs if (r.item, first) in by]  # the items both were run on
            wins = sum(1 for r in paired if r.kl < by[(r.item, first)].kl)
            share = mean([r.share for r in rs])
            spent = mean([r.share if r.spent is None else r.spent for r in rs])
            name = m if len(rs) == len(items) else f"{m} ({len(rs)} of {len(items)} items)"
            line = (f"| {name} | {kl_cells(kls)} | {mean([r.top1 for r in rs]):.3f} | {_cell(share)} | {_cell(spent)} "
                    f"| {median([r.ms for r in rs]):.0f} | {wins}/{len(paired)} |")
            if timed:
                ratios = [r.ms / r.full_ms for r in rs]
                line += f" {median(ratios):.3f} | {mean(ratios):.3f} | {percentile(ratios, 90):.3f} |"
            out.append(line)
        out.append("")
        for m in methods:
            flips = sorted((r for r in mine if r.method == m and r.top1 == 0.0), key=lambda r: r.item)
            if flips:
                ties = sum(1 for r in flips if r.ref_margin is not None and r.ref_margin < NEAR_TIE_NATS)
                gaps = ", ".join(f"{r.item} ({'?' if r.ref_margin is None else f'{r.ref_margin:.2f}'})" for r in flips)
                out.append(f"- `{m}` first-token flips: {len(flips)}, {ties} near ties "
                           f"(full's top-2 gap < {NEAR_TIE_NATS} nats); item (gap): {gaps}")
        out.append("")
    return "\n".join(out)


def _cell(x: float | None) -> str:
    return "" if x is None else f"{x:.3f}"


def write_budget_plot(rows: list[SweepRow], methods: list[Method], path: Path, title: str) -> None:
    """budget.png: per selector, first-token KL (mean solid, p90 dashed) and top-1 against the
    recompute budget (matplotlib, Agg backend).

    Args:
        rows: sweep rows (the items to plot).
        methods: blend methods; one line per plot series (:meth:`Method.series`) over their budgets.
        path: where to write the PNG.
        title: the figure's title (data, split, items).
    """
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    lines: dict[str, list[tuple[float, list[SweepRow]]]] = {}
    for m in methods:
        rs = [r for r in rows if r.method == m.name]
        if rs:
            lines.setdefault(m.series(), []).append((m.ratio, rs))
    fig, (ax_kl, ax_top) = plt.subplots(1, 2, figsize=(10.5, 4.2))
    for i, (label, pts) in enumerate(sorted(lines.items())):
        pts.sort(key=lambda p: p[0])
        xs = [b for b, _ in pts]
        kls = [[r.kl for r in rs] for _, rs in pts]
        color = f"C{i}"
        ax_kl.plot(xs, [mean(k) for k in kls], "-o", color=color, label=f"{label} mean")
        ax_kl.plot(xs, [percentile(k, 90) for k in kls], "--", color=color,
                   alpha=0.7, label=f"{label} p90")
        ax_top.plot(xs, [mean([r.top1 for r in rs]) for _, rs in pts], "-o", color=color, label=label)
    ax_kl.set(xlabel="recompute budget (share of reused rows)", ylabel="KL(full || blend), first token",
              yscale="log", title="first-token KL: mean (solid), p90 (dashed)")
    ax_top.set(xlabel="recompute budget (share of reused rows)", ylabel="top-1 agreement with full prefill",
               title="first-token top-1")
    for ax in (ax_kl, ax_top):
        ax.grid(alpha=0.3)
    ax_kl.legend(fontsize=7, ncol=2)
    ax_top.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    safeio.save_figure(fig, path, dpi=110)
    plt.close(fig)


def write_items_plot(rows: list[SweepRow], methods: list[str], path: Path, title: str) -> None:
    """items.png: every item of a timed sweep as a point, TTFT ratio against first-token KL, one colour
    per method; items the near-tie guard blended again are crosses (what it cost, what it bought).

    Args:
        rows: timed sweep rows (``full_ms`` set).
        methods: method names, in legend order.
        path: where to write the PNG.
        title: the figure's title (data, split, items).
    """
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for i, m in enumerate(methods):
        rs = [r for r in rows if r.method == m and r.full_ms]
        for guarded, marker in ((False, "o"), (True, "x")):
            pts = [r for r in rs if r.guarded is guarded]
            if pts:
                ax.scatter([r.ms / r.full_ms for r in pts], [max(r.kl, 1e-6) for r in pts], marker=marker, s=22,
                           color=f"C{i}", alpha=0.75, label=f"{m}" + (" (guarded)" if guarded else ""))
    ax.set(xlabel="TTFT / full prefill (same process)", ylabel="KL(full || blend), first token", yscale="log",
           title="per item")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    safeio.save_figure(fig, path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m blend.evals.sweep", description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=DEFAULT_EVAL_DATA)
    ap.add_argument("--items", default="0-29", help="item range A-B (0-based, inclusive)")
    ap.add_argument("--passages", type=int, default=5)
    ap.add_argument("--methods", required=True, help="comma list of blend / reuse methods (see kvblend eval)")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--ref-cache", default="out/ref-logits", help="folder of cached full-prefill logits")
    ap.add_argument("--out", required=True)
    ap.add_argument("--time-full", action="store_true",
                    help="also time one full prefill per item (before its methods) for TTFT ratios")
    ap.add_argument("--force", action="store_true",
                    help="blend even where the model's quality gate refuses it (without it a refusal stops the "
                         "sweep: it would score full prefill as the blend)")
    ap.add_argument("--from-rows", default=None,
                    help="comma list of rows.jsonl files from earlier runs: summarise them (with --methods' order)")
    ap.add_argument("--plot", action="store_true", help="with --from-rows: also draw budget.png (KL and top-1 "
                    "against the budget, one line per selector) and, for timed rows, items.png (TTFT ratio "
                    "against KL per item, guarded items marked)")
    args = ap.parse_args(argv)

    methods = [parse_method(s) for s in split_specs(args.methods)]
    if args.from_rows:
        try:
            rows = read_rows([Path(p) for p in args.from_rows.split(",")])
        except RowError as e:
            print(f"sweep: {e}", file=sys.stderr)
            return 2
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        items = sorted({r.item for r in rows})
        setups = sorted({r.setup for r in rows if r.setup is not None})
        if any(r.setup is None for r in rows):  # older rows: only the command line can say (and may be wrong)
            setups.append(f"{args.passages} passages, {args.model} {args.dtype} as given on the command line "
                          "(rows without a recorded setup)")
        text = (f"First-token sweep, {args.data}, {len(items)} items, {'; '.join(setups)}; merged from "
                f"{args.from_rows}; reference: full prefill (cached).\n\n"
                + summarise(rows, [m.name for m in methods], splits=has_splits(args.data)))
        safeio.atomic_write_text(out / "summary.md", text)
        print(text)
        if args.plot:
            setup = setups[0] if len(setups) == 1 else args.model
            title = f"{setup}, {args.data}, {items_caption(args.data, items)}"  # the split too, as documented
            write_budget_plot(rows, [m for m in methods if m.kind is MethodKind.BLEND], out / "budget.png", title)
            if all(r.full_ms for r in rows):
                write_items_plot(rows, [m.name for m in methods], out / "items.png", title)
        return 0
    if any(m.kind in (MethodKind.FULL, MethodKind.PREFIX) for m in methods):
        print("sweep: full and prefix are the reference and exact path; list blend or reuse methods", file=sys.stderr)
        return 2
    try:
        lo, hi = parse_item_range(args.items)
    except ItemRangeError as e:
        print(f"sweep: {e}", file=sys.stderr)
        return 2
    items = load_item_range(args.data, range(lo, hi + 1), args.passages)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # LRU-bounded: each item precomputes its own chunks right before its methods, so the store only
    # needs the current item's; unbounded, 100 items x 5 passages held ~14 GB of chunk KV
    engine = Engine.load(args.model, dtype=args.dtype, store=MemoryStore(budget_bytes=SWEEP_STORE_BYTES))
    rows: list[SweepRow] = []
    names = [m.name for m in methods]
    t_start = time.perf_counter()
    with open(out / "rows.jsonl", "w") as f:
        for n, it in enumerate(items):
            idx = lo + n
            prompt = engine.build_prompt(it.question, it.document_texts())
            ref = reference_logits(engine, prompt, Path(args.ref_cache))
            engine.precompute(prompt, methods[0].policy())
            policies = [replace(m.policy(), force=True) if args.force else m.policy() for m in methods]
            if n == 0:
                warm_up(engine, prompt, policies, args.time_full)
            full_ms = None
            if args.time_full:
                full_ms = request_ms(engine.prefill(prompt, ReusePolicy.one_pass())[2])
            for m, policy in zip(methods, policies):
                logits, _, report = engine.prefill(prompt, policy)
                ms = request_ms(report)
                if report.gate:
                    print(f"sweep: {m.name} on item {idx} did not blend ({report.gate}); its KL would be full "
                          "prefill's. Pass --force to measure the blend anyway.", file=sys.stderr)
                    engine.close()
                    return 2
                row = SweepRow(idx, m.name, kl_divergence(ref, logits), top1_agree(ref, logits), ms, report.ratio,
                               len(prompt), top2_margin(ref), report.first_token_margin, bool(report.guard), full_ms,
                               report.spent, f"{args.passages} passages, {args.model} {args.dtype}")
                rows.append(row)
                f.write(json.dumps(asdict(row)) + "\n")
                f.flush()
            done = n + 1
            eta = (time.perf_counter() - t_start) / done * (len(items) - done)
            print(f"item {idx}: " + " ".join(f"{r.method}={r.kl:.4f}" for r in rows[-len(methods):])
                  + f"  [{done}/{len(items)}, eta {eta / 60:.1f} min]", file=sys.stderr, flush=True)
    header = (f"First-token sweep, {args.data} items {args.items}, {args.passages} passages, {args.model} "
              f"{args.dtype}, {torch.get_num_threads()} torch threads; reference: full prefill (cached).\n\n")
    text = header + summarise(rows, names, splits=has_splits(args.data))
    safeio.atomic_write_text(out / "summary.md", text)
    print(text)
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
