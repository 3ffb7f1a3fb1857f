# Kernel-level timing of the blend's blocked attention: flash route vs oneDNN route, on the blend's shapes
# (the oneDNN route forced below its 2,048-key threshold too; SmolLM2: 3 KV heads x 3 query heads, D 64; 15% of
# the document rows spread over the prompt plus an 80-row question), and a chunked prefill (a segment of S rows
# after P cached ones: the full prefill's segments, the exact path's question) on either. Alternating, medians;
# from the repository root:
#   PYTHONPATH=. OMP_NUM_THREADS=2 python docs/results/attention_onednn/micro.py
import os, statistics, time
import torch
import blend.kernels.onednn_attention as O
import blend.kernels.query_blocks as Q
import blend.kernels.reference as R
import blend.kernels.suffix_attention as S
from blend.kernels.onednn_attention import ENV_VAR, attention_gemm_policy, suffix_onednn

torch.manual_seed(0)
HKV, G, D = 3, 3, 64
HQ = HKV * G


def timed(fns, rounds=15):
    ts = {n: [] for n in fns}
    for _ in range(rounds):
        for n, f in fns.items():
            t0 = time.perf_counter(); f(); ts[n].append(time.perf_counter() - t0)
    return {n: statistics.median(t) for n, t in ts.items()}


def blend_case(t, nq=80):
    sel = torch.sort(torch.randperm(t - nq)[:int(0.15 * (t - nq))]).values
    q_pos = torch.cat([sel, torch.arange(t - nq, t)])
    args = (torch.randn(HQ, len(q_pos), D), q_pos, torch.randn(HKV, t, D), torch.randn(HKV, t, D), torch.arange(t), 0.125)
    plans = {}
    min_keys, O.ONEDNN_MIN_KEYS = O.ONEDNN_MIN_KEYS, 0  # the oneDNN route below its threshold too
    for mode in ("flash", "onednn"):
        os.environ[ENV_VAR] = mode; attention_gemm_policy.cache_clear()
        plans[mode] = Q.plan_query_blocks(q_pos, args[4], HQ, HKV)
    os.environ[ENV_VAR], O.ONEDNN_MIN_KEYS = "auto", min_keys; attention_gemm_policy.cache_clear()
    ref = R.sparse_query_attention_ref(*args)
    diff = max((Q.sparse_query_attention_blocked(*args, plan=p) - ref).abs().max().item() for p in plans.values())
    ts = timed({m: (lambda p=p: Q.sparse_query_attention_blocked(*args, plan=p)) for m, p in plans.items()})
    gf = sum(4 * HQ * (b.b - b.a) * b.tb * D for b in plans["flash"].blocks) / 1e9  # computed pairs (masked too)
    print(f"blend blocks  T={t:5d} queries={len(q_pos):4d}  flash {ts['flash']*1e3:7.2f} ms  onednn {ts['onednn']*1e3:7.2f} ms"
          f"  ratio {ts['onednn']/ts['flash']:.3f}  ({gf/ts['flash']:.0f} vs {gf/ts['onednn']:.0f} GFLOP/s; max |diff| {diff:.1e})",
          flush=True)


def suffix_case(p, s):
    """A chunked prefill (a segment after p cached rows): the flash op's prefix-and-square program against
    one masked oneDNN GEMM per 64-query block (forced, whatever the thresholds)."""
    t = p + s
    q, k, v = torch.randn(HQ, s, D), torch.randn(HKV, t, D), torch.randn(HKV, t, D)
    os.environ[ENV_VAR] = "flash"; attention_gemm_policy.cache_clear()
    flash = lambda: S.causal_suffix_attention(q, k, v, 0.125)
    onednn = lambda: suffix_onednn(q, k, v, 0.125)
    diff = (flash() - onednn()).abs().max().item()
    ts = timed({"flash": flash, "onednn": onednn}, rounds=11)
    os.environ[ENV_VAR] = "auto"; attention_gemm_policy.cache_clear()
    print(f"chunked prefill  P={p:5d} S={s:4d}  flash {ts['flash']*1e3:7.2f} ms  onednn {ts['onednn']*1e3:7.2f} ms"
          f"  ratio {ts['onednn']/ts['flash']:.3f}  (max |diff| {diff:.1e})", flush=True)


print(f"threads {torch.get_num_threads()}")
for t in (660, 1200, 1600, 2048, 2500, 3051, 4500, 6122):
    blend_case(t)
for p, s in ((0, 660), (600, 600), (1200, 600), (2400, 600), (5400, 600), (2400, 200), (2400, 128), (3000, 80),
             (6000, 80)):
    suffix_case(p, s)
