"""Cold requests over a disk store: write-behind against write-through (the store's puts).

A cold request computes every segment and stores it. With the default store
(an in-process LRU in front of a disk directory) the disk writes either sit on
the request's path (write-through) or run on the store's background writer
while the request goes on (write-behind, the default), the request waiting for
them only before it finishes. Two engines on the same weights, one store each,
interleaved in one process; before each request its store is cleared, so
every segment misses. Reported: TTFT, and end to end with a short answer (the
write-behind request's end includes its wait for the writes).

    python -m blend.evals.bench_cold [--items 0-2] [--repeats 2] [--passages 5] [--max-new-tokens 16] --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from blend.defaults import DEFAULT_EVAL_DATA, DEFAULT_MODEL
from blend.engine import Engine
from blend.evals.data import load_items
from blend.evals.environment import describe_environment
from blend.evals.splits import item_range_arg, parse_item_range
from blend.generation import generate
from blend.policy import ReusePolicy
from blend.sampling import GenerationConfig
from blend.store.spec import open_store
from blend import safeio

MODES = ("write-through", "write-behind")


@dataclass(frozen=True)
class ColdRow:
    item: int
    repeat: int
    mode: str
    prompt_tokens: int
    ttft_s: float
    e2e_s: float
    stored_bytes: int


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--data", default=DEFAULT_EVAL_DATA)
    ap.add_argument("--items", type=item_range_arg, default="0-2")
    ap.add_argument("--passages", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    lo, hi = parse_item_range(args.items)
    items = load_items(args.data, None, args.passages)[lo:hi + 1]
    config = GenerationConfig(max_tokens=args.max_new_tokens, ignore_eos=True)
    rows: list[ColdRow] = []
    with tempfile.TemporaryDirectory() as tmp:
        stores = {m: open_store(f"disk:{tmp}/{m}", write_behind=m == "write-behind") for m in MODES}
        engines = {m: Engine.load(args.model, store=stores[m], quality_gate=False) for m in MODES}
        for n, it in enumerate(items):
            prompt = engines[MODES[0]].build_prompt(it.question, it.document_texts())
            for m in MODES:  # warm-up: first-call costs out of the timed runs
                generate(engines[m], prompt, ReusePolicy.exact(), config)
            for r in range(args.repeats):
                for m in (MODES if r % 2 == 0 else MODES[::-1]):
                    stores[m].clear()
                    t0 = time.perf_counter()
                    done = generate(engines[m], prompt, ReusePolicy.exact(), config)
                    e2e = time.perf_counter() - t0
                    rows.append(ColdRow(lo + n, r, m, len(prompt), done.ttft_s, e2e, stores[m].stats().bytes))
            print(f"item {lo + n}: " + " ".join(f"{x.mode}={x.ttft_s:.2f}s" for x in rows[-len(MODES):]),
                  flush=True)
        for s in stores.values():
            s.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"Cold requests, {args.data} items {args.items}, {args.passages} passages, {args.repeats} repeats, "
             f"{args.max_new_tokens}-token answers, {torch.get_num_threads()} torch threads, disk store", "",
             "| mode | TTFT median | TTFT vs write-through | end to end median | e2e vs write-through |",
             "|---|---:|---:|---:|---:|"]
    base_t = statistics.median(x.ttft_s for x in rows if x.mode == MODES[0])
    base_e = statistics.median(x.e2e_s for x in rows if x.mode == MODES[0])
    for m in MODES:
        t = statistics.median(x.ttft_s for x in rows if x.mode == m)
        e = statistics.median(x.e2e_s for x in rows if x.mode == m)
        lines.append(f"| {m} | {t:.3f} s | {t / base_t:.3f} | {e:.3f} s | {e / base_e:.3f} |")
    text = "\n".join(lines) + "\n"
    safeio.atomic_write_text(out / "cold.md", text)
    safeio.atomic_write_text(out / "cold.json", json.dumps({"environment": describe_environment(),
                                               "rows": [asdict(x) for x in rows]}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
