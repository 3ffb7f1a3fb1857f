"""Fill the research cache: full-prefill reference logits and canonical chunk KV per item.

    python -m blend.evals.research_prep --cache /tmp/kvb14 --data FILE --items 0-99 --passages 5

Runs ahead of :mod:`blend.evals.research_selectors` (which reads the same cache).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from blend.evals.data import load_items
from blend.evals.research_lab import KVDiskCache
from blend.evals.items import parse_item_range


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--cache", type=Path, required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--items", default="0-29")
    p.add_argument("--passages", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    from blend.engine import Engine

    lo, hi = parse_item_range(a.items)
    items = load_items(a.data, hi + 1, a.passages)[lo:]
    engine = Engine.load("smollm2-135m", quality_gate=False)
    cache = KVDiskCache(a.cache)
    for i, item in enumerate(items, start=lo):
        t0 = time.perf_counter()
        prompt = engine.build_prompt(item.question, item.document_texts())
        cache.reference(engine, prompt)
        for j in range(len(prompt.documents)):
            cache.chunk(engine, prompt, j)
        print(f"item {i}: {len(prompt)} tokens, {time.perf_counter() - t0:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
