"""bfloat16 end to end on CPU (issue 18): speed and quality against fp32 full prefill.

Two engines over the same weights in one process, one computing and storing
KV in fp32, one in bf16 (model and KV). Per item, after an untimed warm-up of
each method, ``--repeats`` rounds over every method, the order rotated by one
method each round: fp32 full prefill (the reference logits, and the TTFT each
ratio of that round divides by), bf16 full prefill, bf16 full reuse (no
recompute, no near-tie guard: the floor, as ``reuse`` elsewhere), bf16 blend at
each ratio (default policy) and fp32 blend at the same ratios for comparison.
An item's ratio is the median of its rounds. Quality is the first-token
KL(fp32 full || method) and top-1 agreement (the same every round); chunk KV is
precomputed. A reuse or blend request whose report says it did not blend
(refused, or nothing to re-position) stops the run.

    python -m blend.evals.bench_bf16 [--items 0-9,30-39] [--passages 5] [--ratios 0.15] [--repeats 2] --out DIR

Writes DIR/bf16.json and DIR/bf16.md (mean, median, p90, max KL; top-1; TTFT ratio median).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from blend.defaults import DEFAULT_EVAL_DATA, DEFAULT_MODEL
from blend.engine import Engine
from blend.evals.data import load_items
from blend.evals.environment import describe_environment
from blend.evals.metrics import kl_cells, kl_divergence, top1_agree
from blend.evals.paths import check_blended
from blend.evals.splits import item_range_arg, parse_item_range, split_of  # tuning 0-29, validation 30-99, other past them
from blend.policy import ReuseMode, ReusePolicy
from blend.store.memory import MemoryStore
from blend import safeio



def _items(spec: str) -> list[int]:
    out: list[int] = []
    for part in spec.split(","):
        lo, hi = parse_item_range(part)
        out += range(lo, hi + 1)
    return out


def _methods(ratios: list[float]) -> dict[str, tuple[str, ReusePolicy]]:
    """name -> (dtype, policy); the fp32 full prefill is the reference and always first."""
    out = {"fp32 full": ("float32", ReusePolicy.one_pass()), "bf16 full": ("bfloat16", ReusePolicy.one_pass()),
           "bf16 reuse": ("bfloat16", ReusePolicy.blend(ratio=0.0, guard_margin=None))}
    for r in ratios:
        out[f"bf16 blend@{r:g}"] = ("bfloat16", ReusePolicy.blend(ratio=r))
        out[f"fp32 blend@{r:g}"] = ("float32", ReusePolicy.blend(ratio=r))
    return out


def run(model: str, data: str, items: list[int], passages: int, ratios: list[float], repeats: int = 2) -> dict:
    """Every method on every item, ``repeats`` rounds in rotating order (module docstring).

    Returns:
        ``{"rows": [{"index", "tokens", "methods": {name: {"kl", "top1", "ttft_s", "ratio"}}}], "methods",
        "threads", "passages", "repeats", "gemm"}``; ttft_s and ratio are medians over the rounds.
    """
    # each engine its own weights copy and store (provenance differs by dtype)
    engines = {dt: Engine.load(model, dtype=dt, store=MemoryStore(), quality_gate=False)
               for dt in ("float32", "bfloat16")}
    methods = _methods(ratios)
    names = list(methods)
    records = load_items(data, None, passages)
    rows = []
    for n, i in enumerate(items):
        it = records[i]
        prompts = {dt: e.build_prompt(it.question, it.document_texts()) for dt, e in engines.items()}
        for dt, pol in methods.values():
            engines[dt].precompute(prompts[dt], pol)
            engines[dt].generate(prompts[dt], pol, max_new_tokens=1)  # warm-up
        answers, ttft, ratio = {}, {k: [] for k in names}, {k: [] for k in names}
        for r in range(repeats):
            got = {}
            for name in names[r % len(names):] + names[: r % len(names)]:
                dt, pol = methods[name]
                got[name] = engines[dt].generate(prompts[dt], pol, max_new_tokens=1)
                if pol.mode is ReuseMode.BLEND:
                    check_blended(name, got[name].report)
            for name, a in got.items():
                ttft[name].append(a.ttft_s)
                ratio[name].append(a.ttft_s / got["fp32 full"].ttft_s)
                answers.setdefault(name, a)
        ref = answers["fp32 full"]
        rows.append({"index": i, "tokens": len(prompts["float32"]), "methods": {
            name: {"kl": kl_divergence(ref.first_logits, a.first_logits),
                   "top1": top1_agree(ref.first_logits, a.first_logits),
                   "ttft_s": statistics.median(ttft[name]), "ratio": statistics.median(ratio[name])}
            for name, a in answers.items()}})
        print(f"[{n + 1}/{len(items)}] item {i}: " + ", ".join(
            f"{k} {v['kl']:.4f}/{v['ratio']:.3f}x" for k, v in rows[-1]["methods"].items()), file=sys.stderr, flush=True)
    return {"rows": rows, "methods": names, "threads": torch.get_num_threads(), "passages": passages,
            "repeats": repeats, "gemm": {dt: e.runner.gemm.value for dt, e in engines.items()},
            "environment": describe_environment(engines["float32"].device)}




def summarise(res: dict) -> str:
    """Markdown: one table per split present (tuning items < 30, validation from 30)."""
    gemm = ", ".join(f"{dt} {g}" for dt, g in res.get("gemm", {}).items())
    lines = [f"bf16 vs fp32 on CPU: first-token KL(fp32 full || method), {res['passages']} passages, "
             f"{res['threads']} torch threads{f', linear layers: {gemm}' if gemm else ''}; TTFT ratio to the same "
             f"round's fp32 full prefill, median over {res.get('repeats', 1)} rounds per item, then over items.", ""]
    splits = [(s, [r for r in res["rows"] if split_of(r["index"]) == s]) for s in ("tuning", "validation", "other")]
    for split, rows in splits:
        if not rows:
            continue
        lines += [f"{split}, {len(rows)} items:", "",
                  "| method | mean KL | median | p90 | max | top-1 | TTFT ratio |", "|---|---|---|---|---|---|---|"]
        for name in res["methods"]:
            kl = [r["methods"][name]["kl"] for r in rows]
            top = [r["methods"][name]["top1"] for r in rows]
            ratio = [r["methods"][name]["ratio"] for r in rows]
            lines.append(f"| {name} | {kl_cells(kl)} | {statistics.fmean(top):.3f} | {statistics.median(ratio):.3f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m blend.evals.bench_bf16", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--data", default=DEFAULT_EVAL_DATA)
    ap.add_argument("--items", type=item_range_arg, default="0-9,30-39", help="comma list of ranges A-B (tuning 0-29, validation 30-99)")
    ap.add_argument("--passages", type=int, default=5)
    ap.add_argument("--ratios", default="0.15")
    ap.add_argument("--repeats", type=int, default=2, help="timed rounds per item, order rotated (default: 2)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    res = run(args.model, args.data, _items(args.items), args.passages, [float(r) for r in args.ratios.split(",")],
              args.repeats)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    safeio.atomic_write_text(out / "bf16.json", json.dumps(res, indent=1))
    md = summarise(res)
    safeio.atomic_write_text(out / "bf16.md", md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
