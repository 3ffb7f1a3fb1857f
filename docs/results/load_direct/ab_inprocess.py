"""In-process A/B of ModelRunner.load_many: the joined-copy version (before 2026-12-06) against K rotated
straight from each stored entry into the cache, on the loaded all-exact-documents request of bench_phases
(its hot-prefix cache keeps nothing, so every request loads its stored rows) and on a stored exact prefix
hit of the whole prompt. Interleaved, alternating order; paired medians.

    OMP_NUM_THREADS=2 .venv/bin/python docs/results/load_direct/ab_inprocess.py > docs/results/load_direct/ab.txt
"""

import statistics
import sys
import time

import torch

from blend import model as model_mod
from blend.engine import Engine
from blend.rope import apply_rope_into
from blend.store.memory import MemoryStore
from blend.defaults import DEFAULT_EVAL_DATA
from blend.evals.bench_phases import EXACT_DOCS_BLEND, EXACT_DOCS_STORE, SIZES, size_prompts

NEW = model_mod.ModelRunner.load_many


def old_load_many(self, cache, segs):
    """load_many as of 1c599f9: every segment's K joined into one scratch copy per layer, then rotated."""
    if not segs:
        return
    start = cache.length
    s = sum(int(e.k.shape[2]) for e in segs)
    pos = torch.arange(start, start + s, device=self.device)
    cos, sin = self.rope(pos)
    cache.set_positions(start, pos)
    scratch = None
    for i in range(self.dims.num_layers):
        k_rows, v_rows = cache.rows(i, start, start + s)
        ks = [e.k[i].to(device=self.device, dtype=self.dtype) for e in segs]
        vs = [e.v[i].to(device=self.device, dtype=self.dtype) for e in segs]
        if len(segs) == 1:
            k = ks[0]
            v_rows.copy_(vs[0])
        else:
            if scratch is None:
                scratch = torch.empty(k_rows.shape, dtype=self.dtype, device=self.device)
            k = torch.cat(ks, dim=1, out=scratch)
            torch.cat(vs, dim=1, out=v_rows)
        apply_rope_into(k_rows, k, cos, sin)
    cache.advance(s)


def main() -> None:
    eng = Engine.load("smollm2-135m", store=MemoryStore(), quality_gate=False)
    loader = eng.with_store(eng.store)
    loader.segments.hot.budget_bytes = 0  # never hot: every request loads its stored rows
    print(f"threads {torch.get_num_threads()}", flush=True)
    for size in ("600", "3k", "6k"):
        prompts = size_prompts(eng, DEFAULT_EVAL_DATA, range(0, 3), SIZES[size])
        t = {"old": [], "new": []}
        firsts = {}
        for p in prompts:
            eng.generate(p, EXACT_DOCS_STORE, max_new_tokens=1)
            for rep in range(6):
                order = ("old", "new") if rep % 2 == 0 else ("new", "old")
                for name in order:
                    model_mod.ModelRunner.load_many = old_load_many if name == "old" else NEW
                    ans = loader.generate(p, EXACT_DOCS_BLEND, max_new_tokens=1)
                    firsts.setdefault((id(p), name), ans.first_logits)
                    if rep:  # the first round warms up
                        t[name].append(ans.ttft_s)
            assert torch.equal(firsts[(id(p), "old")], firsts[(id(p), "new")])
        model_mod.ModelRunner.load_many = NEW
        ratio = statistics.median(n / o for n, o in zip(t["new"], t["old"]))
        print(f"{size:>4} tokens ~{len(prompts[0])}: loaded all-exact request old {statistics.median(t['old']) * 1e3:.1f} ms, "
              f"new {statistics.median(t['new']) * 1e3:.1f} ms, paired new/old {ratio:.3f} "
              f"({len(t['new'])} pairs; first logits identical)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
