# Micro-benchmark of block sizes and split thresholds for sparse_query_attention_blocked against the previous
# version (argv[1]: that commit's kernels/reference.py with absolute imports); PYTHONPATH=. python ... OLD.py
import time, torch, statistics, sys, importlib.util
import blend.kernels.query_blocks as Q
spec = importlib.util.spec_from_file_location("old_reference", sys.argv[1])
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
torch.manual_seed(0)
hkv, g, D = 3, 3, 64; hq = hkv * g
def case(T, nq):
    sel = torch.sort(torch.randperm(T - nq)[:int(0.15 * (T - nq))]).values
    q_pos = torch.cat([sel, torch.arange(T - nq, T)])
    return torch.randn(hq, len(q_pos), D), q_pos, torch.randn(hkv, T, D), torch.randn(hkv, T, D), torch.arange(T)
def variant(rows, bmin, bmax, split):
    def f(*a):
        Q.BLOCK_ROWS, Q.BLOCKS_MIN, Q.BLOCKS_MAX, Q.SPLIT_MIN_PREFIX = rows, bmin, bmax, split
        return Q.sparse_query_attention_blocked(*a, 0.125)
    return f
V = {"old": lambda *a: old.sparse_query_attention_blocked(*a, 0.125),
     "split64 4-16 all": variant(64, 4, 16, 1), "split64 4-16 >=512": variant(64, 4, 16, 512),
     "split32 8-32 >=512": variant(32, 8, 32, 512), "split64 4-16 >=1024": variant(64, 4, 16, 1024),
     "split48 6-24 >=512": variant(48, 6, 24, 512)}
for T, nq in ((660, 70), (3051, 100), (6122, 100)):
    a = case(T, nq); ts = {n: [] for n in V}
    for _ in range(9):
        for n, f in V.items():
            t0 = time.perf_counter(); f(*a); ts[n].append(time.perf_counter() - t0)
    base = statistics.median(ts["old"])
    print(T, " | ".join(f"{n} {statistics.median(t)/base:.3f}" for n, t in ts.items()), f"(old {base*1e3:.2f} ms)")
