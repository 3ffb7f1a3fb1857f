"""TTFT by phase (issue 18): full prefill, full reuse and blend at three prompt sizes.

For each size (~600 tokens: 5 passages cut short; ~3k: 5 passages; ~6k: 10
passages of musique_dev) and item, every method runs interleaved in one
process: an untimed warm-up, then per repeat one plain run (its TTFT is the
figure; the ratio divides it by full prefill's plain TTFT of the same item
and repeat; a reuse or blend run whose report says it did not blend stops
the bench) and one run under the :class:`~blend.evals.phases.PhaseClock`
(its phase seconds; the remainder is "Python and the rest"). Chunk KV is
precomputed, so reuse and blend read every document from the memory store.

It also measures the *fixed overhead* of a blended request two ways, each
minus the question's own compute (its rows through every layer over a cache
that already holds the documents), interleaved, medians of three:

- full reuse (every document re-positioned): what a blend adds that is not
  arithmetic on the question, re-positioning included;
- the issue's definition: blend@0.15 of a prompt whose documents are all exact
  hits at their positions (this order stored by the exact path first, under a
  cache salt of its own, so the other methods never see it), with nothing to
  re-position or recompute, two ways: *loaded* (an engine over the same store
  whose hot-prefix cache keeps nothing: lookup, loading the stored rows,
  Python) and *hot*
  (the engine has seen the prompt, so its rows are attached from the hot-prefix
  cache, what a repeated prompt gets).

And each method's *work* against the full prefill of the same prompt (the phase
clock's :class:`~blend.evals.phases.Work`): its attention pairs and layer rows as
shares of the full prefill's, and the floor that work sets at the full
prefill's own speed (:func:`~blend.evals.phases.work_floor`). A blend whose
selected rows sit late in the prompt attends over more keys per row: its
pairs share is above its rows share, and so is its floor.

    python -m blend.evals.bench_phases [--items 0-2] [--repeats 3] [--sizes 600,3k,6k] \
        [--methods full,reuse,blend@0.15] [--dtype float32] --out DIR

Writes DIR/phases.json, DIR/phases.md and DIR/phases.png (stacked bars in
units of full prefill's TTFT at each size).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from blend.defaults import DEFAULT_EVAL_DATA, DEFAULT_MODEL, DEFAULT_RATIO
from blend.engine import Engine
from blend.evals.data import load_item_range
from blend.evals.environment import describe_environment
from blend.evals.metrics import percentile
from blend.evals.methods import MethodKind, parse_methods
from blend.evals.paths import check_blended
from blend.evals.phases import Phase, PhaseClock, Work, work_floor
from blend.evals.splits import item_range_arg, parse_item_range
from blend.policy import ReusePolicy
from blend.report import ReuseClass
from blend.store.memory import MemoryStore
from blend import safeio

FULL_REUSE = ReusePolicy.blend(ratio=0.0, guard_margin=None)  # the no-recompute floor: never guarded (as "reuse")
EXACT_DOCS_SALT = "bench-phases-exact-documents"  # keeps the exact-hit case's entries from the other methods
EXACT_DOCS_STORE = ReusePolicy.exact(cache_salt=EXACT_DOCS_SALT)
EXACT_DOCS_BLEND = ReusePolicy.blend(ratio=DEFAULT_RATIO, cache_salt=EXACT_DOCS_SALT, take_exact=True)  # the case
OVERHEAD_REPEATS = 3
P90_MIN_SAMPLES = 10  # under this many, a linearly interpolated p90 lies between the two largest samples
SHORT_PASSAGE_CHARS = 480  # ~110 tokens: five of them make a ~630-token prompt


@dataclass(frozen=True)
class Size:
    """A prompt size: passages per prompt and how much of each passage."""

    name: str
    passages: int
    chars: int | None  # None: the whole passage


SIZES = {"600": Size("600", 5, SHORT_PASSAGE_CHARS), "3k": Size("3k", 5, None), "6k": Size("6k", 10, None)}


@dataclass(frozen=True)
class PhaseRow:
    """One method at one size: medians over items x repeats."""

    size: str
    method: str
    prompt_tokens: int
    ttft_s: float
    ratio: float  # ttft / full prefill's ttft, per item and repeat, then the median
    phases: dict[str, float]  # phase value -> median seconds over the phase-clocked runs (each run's phases sum
    # to that run's TTFT; the medians sum to about the plain runs' median TTFT, not exactly)
    ratios: tuple[float, ...] = ()  # every item and repeat's ratio (the tail beside the median)
    pairs_share: float = 0.0  # attention pairs over the full prefill's of the same prompt (median)
    rows_share: float = 0.0  # layer rows over the full prefill's (median)
    floor: float = 0.0  # the work's cost at the full prefill's speed per pair and per row (phases.work_floor)


def size_prompts(engine: Engine, data: str, items: range, size: Size) -> list:
    """The prompts of ``data``'s items in ``items`` at a prompt size (passages per prompt, cut to its length).

    Args:
        engine: builds the prompts.
        data: the musique file.
        items: which items.
        size: passages and characters per passage.

    Returns:
        One prompt per item.
    """
    chosen = load_item_range(data, items, size.passages)
    out = []
    for it in chosen:
        texts = [t[: size.chars] if size.chars else t for t in it.document_texts()]
        out.append(engine.build_prompt(it.question, texts))
    return out


def _question_compute_s(engine: Engine, prompt) -> float:
    """Seconds of the question's rows through every layer over a cache holding the rest of the prompt."""
    ans = engine.generate(prompt, FULL_REUSE, max_new_tokens=1, keep_cache=True)
    cache, nq = ans.cache, len(prompt.question)
    cache.length = len(prompt) - nq
    ids = engine.runner.ids(prompt.question.token_ids)
    t0 = time.perf_counter()
    with torch.inference_mode():
        h, _ = engine.runner.prefill(cache, ids, keep_kv=False)
        engine.runner.logits(h[-1:])
    return time.perf_counter() - t0


