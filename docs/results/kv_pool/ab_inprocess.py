"""In-process A/B of recycled KV buffers (``blend.kvpool``): every request's cache from the model's pool
(the default) against a fresh allocation per request (the pool's budget set to 0), on the same engines,
prompts and store, interleaved in alternating order.

Cases, each at ~600 / ~3k / ~6k tokens (musique items 0-2, bench_phases' sizes):

- ``all-exact blend``: bench_phases' loaded fixed-overhead case (every document an exact hit loaded from
  the store; the hot-prefix cache keeps nothing);
- ``exact hit``: an exact-policy request whose whole prefix is stored (under its own salt, so the
  blend below does not find it), loaded;
- ``blend@0.15``: the default blend (guard on), canonical chunks loaded and re-positioned;
- ``full``: a full prefill (the denominator of every ratio, which the pool serves too).

Each round takes the three prompts in turn, as a server sees prompts of different lengths: a fresh
allocation then cannot always reuse the memory the last request freed. First logits are compared bit
for bit across arms. Minor page faults per request (getrusage) are
printed beside the times: they are what the pool removes.

    OMP_NUM_THREADS=2 .venv/bin/python docs/results/kv_pool/ab_inprocess.py > docs/results/kv_pool/ab.txt
"""

import resource
import statistics
import sys

import torch

from blend.defaults import DEFAULT_EVAL_DATA, DEFAULT_KV_POOL_BYTES
from blend.engine import Engine
from blend.evals.bench_phases import EXACT_DOCS_BLEND, EXACT_DOCS_STORE, SIZES, size_prompts
from blend.policy import ReusePolicy
from blend.store.memory import MemoryStore

ROUNDS = 6  # the first warms up
EXACT_HIT = ReusePolicy.exact(cache_salt="ab-kv-pool-exact-hit")


def engines() -> tuple[Engine, Engine]:
    """SmolLM2 over one memory store twice (the same runner, so the same pool): ``base`` computes and
    stores, ``loader`` loads; neither keeps hot prefixes, so every request loads its stored rows."""
    base = Engine.load("smollm2-135m", store=MemoryStore(), quality_gate=False)
    loader = base.with_store(base.store)
    loader.segments.hot.budget_bytes = 0
    base.segments.hot.budget_bytes = 0
    return base, loader


def main(sizes: list[str]) -> None:
    base, loader = engines()
    pool = base.runner.kv_pool
    cases = {"all-exact blend": (loader, EXACT_DOCS_BLEND), "exact hit": (loader, EXACT_HIT),
             "blend@0.15": (base, ReusePolicy.blend(0.15)), "full": (base, ReusePolicy.none())}
    print(f"threads {torch.get_num_threads()}", flush=True)
    for size in sizes:
        prompts = size_prompts(base, DEFAULT_EVAL_DATA, range(0, 3), SIZES[size])
        t = {(c, a): [] for c in cases for a in ("fresh", "pooled")}
        faults = {(c, a): [] for c in cases for a in ("fresh", "pooled")}
        for p in prompts:
            base.generate(p, EXACT_DOCS_STORE, max_new_tokens=1)
            base.generate(p, EXACT_HIT, max_new_tokens=1)
            base.generate(p, ReusePolicy.blend(0.15), max_new_tokens=1)
        firsts = {}
        for rep in range(ROUNDS):
            order = ("fresh", "pooled") if rep % 2 == 0 else ("pooled", "fresh")
            for case, (eng, policy) in cases.items():
                if case == "full" and rep % 3:
                    continue  # the slow denominator: every third round
                for arm in order:
                    pool.budget_bytes = DEFAULT_KV_POOL_BYTES if arm == "pooled" else 0
                    for i, p in enumerate(prompts):
                        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                        ans = eng.generate(p, policy, max_new_tokens=1)
                        f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                        firsts.setdefault((case, arm, i), ans.first_logits)
                        if rep:
                            t[(case, arm)].append((i, ans.ttft_s))
                            faults[(case, arm)].append(f1 - f0)
        for key, logits in firsts.items():
            assert torch.equal(logits, firsts[(key[0], "fresh", key[2])]), key
        pool.budget_bytes = DEFAULT_KV_POOL_BYTES
        full = {(a, i): statistics.median(x for j, x in t[("full", a)] if j == i)
                for a in ("fresh", "pooled") for i in range(len(prompts))}
        print(f"{size:>4} tokens ~{len(prompts[0])} (items 0-2, {len(t[('blend@0.15', 'fresh')])} samples per arm; "
              f"full {len(t[('full', 'fresh')])}); ratios: each sample over its prompt's full prefill in the same "
              f"arm, median", flush=True)
        for case in cases:
            a, b = t[(case, "fresh")], t[(case, "pooled")]
            ra = statistics.median(x / full[("fresh", i)] for i, x in a)
            rb = statistics.median(x / full[("pooled", i)] for i, x in b)
            paired = statistics.median(y / x for (_, x), (_, y) in zip(a, b))
            fa, fb = statistics.median(faults[(case, "fresh")]), statistics.median(faults[(case, "pooled")])
            print(f"  {case:>15}: fresh {statistics.median(x for _, x in a) * 1e3:7.1f} ms ({ra:.4f}x, {fa:.0f} faults), "
                  f"pooled {statistics.median(x for _, x in b) * 1e3:7.1f} ms ({rb:.4f}x, {fb:.0f} faults), "
                  f"paired pooled/fresh {paired:.3f}; first logits identical", flush=True)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["600", "3k", "6k"]))
