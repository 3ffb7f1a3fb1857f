"""bfloat16 end to end on CPU (issue 18): speed and quality against fp32 full prefill.

Two engines over the same weights in one process, one computing and storing
KV in fp32, one in bf16 (model and KV). Per item, interleaved: fp32 full
prefill (the reference logits and the TTFT every ratio divides by), then bf16
full prefill, bf16 full reuse and bf16 blend at each ratio (default selector),
and fp32 blend at the same ratios for comparison. Quality is the first-token
KL(fp32 full || method) and top-1 agreement; chunk KV is precomputed.

    python -m blend.evals.bench_bf16 [--items 0-9,30-39] [--passages 5] [--ratios 0.15] --out DIR

Writes DIR/bf16.json and DIR/bf16.md (mean, median, p90, max KL; top-1; TTFT ratio median).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from blend.defaults import DEFAULT_MODEL
from blend.engine import Engine
from blend.evals.data import load_items
from blend.evals.metrics import kl_cells, kl_divergence, top1_agree
from blend.evals.splits import parse_item_range
from blend.policy import ReusePolicy
from blend.store.memory import MemoryStore

DEFAULT_DATA = "../shared/data/musique_dev.json"


def _items(spec: str) -> list[int]:
    out: list[int] = []
    for part in spec.split(","):
        lo, hi = parse_item_range(part)
        out += range(lo, hi + 1)
    return out


def _methods(ratios: list[float]) -> dict[str, tuple[str, ReusePolicy]]:
    """name -> (dtype, policy); the fp32 full prefill is the reference and always first."""
    out = {"fp32 full": ("float32", ReusePolicy.none()), "bf16 full": ("bfloat16", ReusePolicy.none()),
           "bf16 reuse": ("bfloat16", ReusePolicy.blend(ratio=0.0))}
    for r in ratios:
        out[f"bf16 blend@{r:g}"] = ("bfloat16", ReusePolicy.blend(ratio=r))
        out[f"fp32 blend@{r:g}"] = ("float32", ReusePolicy.blend(ratio=r))
    return out


def run(model: str, data: str, items: list[int], passages: int, ratios: list[float]) -> dict:
    # each engine its own weights copy and store (provenance differs by dtype)
    engines = {dt: Engine.load(model, dtype=dt, store=MemoryStore(), quality_gate=False)
               for dt in ("float32", "bfloat16")}
    methods = _methods(ratios)
    records = load_items(data, None, passages)
    rows = []
    for n, i in enumerate(items):
        it = records[i]
        prompts = {dt: e.build_prompt(it.question, it.document_texts()) for dt, e in engines.items()}
        for dt, pol in methods.values():
            engines[dt].precompute(prompts[dt], pol)
            engines[dt].generate(prompts[dt], pol, max_new_tokens=1)  # warm-up
        got = {}
        for name, (dt, pol) in methods.items():
            got[name] = engines[dt].generate(prompts[dt], pol, max_new_tokens=1)
        ref = got["fp32 full"]
        rows.append({"index": i, "tokens": len(prompts["float32"]), "methods": {
            name: {"kl": kl_divergence(ref.first_logits, a.first_logits),
                   "top1": top1_agree(ref.first_logits, a.first_logits),
                   "ttft_s": a.ttft_s, "ratio": a.ttft_s / ref.ttft_s} for name, a in got.items()}})
        print(f"[{n + 1}/{len(items)}] item {i}: " + ", ".join(
            f"{k} {v['kl']:.4f}/{v['ratio']:.3f}x" for k, v in rows[-1]["methods"].items()), file=sys.stderr, flush=True)
    return {"rows": rows, "methods": list(methods), "threads": torch.get_num_threads(), "passages": passages}


TUNING_ITEMS = 30  # musique_dev items 0-29 are the tuning split, 30-99 validation


def summarise(res: dict) -> str:
    """Markdown: one table per split present (tuning items < 30, validation from 30)."""
    lines = [f"bf16 vs fp32 on CPU: first-token KL(fp32 full || method), {res['passages']} passages, "
             f"{res['threads']} torch threads; TTFT ratio to fp32 full prefill, median over items.", ""]
    splits = [("tuning", [r for r in res["rows"] if r["index"] < TUNING_ITEMS]),
              ("validation", [r for r in res["rows"] if r["index"] >= TUNING_ITEMS])]
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
    ap.add_argument("--data", default=DEFAULT_DATA)
    ap.add_argument("--items", default="0-9,30-39", help="comma list of ranges A-B (tuning 0-29, validation 30-99)")
    ap.add_argument("--passages", type=int, default=5)
    ap.add_argument("--ratios", default="0.15")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    res = run(args.model, args.data, _items(args.items), args.passages, [float(r) for r in args.ratios.split(",")])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bf16.json").write_text(json.dumps(res, indent=1))
    md = summarise(res)
    (out / "bf16.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