def _shares(work: Work, full: Work, full_attention: float) -> tuple[float, float, float]:
    """A method's (attention pairs share, layer rows share, work floor) against the full prefill's work."""
    pairs, rows = work.share_of(full)
    return pairs, rows, work_floor(pairs, rows, full_attention)


@dataclass(frozen=True)
class Overhead:
    """Fixed overhead at one size, seconds (medians over prompts x repeats)."""

    reuse_s: float  # full reuse minus the question's compute (re-positioning included)
    exact_docs_s: float  # blend of all-exact-hit documents, loaded from the store, minus the question's compute
    exact_docs_hot_s: float  # the same with the rows attached from the hot-prefix cache


def fixed_overheads(engine: Engine, prompt) -> tuple[list[float], list[float], list[float]]:
    """The fixed overheads of one prompt, :data:`OVERHEAD_REPEATS` interleaved samples each: full reuse,
    all-exact documents loaded (an engine over the same store and weights whose hot-prefix cache keeps
    nothing, so every request loads its rows) and all-exact documents hot (the rows attached from
    ``engine``'s hot-prefix cache)."""
    engine.generate(prompt, EXACT_DOCS_STORE, max_new_tokens=1)  # stores this order's exact prefix
    loader = engine.with_store(engine.store)
    loader.segments.hot.budget_bytes = 0  # never hot: every request loads its stored rows
    for ans in (loader.generate(prompt, EXACT_DOCS_BLEND, max_new_tokens=1),
                engine.generate(prompt, EXACT_DOCS_BLEND, max_new_tokens=1)):  # loaded; then hot from here on
        if any(s.reuse_class is not ReuseClass.EXACT for s in ans.report.segments[:-1]):
            raise RuntimeError("the exact-documents case did not find every document exact")
    reuse, loaded, hot = [], [], []
    for _ in range(OVERHEAD_REPEATS):
        q = _question_compute_s(engine, prompt)
        reuse.append(engine.generate(prompt, FULL_REUSE, max_new_tokens=1).ttft_s - q)
        loaded.append(loader.generate(prompt, EXACT_DOCS_BLEND, max_new_tokens=1).ttft_s - q)
        hot.append(engine.generate(prompt, EXACT_DOCS_BLEND, max_new_tokens=1).ttft_s - q)
    return reuse, loaded, hot


