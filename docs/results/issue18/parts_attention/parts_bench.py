"""The question's attention at one layer: one flash call over the prefix, one per segment, matmul forms.

    OMP_NUM_THREADS=2 .venv/bin/python docs/results/issue18/parts_attention/parts_bench.py
"""
import time, torch
from blend.kernels.suffix_attention import flash
torch.manual_seed(0)
hkv, g, s, d = 3, 3, 25, 64
q = torch.randn(hkv, g * s, d)
bounds = [0, 29, 619, 1220, 1803, 2439, 3045]
K = torch.randn(hkv, 3045, d); V = torch.randn(hkv, 3045, d)
def one():
    return flash(q[None], K[None], V[None], scale=0.125)
def parts():
    outs = [flash(q[None], K[None, :, a:b], V[None, :, a:b], scale=0.125) for a, b in zip(bounds, bounds[1:])]
    lse = torch.stack([l for _, l in outs]); o = torch.stack([o for o, _ in outs])
    m = lse.max(0).values; w = torch.exp(lse - m)
    return (o * w[..., None]).sum(0) / w.sum(0)[..., None]
for f in (one, parts, one, parts):
    for _ in range(20): f()
    t0 = time.perf_counter()
    for _ in range(300): f()
    print(f.__name__, (time.perf_counter() - t0) / 300 * 1e6, "us")
scores = torch.empty(hkv, g * s, 3045)
def mm_parts():
    for a, b in zip(bounds, bounds[1:]):
        torch.matmul(q, K[:, a:b].transpose(1, 2), out=scores[:, :, a:b])
    p = torch.softmax(scores * 0.125, dim=-1)
    out = torch.matmul(p[:, :, 0:29], V[:, 0:29])
    for a, b in zip(bounds[1:], bounds[2:]):
        out.baddbmm_(p[:, :, a:b], V[:, a:b])
    return out
def mm_one():
    sc = torch.matmul(q, K.transpose(1, 2))
    p = torch.softmax(sc * 0.125, dim=-1)
    return torch.matmul(p, V)
for f in (mm_one, mm_parts, one, mm_one, mm_parts):
    for _ in range(20): f()
    t0 = time.perf_counter()
    for _ in range(300): f()
    print(f.__name__, (time.perf_counter() - t0) / 300 * 1e6, "us")
