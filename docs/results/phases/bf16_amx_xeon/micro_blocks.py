import torch, time
from blend.kernels.query_blocks import plan_query_blocks, sparse_query_attention_blocked, _blocks_flash
from blend.kernels.suffix_attention import FLASH_CPU
torch.manual_seed(0)
T=3051; Hq, Hkv, D = 9, 3, 64
k_pos=torch.arange(T)
q_pos=torch.sort(torch.randperm(T-80)[:380]).values
q_pos=torch.cat([q_pos, torch.arange(T-80, T)])
S=q_pos.numel()
plan=plan_query_blocks(q_pos,k_pos,Hq,Hkv)
print("route", plan.route, len(plan.blocks), "S", S)
for dt in (torch.bfloat16,):
    q=torch.randn(Hq,S,D).to(dt); k=torch.randn(Hkv,T,D).to(dt); v=torch.randn(Hkv,T,D).to(dt)
    # fp32 path (current)
    def cur(): return sparse_query_attention_blocked(q,q_pos,k,v,k_pos,0.125,plan=plan)
    def native():
        out=torch.empty(q.shape,dtype=torch.float32)
        _blocks_flash(q,k,v,0.125,plan,out)
        return out.to(dt)
    for f in (cur,native): f()
    ts={'cur':[], 'native':[]}
    for _ in range(10):
        for n,f in (('cur',cur),('native',native)):
            t0=time.perf_counter(); f(); ts[n].append(time.perf_counter()-t0)
    print({n: round(sorted(v)[5]*1e3,2) for n,v in ts.items()})
    a=cur().float(); b=native().float(); print("maxdiff", (a-b).abs().max().item(), "ref scale", a.abs().max().item())