def bench_size(engine: Engine, prompts: list, methods: list, repeats: int) -> tuple[list[PhaseRow], Overhead]:
    """Every method on every prompt, interleaved. Returns the rows and the fixed overheads."""
    policies = {m.name: m.policy() for m in methods}
    check = {m.name: (policies[m.name].check_layers[0] if m.kind is MethodKind.BLEND and m.ratio else None)
             for m in methods}
    ttft: dict[str, list[float]] = {m.name: [] for m in methods}
    ratio: dict[str, list[float]] = {m.name: [] for m in methods}
    phases: dict[str, list[dict[Phase, float]]] = {m.name: [] for m in methods}
    shares: dict[str, list[tuple[float, float, float]]] = {m.name: [] for m in methods}  # pairs, rows, floor
    reuse_over, exact_over, hot_over = [], [], []
    for p in prompts:
        for m in methods:
            engine.precompute(p, policies[m.name])
            engine.generate(p, policies[m.name], max_new_tokens=1)  # warm-up
        for r in range(repeats):
            plain, work, clocked_s = {}, {}, {}
            for m in methods[r % len(methods):] + methods[: r % len(methods)]:
                ans = engine.generate(p, policies[m.name], max_new_tokens=1)
                if m.kind in (MethodKind.BLEND, MethodKind.REUSE):
                    check_blended(m.name, ans.report)
                plain[m.name] = ans.ttft_s
                with PhaseClock(check[m.name]) as clock:
                    clocked_s[m.name] = engine.generate(p, policies[m.name], max_new_tokens=1).ttft_s
                phases[m.name].append(clock.times.with_remainder(clocked_s[m.name]))
                work[m.name] = clock.work
            full_attention = phases["full"][-1][Phase.ATTENTION] / clocked_s["full"]
            for m in methods:
                ttft[m.name].append(plain[m.name])
                ratio[m.name].append(plain[m.name] / plain["full"])
                shares[m.name].append(_shares(work[m.name], work["full"], full_attention))
        r_s, e_s, h_s = fixed_overheads(engine, p)
        reuse_over += r_s
        exact_over += e_s
        hot_over += h_s
    tokens = int(statistics.median(len(p) for p in prompts))
    rows = [PhaseRow("", m.name, tokens, statistics.median(ttft[m.name]), statistics.median(ratio[m.name]),
                     {ph.value: statistics.median(d[ph] for d in phases[m.name]) for ph in Phase},
                     tuple(ratio[m.name]), *(statistics.median(s[i] for s in shares[m.name]) for i in range(3)))
            for m in methods]
    return rows, Overhead(statistics.median(reuse_over), statistics.median(exact_over), statistics.median(hot_over))


