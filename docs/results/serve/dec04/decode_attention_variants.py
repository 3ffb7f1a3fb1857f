import torch, time, statistics
import torch.nn.functional as F
torch.set_num_threads(1)
T, Hq, Hkv, D, B, L = 780, 9, 3, 64, 16, 30
cap = 900
K = [torch.randn(L, Hkv, cap, D) for _ in range(B)]
V = [torch.randn(L, Hkv, cap, D) for _ in range(B)]
q = torch.randn(B, Hq, 1, D)
mask = torch.zeros(1, T)
scale = D ** -0.5
def a():
    for l in range(L):
        for i in range(B):
            F.scaled_dot_product_attention(q[i][None], K[i][l, :, :T][None], V[i][l, :, :T][None], attn_mask=mask, scale=scale, enable_gqa=True)
def b():
    for l in range(L):
        for i in range(B):
            qg = q[i].reshape(Hkv, Hq // Hkv, D)[None]  # (1, Hkv, G, D)
            F.scaled_dot_product_attention(qg, K[i][l, :, :T][None], V[i][l, :, :T][None], scale=scale)
def b2():
    for l in range(L):
        for i in range(B):
            qg = q[i].reshape(Hkv, Hq // Hkv, D)[None]  # (1, Hkv, G, D)
            F.scaled_dot_product_attention(qg, K[i][l, :, :T][None], V[i][l, :, :T][None], attn_mask=mask, scale=scale)
def c():
    for l in range(L):
        for i in range(B):
            qg = q[i].reshape(Hkv, Hq // Hkv, D)
            s = torch.bmm(qg, K[i][l, :, :T].transpose(1, 2)) * scale
            p = torch.softmax(s, -1)
            torch.bmm(p, V[i][l, :, :T])
def d():
    for l in range(L):
        for i in range(B):
            F.scaled_dot_product_attention(q[i][None], K[i][l, :, :T][None], V[i][l, :, :T][None], scale=scale, enable_gqa=True)
fs = dict(a=a, b=b, b2=b2, c=c, d=d)
res = {k: [] for k in fs}
for r in range(5):
    for k, f in fs.items():
        t0 = time.perf_counter(); f(); res[k].append(time.perf_counter() - t0)
for k, v in res.items(): print(k, "%.1f ms" % (statistics.median(v) * 1000))
# numerics
i, l = 0, 0
ra = F.scaled_dot_product_attention(q[i][None], K[i][l, :, :T][None], V[i][l, :, :T][None], attn_mask=mask, scale=scale, enable_gqa=True)[0]
rb = F.scaled_dot_product_attention(q[i].reshape(Hkv, 3, D)[None], K[i][l, :, :T][None], V[i][l, :, :T][None], scale=scale)[0].reshape(Hq, 1, D)
print("max diff", (ra - rb).abs().max().item(), torch.equal(ra, rb))
