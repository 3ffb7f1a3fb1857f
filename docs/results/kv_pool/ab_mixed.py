"""Recycled KV buffers under a mixed stream of requests, as a server sees them: ~600, ~3k and ~6k-token
prompts (musique items 0-2 at bench_phases' sizes) and three request kinds (a blend of all-exact
documents loaded from the store, an exact hit loaded from the store, the default blend@0.15), in a
shuffled order each round. Each request runs twice in a row, once per arm (the pool on, or its budget
at 0 so that every cache is a fresh allocation), in alternating order; the arms share engines, store
and everything else. Paired ratios pooled / fresh per (size, kind), medians over rounds and items, and
the minor page faults of each request (getrusage).

    OMP_NUM_THREADS=2 .venv/bin/python docs/results/kv_pool/ab_mixed.py > docs/results/kv_pool/ab_mixed.txt
"""

import random
import resource
import statistics
import sys

import torch

from ab_inprocess import EXACT_HIT, engines  # this folder: the script's own directory is on sys.path
from blend.defaults import DEFAULT_EVAL_DATA, DEFAULT_KV_POOL_BYTES
from blend.evals.bench_phases import EXACT_DOCS_BLEND, EXACT_DOCS_STORE, SIZES, size_prompts
from blend.policy import ReusePolicy

ROUNDS = 7  # the first warms up


def main() -> None:
    base, loader = engines()
    pool = base.runner.kv_pool
    kinds = {"all-exact blend": (loader, EXACT_DOCS_BLEND), "exact hit": (loader, EXACT_HIT),
             "blend@0.15": (base, ReusePolicy.blend(0.15))}
    prompts = {size: size_prompts(base, DEFAULT_EVAL_DATA, range(0, 3), SIZES[size]) for size in SIZES}
    for ps in prompts.values():
        for p in ps:
            for policy in (EXACT_DOCS_STORE, EXACT_HIT, ReusePolicy.blend(0.15)):
                base.generate(p, policy, max_new_tokens=1)
    jobs = [(size, kind, i) for size in prompts for kind in kinds for i in range(len(prompts[size]))]
    rng = random.Random(0)
    t = {(s, k, a): [] for s in prompts for k in kinds for a in ("fresh", "pooled")}
    faults = {key: [] for key in t}
    print(f"threads {torch.get_num_threads()}; {len(jobs)} requests per arm per round, shuffled", flush=True)
    for rep in range(ROUNDS):
        rng.shuffle(jobs)
        for n, (size, kind, i) in enumerate(jobs):
            eng, policy = kinds[kind]
            firsts = {}
            for arm in (("fresh", "pooled") if (rep + n) % 2 else ("pooled", "fresh")):
                pool.budget_bytes = DEFAULT_KV_POOL_BYTES if arm == "pooled" else 0
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                ans = eng.generate(prompts[size][i], policy, max_new_tokens=1)
                f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                firsts[arm] = ans.first_logits
                if rep:
                    t[(size, kind, arm)].append(ans.ttft_s)
                    faults[(size, kind, arm)].append(f1 - f0)
            assert torch.equal(firsts["fresh"], firsts["pooled"]), (size, kind, i)
        print(f"round {rep + 1}/{ROUNDS} done", file=sys.stderr, flush=True)
    for size in prompts:
        for kind in kinds:
            a, b = t[(size, kind, "fresh")], t[(size, kind, "pooled")]
            paired = statistics.median(y / x for x, y in zip(a, b))
            fa, fb = statistics.median(faults[(size, kind, "fresh")]), statistics.median(faults[(size, kind, "pooled")])
            print(f"{size:>4} {kind:>15}: fresh {statistics.median(a) * 1e3:7.1f} ms ({fa:6.0f} faults), pooled "
                  f"{statistics.median(b) * 1e3:7.1f} ms ({fb:4.0f} faults), paired pooled/fresh {paired:.3f} "
                  f"({len(a)} pairs); first logits identical", flush=True)


if __name__ == "__main__":
    sys.exit(main())