def write_markdown(rows: list[PhaseRow], overhead: dict[str, float], meta: dict, path: Path,
                   exact_docs: dict[str, float] | None = None, exact_docs_hot: dict[str, float] | None = None) -> None:
    lines = [f"TTFT by phase, medians over {meta['items']} x {meta['repeats']} repeats; "
             f"{meta['threads']} torch threads, {meta['dtype']}. TTFT and ratio: medians of the plain runs; each "
             "phase: the median of that phase over the phase-clocked runs (medians do not add, so a row's phases "
             "sum to about, not exactly, its TTFT).", "",
             "| size | method | tokens | TTFT ms | ratio | " + " | ".join(p.value for p in Phase) + " |",
             "|---|---|---:|---:|---:|" + "---:|" * len(Phase)]
    for r in rows:
        lines.append(f"| {r.size} | {r.method} | {r.prompt_tokens} | {r.ttft_s * 1e3:.0f} | {r.ratio:.3f} | "
                     + " | ".join(f"{r.phases[p.value] * 1e3:.0f}" for p in Phase) + " |")
    tails = [r for r in rows if r.ratios and r.method != "full"]
    if tails:
        lines += ["", "Ratio per item and repeat (the tail beside the median):", "",
                  "| size | method | samples | median | mean | p90 | max |", "|---|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {r.size} | {r.method} | {len(r.ratios)} | {percentile(r.ratios, 50):.3f} | "
                  f"{statistics.mean(r.ratios):.3f} | {percentile(r.ratios, 90):.3f} | {max(r.ratios):.3f} |"
                  for r in tails]
        if any(len(r.ratios) < P90_MIN_SAMPLES for r in tails):
            lines += ["", f"A p90 of fewer than {P90_MIN_SAMPLES} samples is interpolated between the two largest "
                      "(numpy's linear percentile): read it as a max."]
    counted = [r for r in rows if r.method != "full" and r.rows_share > 0]  # (runs before the work count: none)
    if counted:
        lines += ["", "Work against the full prefill of the same prompt (medians): attention pairs (a query and a key "
                  "it sees, every layer, the probe's included) and layer rows; the floor is what that work costs at "
                  "the full prefill's own speed per pair and per row (its attention share of TTFT per pair, the rest "
                  "per row), so only doing less work, or doing it faster than the full prefill does, goes below it:",
                  "", "| size | method | attention pairs | layer rows | work floor | ratio |",
                  "|---|---|---:|---:|---:|---:|"]
        lines += [f"| {r.size} | {r.method} | {r.pairs_share:.3f} | {r.rows_share:.3f} | {r.floor:.3f} | "
                  f"{r.ratio:.3f} |" for r in counted]
    lines += ["", "Fixed overhead (full reuse minus the question's own compute): "
              + ", ".join(f"{k}: {v * 1e3:.1f} ms" for k, v in overhead.items())]
    if exact_docs:
        lines += ["", "Fixed overhead (blend@0.15 of documents that are all exact hits, loaded from the store, minus "
                  "the question's own compute): " + ", ".join(f"{k}: {v * 1e3:.1f} ms" for k, v in exact_docs.items())]
    if exact_docs_hot:
        lines += ["", "Fixed overhead (the same, the rows attached from the hot-prefix cache: a prompt seen before): "
                  + ", ".join(f"{k}: {v * 1e3:.1f} ms" for k, v in exact_docs_hot.items())]
    safeio.atomic_write_text(path, "\n".join(lines) + "\n")


