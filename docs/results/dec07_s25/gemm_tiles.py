import torch, time, torch.nn.functional as F
torch.manual_seed(0)
L=30
shapes=[(960,576),(576,576),(3072,576),(576,1536)]
Ws=[[torch.randn(n,k)*0.02 for (n,k) in shapes] for _ in range(L)]
ops=torch.ops.mkldnn
one=[[ops._reorder_linear_weight(w.contiguous(),32) for w in lw] for lw in Ws]
mk={}
def mkpack(T):
    if T not in mk: mk[T]=[[torch.ops.mkl._mkl_reorder_linear_weight(w,T) for w in lw] for lw in Ws]
    return mk[T]
def run_one(xs):
    for lw in one:
        for (n,k),w in zip(shapes,lw): ops._linear_pointwise(xs[k],w,None,"none",[],"")
def run_tiles(xs,T,M):
    P=mkpack(T)
    pad=(-M)%T
    xp={k:(torch.cat([x,x.new_zeros(pad,k)]) if pad else x) for k,x in xs.items()}
    for lw,pw in zip(Ws,P):
        for (n,k),w,p in zip(shapes,lw,pw):
            x=xp[k]
            outs=[torch.ops.mkl._mkl_linear(x[i:i+T],p,w,None,T) for i in range(0,M+pad,T)]
            torch.cat(outs) if len(outs)>1 else outs[0]
def t(f,reps=3):
    f(); ts=[]
    for _ in range(reps):
        s=time.perf_counter(); f(); ts.append(time.perf_counter()-s)
    return min(ts)*1e3
for M in (23,64,100,200,470,660):
    xs={k: torch.randn(M,k) for k in (576,1536)}
    row=[f"M={M:4d} onednn {t(lambda: run_one(xs)):7.1f}"]
    for T in (32,64,128,256):
        if T<=4*M and not (T>M and T>64):
            row.append(f"T{T} {t(lambda: run_tiles(xs,T,M)):7.1f}")
    print("  ".join(row), flush=True)
