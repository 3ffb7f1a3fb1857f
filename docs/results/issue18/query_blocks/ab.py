"""In-process A/B of the flash route's query blocks (issue 18): the default blend's TTFT with the blocks
sized by the keys (``default_blocks``, now) against one block per 64 queries, 4 to 16 (before), interleaved
on the same prompts, each over the full prefill timed beside it.

    OMP_NUM_THREADS=2 python docs/results/issue18/query_blocks/ab.py [--items 0-2] [--repeats 3] > ab.txt
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import blend.kernels.query_blocks as blocks
from blend.defaults import DEFAULT_EVAL_DATA, DEFAULT_MODEL
from blend.engine import Engine
from blend.evals.bench_phases import SIZES, size_prompts
from blend.evals.methods import parse_methods
from blend.store.memory import MemoryStore

NEW = blocks.default_blocks


def before(queries: int, keys: int, onednn: bool) -> int:
    """The rule before: one block per 64 queries, 4 to 16, on either route."""
    return min(blocks.BLOCKS_MAX, max(blocks.BLOCKS_MIN, queries // blocks.BLOCK_ROWS))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--items", default="0-2")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sizes", default="600,3k,6k")
    args = ap.parse_args()
    lo, hi = map(int, args.items.split("-"))
    engine = Engine.load(DEFAULT_MODEL, dtype="float32", store=MemoryStore(), quality_gate=False)
    full, blend = parse_methods("full")[0].policy(), parse_methods("blend@0.15")[-1].policy()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, items {args.items}, {args.repeats} repeats")
    for size in args.sizes.split(","):
        ratios = {"before": [], "now": []}
        same_logits = 0
        for p in size_prompts(engine, DEFAULT_EVAL_DATA, range(lo, hi + 1), SIZES[size]):
            engine.precompute(p, blend)
            logits = {}
            for rule, fn in (("before", before), ("now", NEW)):  # warm-up
                blocks.default_blocks = fn
                logits[rule] = engine.generate(p, blend, max_new_tokens=1).first_logits
            same_logits += int(torch.equal(logits["before"], logits["now"]))
            engine.generate(p, full, max_new_tokens=1)
            for r in range(args.repeats):
                t_full = engine.generate(p, full, max_new_tokens=1).ttft_s
                order = (("before", before), ("now", NEW)) if r % 2 == 0 else (("now", NEW), ("before", before))
                for rule, fn in order:
                    blocks.default_blocks = fn
                    ratios[rule].append(engine.generate(p, blend, max_new_tokens=1).ttft_s / t_full)
        blocks.default_blocks = NEW
        b, n = statistics.median(ratios["before"]), statistics.median(ratios["now"])
        paired = statistics.median(x / y for x, y in zip(ratios["now"], ratios["before"]))
        print(f"{size:>4}: blend@0.15 / full prefill: before {b:.4f}x, now {n:.4f}x; paired now/before {paired:.3f} "
              f"({len(ratios['now'])} samples; first-token logits bit-identical on {same_logits} of {hi - lo + 1})")


if __name__ == "__main__":
    main()