def write_plot(rows: list[PhaseRow], path: Path) -> None:
    """One bar per (size, method): each phase's share of that method's TTFT, its TTFT ratio on top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(7, 1.0 * len(rows) + 3), 4.8))
    labels = [f"{r.size}\n" + r.method.replace(":", "\n") for r in rows]  # one option a line: long names overlapped
    bottom = [0.0] * len(rows)
    colors = plt.get_cmap("tab10")
    for i, ph in enumerate(Phase):
        vals = [100 * r.phases[ph.value] / max(sum(r.phases.values()), 1e-12) for r in rows]
        ax.bar(labels, vals, bottom=bottom, label=ph.value, color=colors(i))
        bottom = [b + v for b, v in zip(bottom, vals)]
    for x, r in enumerate(rows):
        ax.text(x, 101, f"{r.ratio:.3f}x" if r.method != "full" else f"{r.ttft_s:.1f} s", ha="center",
                va="bottom", fontsize=8)
    floors = [(x, 100 * r.floor / r.ratio) for x, r in enumerate(rows) if r.method != "full" and r.floor > 0]
    if floors:  # the work floor inside each bar: the share of its TTFT that its work costs at full speed
        ax.hlines([f for _, f in floors], [x - 0.4 for x, _ in floors], [x + 0.4 for x, _ in floors],
                  colors="black", linewidth=2, label="work floor (its work at the full prefill's speed)")
    top = max([110.0] + [f + 12 for _, f in floors])  # a method faster than its floor (bf16) has it over 100%
    ax.set_ylim(0, top)
    ax.set_ylabel("share of the method's TTFT (%)")
    ax.set_title("Where a prefill's time goes (label: TTFT / full prefill's; full: seconds; black: work floor)",
                 fontsize=10)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    safeio.save_figure(fig, path, dpi=120)
    plt.close(fig)


def replot(out: Path) -> None:
    """Rewrite phases.md and phases.png from an earlier run's phases.json."""
    res = json.loads((out / "phases.json").read_text())
    rows = [PhaseRow(**{**r, "ratios": tuple(r.get("ratios", ()))}) for r in res["rows"]]
    hot = res.get("exact_docs_hot_overhead_s")
    write_markdown(rows, res["fixed_overhead_s"], res["meta"], out / "phases.md",
                   res.get("exact_docs_overhead_s") if hot is not None else None, hot)
    if hot is None and res.get("exact_docs_overhead_s"):  # a run from before the loaded / hot split
        with (out / "phases.md").open("a") as f:
            f.write("\nFixed overhead (blend@0.15 of documents that are all exact hits, minus the question's own "
                    "compute; measured before loaded and hot were told apart: hot where the engine had a hot-prefix "
                    "cache): " + ", ".join(f"{k}: {v * 1e3:.1f} ms" for k, v in res["exact_docs_overhead_s"].items())
                    + "\n")
    write_plot(rows, out / "phases.png")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m blend.evals.bench_phases", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--data", default=DEFAULT_EVAL_DATA)
    ap.add_argument("--items", type=item_range_arg, default="0-2", help="item range A-B of the data (timing only)")
    ap.add_argument("--sizes", default="600,3k,6k")
    ap.add_argument("--methods", default="full,reuse,blend@0.15")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", required=True)
    ap.add_argument("--replot", action="store_true", help="only redraw --out's table and plot from its phases.json")
    args = ap.parse_args(argv)
    if args.replot:
        replot(Path(args.out))
        return 0
    methods = parse_methods(args.methods)
    if not methods or methods[0].name != "full":
        methods = parse_methods("full") + [m for m in methods if m.name != "full"]
    lo, hi = parse_item_range(args.items)
    items = range(lo, hi + 1)
    sizes = [SIZES[s] for s in args.sizes.split(",")]
    engine = Engine.load(args.model, dtype=args.dtype, store=MemoryStore(), quality_gate=False)
    rows, overhead, exact_docs, exact_hot = [], {}, {}, {}
    for size in sizes:
        print(f"size {size.name} ...", file=sys.stderr, flush=True)
        got, fixed = bench_size(engine, size_prompts(engine, args.data, items, size), methods, args.repeats)
        rows += [replace(r, size=size.name) for r in got]
        overhead[size.name], exact_docs[size.name], exact_hot[size.name] = (fixed.reuse_s, fixed.exact_docs_s,
                                                                            fixed.exact_docs_hot_s)
        for r in got:
            print(f"  {r.method:>12} {r.prompt_tokens:>5} tok  {r.ttft_s * 1e3:7.0f} ms  {r.ratio:.3f}x",
                  file=sys.stderr, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"items": len(items), "repeats": args.repeats, "threads": torch.get_num_threads(), "dtype": args.dtype,
            "model": args.model, "environment": describe_environment(engine.device)}
    safeio.atomic_write_text(out / "phases.json", json.dumps({"meta": meta, "rows": [asdict(r) for r in rows],
                                                 "fixed_overhead_s": overhead,
                                                 "exact_docs_overhead_s": exact_docs,
                                                 "exact_docs_hot_overhead_s": exact_hot}, indent=1))
    write_markdown(rows, overhead, meta, out / "phases.md", exact_docs, exact_hot)
    write_plot(rows, out / "phases.png")
    print((out / "phases.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
