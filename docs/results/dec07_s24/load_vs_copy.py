"""load_many against one bulk copy of the same bytes (BENCHMARKS.md, 2026-12-07 (24)): python load_vs_copy.py 3k|6k"""
import sys, time, torch, statistics
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
from blend.engine import Engine
from blend.store.memory import MemoryStore
from blend.defaults import DEFAULT_EVAL_DATA
from evals.bench_phases import size_prompts, SIZES, EXACT_DOCS_STORE, EXACT_DOCS_BLEND
import blend.model as M
torch.set_num_threads(2)
size = sys.argv[1] if len(sys.argv) > 1 else "3k"
engine = Engine.load("smollm2-135m", dtype="float32", store=MemoryStore(), quality_gate=False)
p = size_prompts(engine, DEFAULT_EVAL_DATA, range(0, 1), SIZES[size])[0]
engine.generate(p, EXACT_DOCS_STORE, max_new_tokens=1)
loader = engine.with_store(engine.store)
loader.segments.hot.budget_bytes = 0
captured = []
orig = M.ModelRunner.load_many
def spy(self, cache, segs):
    captured.append(list(segs)); return orig(self, cache, segs)
M.ModelRunner.load_many = spy
loader.generate(p, EXACT_DOCS_BLEND, max_new_tokens=1)
M.ModelRunner.load_many = orig
segs = max(captured, key=lambda s: sum(e.k.shape[2] for e in s))
print("segments", [tuple(e.k.shape) for e in segs], [e.rotated for e in segs], segs[0].k.dtype, segs[0].k.is_contiguous(), segs[0].k.stride())
runner = engine.runner
cache = runner.new_cache(len(p) + 8)
ts = []
for _ in range(10):
    cache.length = 0
    t = time.perf_counter(); runner.load_many(cache, segs); ts.append(time.perf_counter() - t)
print("load_many ms", statistics.median(ts) * 1e3)
k = torch.cat([torch.cat([e.k, e.v], 0) for e in segs], 2); buf = torch.empty_like(k)
ts = []
for _ in range(10):
    t = time.perf_counter(); buf.copy_(k); ts.append(time.perf_counter() - t)
print("bulk copy ms", statistics.median(ts) * 1e3, k.numel() * 4 / 1e6, "MB")

from dataclasses import replace as _r
allrot = [_r(e, rotated=True) for e in segs]
ts, tr = [], []
for _ in range(15):
    cache.length = 0
    t = time.perf_counter(); runner.load_many(cache, segs); ts.append(time.perf_counter() - t)
    cache.length = 0
    t = time.perf_counter(); runner.load_many(cache, allrot); tr.append(time.perf_counter() - t)
print("as stored", statistics.median(ts)*1e3, "every K copied (no RoPE)", statistics.median(tr)*1e3)
