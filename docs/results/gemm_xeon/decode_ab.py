# 2026-12-05 (8), 2-core Intel Xeon (AMX), two threads. Decode of a ~3k-token prompt's exact hit, 32 tokens, --gemm torch vs auto (oneDNN), interleaved, 4 rounds; run from the repository root:
#   PYTHONPATH=. OMP_NUM_THREADS=2 python docs/results/gemm_xeon/decode_ab.py
import time, statistics, torch
from blend.engine import Engine
from blend.policy import ReusePolicy
from blend.store.memory import MemoryStore
from blend.evals.bench_phases import size_prompts, SIZES
torch.set_num_threads(2)
engs = {g: Engine.load("smollm2-135m", store=MemoryStore(), quality_gate=False, gemm=g) for g in ("torch", "auto")}
p = size_prompts(engs["auto"], "../shared/data/musique_dev.json", range(0,1), SIZES["3k"])[0]
res = {g: [] for g in engs}; pre = {g: [] for g in engs}
for g, e in engs.items():
    e.generate(p, ReusePolicy.exact(), max_new_tokens=4)
for r in range(4):
    for g, e in (list(engs.items()) if r % 2 == 0 else list(engs.items())[::-1]):
        t0 = time.perf_counter()
        a = e.generate(p, ReusePolicy.exact(), max_new_tokens=32, stop_at_newline=False)
        tot = time.perf_counter() - t0
        n = len(a.token_ids)
        res[g].append((tot - a.ttft_s) / max(n - 1, 1)); pre[g].append(a.ttft_s)
for g in engs:
    print(g, engs[g].runner.gemm if hasattr(engs[g].runner,'gemm') else '', 'decode ms/token median', round(statistics.median(res[g])*1e3, 2), 'warm exact TTFT ms', round(statistics.median(pre[g])*1e3,1))
print('ratio auto/torch decode', round(statistics.median(res['auto'])/statistics.median(res['torch']),3))
