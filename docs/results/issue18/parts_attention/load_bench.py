"""The stored segments' load at ~3k (musique item 0, 5 passages): load_many against plain copies.

    OMP_NUM_THREADS=2 .venv/bin/python docs/results/issue18/parts_attention/load_bench.py
"""
import time, statistics, torch
from blend.evals.bench_phases import SIZES, size_prompts, EXACT_DOCS_STORE, EXACT_DOCS_BLEND
from blend.engine import Engine
import blend.model as M
engine = Engine.load(model="smollm2-135m", dtype="float32", quality_gate=False)
p = size_prompts(engine, "../shared/data/musique_dev.json", range(0, 1), SIZES["3k"])[0]
engine.generate(p, EXACT_DOCS_STORE, max_new_tokens=1)
loader = engine.with_store(engine.store); loader.segments.hot.budget_bytes = 0
got = []
orig = M.ModelRunner.load_many
def lm(self, cache, segs):
    got.append(list(segs)); return orig(self, cache, segs)
M.ModelRunner.load_many = lm
loader.generate(p, EXACT_DOCS_BLEND, max_new_tokens=1)
M.ModelRunner.load_many = orig
segs = got[1]
pre = got[0]
r = engine.runner
n = sum(int(e.k.shape[2]) for e in pre + segs)
ts = []
for i in range(30):
    c = r.new_cache(n + 64)
    r.load_many(c, pre)
    t0 = time.perf_counter(); r.load_many(c, segs); ts.append(time.perf_counter() - t0)
    del c
print(f"load_many of {[int(e.k.shape[2]) for e in segs]}: median {statistics.median(ts)*1e3:.2f} ms")
# lower bound: one strided copy per entry into a (2, L, Hkv, N, D) block
L, H, D = segs[0].k.shape[0], segs[0].k.shape[1], segs[0].k.shape[3]
blk = torch.empty(2, L, H, n + 64, D)
ts = []
for i in range(30):
    t0 = time.perf_counter()
    a = int(pre[0].k.shape[2])
    for e in segs:
        b = a + int(e.k.shape[2])
        blk[0, :, :, a:b].copy_(e.k); blk[1, :, :, a:b].copy_(e.v); a = b
    ts.append(time.perf_counter() - t0)
print(f"per-entry strided copies (no rotation): median {statistics.median(ts)*1e3:.2f} ms")
# per-layer cats (no rotation): the per-layer structure without the rotation
c = r.new_cache(n + 64)
r.load_many(c, pre)
a0 = int(pre[0].k.shape[2])
ts = []
for i in range(30):
    t0 = time.perf_counter()
    for l in range(L):
        kr, vr = c.rows(l, a0, n)
        torch.cat([e.k[l] for e in segs], dim=1, out=kr)
        torch.cat([e.v[l] for e in segs], dim=1, out=vr)
    ts.append(time.perf_counter() - t0)
print(f"per-layer cats, no rotation: median {statistics.median(ts)*1e3:.2f} ms")
# same cache reused: current load_many into a reused cache
ts = []
for i in range(30):
    c.length = a0
    t0 = time.perf_counter(); r.load_many(c, segs); ts.append(time.perf_counter() - t0)
print(f"load_many into the same cache again: median {statistics.median(ts)*1e3:.2f} ms")
