# Kernel-level timing of the blend's blocked attention: flash route vs oneDNN route, on the blend's shapes
# (the oneDNN route forced below its 2,048-key threshold too; SmolLM2: 3 KV heads x 3 query heads, D 64; 15% of the document rows spread over the prompt plus an
# 80-row question), and for context the full prefill's causal attention (torch's SDPA, flash inside) against
# the same oneDNN GEMM formulation in 64-query blocks. Alternating, medians of 15; from the repository root:
#   PYTHONPATH=. OMP_NUM_THREADS=2 python docs/results/attention_onednn/micro.py
import os, statistics, time
import torch
import torch.nn.functional as F
import blend.kernels.onednn_attention as O
import blend.kernels.reference as R
from blend.kernels.onednn_attention import ENV_VAR, _gemm, _softmax_into

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
        os.environ[ENV_VAR] = mode
        plans[mode] = R.plan_query_blocks(q_pos, args[4], HQ, HKV)
    os.environ[ENV_VAR], O.ONEDNN_MIN_KEYS = "auto", min_keys
    ref = R.sparse_query_attention_ref(*args)
    diff = max((R.sparse_query_attention_blocked(*args, plan=p) - ref).abs().max().item() for p in plans.values())
    ts = timed({m: (lambda p=p: R.sparse_query_attention_blocked(*args, plan=p)) for m, p in plans.items()})
    gf = sum(4 * HQ * (b.b - b.a) * b.tb * D for b in plans["flash"].blocks) / 1e9  # computed pairs (masked too)
    print(f"blend blocks  T={t:5d} queries={len(q_pos):4d}  flash {ts['flash']*1e3:7.2f} ms  onednn {ts['onednn']*1e3:7.2f} ms"
          f"  ratio {ts['onednn']/ts['flash']:.3f}  ({gf/ts['flash']:.0f} vs {gf/ts['onednn']:.0f} GFLOP/s; max |diff| {diff:.1e})",
          flush=True)


def causal_onednn(q, k, v, scale, rows=64):
    t = q.shape[1]
    out = torch.empty_like(q)
    qs = (q * scale).view(HKV, G, t, D)
    mask = torch.full((rows, rows), float("-inf")).triu_(1).repeat(G, 1)  # (G rows, rows)
    for a in range(0, t, rows):
        b = min(t, a + rows)
        for h in range(HKV):
            s = _gemm(qs[h, :, a:b].reshape(G * (b - a), D), k[h, :b])  # (G Sb, b)
            s[:, a:b] += mask[:G * (b - a), :b - a] if b - a == rows else \
                torch.full((b - a, b - a), float("-inf")).triu_(1).repeat(G, 1)
            p = _softmax_into(s, -1, False, out=s)
            out.view(HKV, G, t, D)[h, :, a:b] = _gemm(p, v[h, :b].t().contiguous()).view(G, b - a, D)
    return out


def prefill_case(t):
    q, k, v = torch.randn(HQ, t, D), torch.randn(HKV, t, D), torch.randn(HKV, t, D)
    sdpa = lambda: F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=0.125, enable_gqa=True)
    diff = (causal_onednn(q, k, v, 0.125) - sdpa()[0]).abs().max().item()
    ts = timed({"flash": sdpa, "onednn": lambda: causal_onednn(q, k, v, 0.125)}, rounds=7)
    print(f"full prefill  T={t:5d}  causal SDPA {ts['flash']*1e3:7.2f} ms  oneDNN 64-query blocks {ts['onednn']*1e3:7.2f} ms"
          f"  ratio {ts['onednn']/ts['flash']:.3f}  (max |diff| {diff:.1e})", flush=True)


print(f"threads {torch.get_num_threads()}")
for t in (660, 1200, 1600, 2048, 2500, 3051, 4500, 6122):
    blend_case(t)
for t in (660, 3051, 6122):
    prefill_case(t)
