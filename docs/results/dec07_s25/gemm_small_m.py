import torch, time, torch.nn.functional as F
torch.manual_seed(0)
L=30
shapes=[(960,576),(576,576),(3072,576),(576,1536)]
Ws=[[torch.randn(n,k)*0.02 for (n,k) in shapes] for _ in range(L)]
def bench(M, fn_prep, fn_run, label, reps=5):
    packed=[[fn_prep(w) for w in lw] for lw in Ws]
    xs={k: torch.randn(M,k) for k in (576,1536)}
    for _ in range(2):
        for lw in packed:
            for (n,k),w in zip(shapes,lw): fn_run(xs[k],w)
    ts=[]
    for _ in range(reps):
        t=time.perf_counter()
        for lw in packed:
            for (n,k),w in zip(shapes,lw): fn_run(xs[k],w)
        ts.append(time.perf_counter()-t)
    print(f"M={M:4d} {label:18s} {min(ts)*1e3:7.2f} ms")
ops=torch.ops.mkldnn
for M in (1,23,64,100):
    bench(M, lambda w:w, lambda x,w:F.linear(x,w), "F.linear")
    bench(M, lambda w:ops._reorder_linear_weight(w.contiguous(),32), lambda x,w:ops._linear_pointwise(x,w,None,"none",[],""), "onednn32")
    bench(M, lambda w:ops._reorder_linear_weight(w.contiguous(),M), lambda x,w:ops._linear_pointwise(x,w,None,"none",[],""), "onednnM")
    if hasattr(torch.ops,'mkl') and hasattr(torch.ops.mkl,'_mkl_reorder_linear_weight'):
        bench(M, lambda w:(torch.ops.mkl._mkl_reorder_linear_weight(w,M),w), lambda x,w:torch.ops.mkl._mkl_linear(x,w[0],w[1],None,M), "mkl_packed")
    bench(M, lambda w:w.t().contiguous(), lambda x,w:x@w, "x@wT")
