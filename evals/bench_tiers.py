"""TTFT of blended reuse with chunk KV in memory, on disk and in Redis (issue 6).

One musique prompt (5 passages, ~3.1k tokens) on the real model. Chunk KV is
precomputed once into each tier (not timed); then, interleaved in one
process: full prefill, and blend@RATIO with the KV read from each tier
(disk and Redis without a memory tier in front, so every request really
loads), with overlapped loading on and off, after an untimed request on
every engine and one full prefill. Reported as ratios to the full prefill
of the same repeat (median over repeats); a request that did not blend
(refused, or nothing to re-position) stops the run.

    python -m blend.evals.bench_tiers [--redis redis://127.0.0.1:6379/0] [--repeats 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
from dataclasses import dataclass

import torch

from blend.defaults import DEFAULT_EVAL_DATA, DEFAULT_MODEL, DEFAULT_RATIO
from blend.engine import Engine
from blend.evals.data import load_items
from blend.evals.environment import describe_environment
from blend.evals.paths import check_blended
from blend.policy import ReusePolicy
from blend.store.spec import open_store
from blend import safeio


@dataclass(frozen=True)
class TierRow:
    tier: str
    overlap: bool
    ttft_s: float
    ratio: float  # median over repeats of TTFT / that repeat's full prefill
    lookup_s: float  # time the request spent waiting for the store


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--data", default=DEFAULT_EVAL_DATA)
    ap.add_argument("--passages", type=int, default=5)
    ap.add_argument("--ratio", type=float, default=DEFAULT_RATIO)
    ap.add_argument("--redis", default=None, help="a Redis URL; the Redis tier is skipped without one")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    item = load_items(args.data, limit=1, passages=args.passages)[0]
    docs = [d.prompt_text() for d in item.documents]
    tmp = tempfile.mkdtemp(prefix="kvblend-tiers-")
    specs = {"memory": "memory", "disk": f"disk:{tmp}"}
    if args.redis:
        specs["redis"] = args.redis + ("&" if "?" in args.redis else "?") + "prefix=bench-tiers"
    stores = {name: open_store(spec, with_memory=False) for name, spec in specs.items()}
    engine = Engine.load(args.model, store=stores["memory"], quality_gate=False)
    prompt = engine.build_prompt(item.question, docs)
    policy = ReusePolicy.blend(ratio=args.ratio)
    engines = {}  # (tier, overlap) -> an engine over the same weights
    for name, store in stores.items():
        for overlap in (True, False):
            cfg = dataclasses.replace(engine.config, overlap_loading=overlap)
            engines[name, overlap] = Engine(engine.runner, cfg, store)
        engines[name, True].precompute(prompt, policy)  # once per tier (untimed)
    engine.generate(prompt, ReusePolicy.one_pass(), max_new_tokens=1)  # warm-up: first calls are no sample
    for eng in engines.values():
        eng.generate(prompt, policy, max_new_tokens=1)
    full, samples = [], {(n, o): ([], [], []) for n in stores for o in (True, False)}
    for _ in range(args.repeats):
        full.append(engine.generate(prompt, ReusePolicy.one_pass(), max_new_tokens=1).ttft_s)
        for (name, overlap), (ttfts, lookups, ratios) in samples.items():
            ans = engines[name, overlap].generate(prompt, policy, max_new_tokens=1)
            check_blended(f"blend@{args.ratio:g} from {name}", ans.report)  # a refused one loads nothing
            ttfts.append(ans.ttft_s)
            lookups.append(ans.report.timings.lookup_s)
            ratios.append(ans.ttft_s / full[-1])  # over this repeat's full prefill
    f = statistics.median(full)
    rows = [TierRow(n, o, statistics.median(t), statistics.median(r), statistics.median(lk))
            for (n, o), (t, lk, r) in samples.items()]
    print(f"prompt {len(prompt)} tokens; full prefill TTFT {f:.3f} s (median of {args.repeats})\n")
    print(f"| tier | overlapped loading | blend@{args.ratio} TTFT s | ratio to full | store wait s |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.tier} | {'on' if r.overlap else 'off'} | {r.ttft_s:.3f} | {r.ratio:.3f} | {r.lookup_s:.3f} |")
    if args.json:
        safeio.atomic_write_text(args.json, json.dumps({"full_ttft_s": f, "prompt_tokens": len(prompt),
                       "repeats": args.repeats, "threads": torch.get_num_threads(), "dtype": str(engine.dtype),
                       "environment": describe_environment(engine.device),
                       "rows": [dataclasses.asdict(r) for r in rows]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
