"""In-process A/B of the EXACT entries' form: K before RoPE (rotated on every load, as before 2026-12-06)
against K after RoPE (copied), on two loaded requests of the same prompts:

- ``all-exact blend``: bench_phases' fixed-overhead case (every document an exact hit, loaded; the
  question's own compute is in both arms);
- ``exact hit``: an exact-policy request whose whole prefix (preamble + documents) is stored.

The old form is restored by patching ``Namespace.k_after_rope`` to False; each arm has its own store,
filled under its own form. The hot-prefix cache keeps nothing, so every request loads from the store.
Interleaved, alternating order, paired medians; first logits compared bit for bit across arms, and a
full prefill of each prompt times the ratios.

    OMP_NUM_THREADS=2 .venv/bin/python docs/results/exact_rotated/ab_inprocess.py > docs/results/exact_rotated/ab.txt
"""

import statistics
import sys

import torch

from blend.defaults import DEFAULT_EVAL_DATA
from blend.engine import Engine
from blend.evals.bench_phases import EXACT_DOCS_BLEND, EXACT_DOCS_STORE, SIZES, size_prompts
from blend.keys import Namespace
from blend.policy import ReusePolicy
from blend.report import ReuseClass
from blend.store.memory import MemoryStore

NEW = Namespace.k_after_rope
OLD = property(lambda self: False)
ROUNDS = 6  # the first warms up


def main() -> None:
    base = Engine.load("smollm2-135m", store=MemoryStore(), quality_gate=False)
    arms = {name: base.with_store(MemoryStore()) for name in ("old", "new")}
    for eng in arms.values():
        eng.segments.hot.budget_bytes = 0  # never hot: every request loads its stored rows
    print(f"threads {torch.get_num_threads()}", flush=True)
    cases = {"all-exact blend": (EXACT_DOCS_STORE, EXACT_DOCS_BLEND), "exact hit": (ReusePolicy.exact(),) * 2}
    for size in ("600", "3k", "6k"):
        prompts = size_prompts(base, DEFAULT_EVAL_DATA, range(0, 3), SIZES[size])
        t = {(c, a): [] for c in cases for a in arms}
        full = []
        for p in prompts:
            for name, eng in arms.items():
                Namespace.k_after_rope = OLD if name == "old" else NEW
                for store_policy, _ in cases.values():
                    eng.generate(p, store_policy, max_new_tokens=1)
            firsts = {}
            for rep in range(ROUNDS):
                order = ("old", "new") if rep % 2 == 0 else ("new", "old")
                for case, (_, policy) in cases.items():
                    for name in order:
                        Namespace.k_after_rope = OLD if name == "old" else NEW
                        ans = arms[name].generate(p, policy, max_new_tokens=1)
                        if any(s.reuse_class is not ReuseClass.EXACT for s in ans.report.segments[:-1]):
                            raise RuntimeError(f"{case} ({name}) did not load every segment")
                        firsts.setdefault((case, name), ans.first_logits)
                        if rep:
                            t[(case, name)].append(ans.ttft_s)
                if rep:
                    full.append(base.generate(p, ReusePolicy.none(), max_new_tokens=1).ttft_s)
            for case in cases:
                assert torch.equal(firsts[(case, "old")], firsts[(case, "new")]), case
        Namespace.k_after_rope = NEW
        f = statistics.median(full)
        print(f"{size:>4} tokens ~{len(prompts[0])} (items 0-2, {len(full)} rounds each), full prefill {f * 1e3:.0f} ms",
              flush=True)
        for case in cases:
            old, new = t[(case, "old")], t[(case, "new")]
            paired = statistics.median(n / o for n, o in zip(new, old))
            print(f"  {case:>15}: K before RoPE {statistics.median(old) * 1e3:6.1f} ms ({statistics.median(old) / f:.4f}x), "
                  f"after RoPE {statistics.median(new) * 1e3:6.1f} ms ({statistics.median(new) / f:.4f}x), "
                  f"paired after/before {paired:.3f}; first logits identical", flush=True)


if __name__ == "__main__":
    sys.exit(main())
