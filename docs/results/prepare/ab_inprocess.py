# In-process A/B of BlendPlan.prepare (grouped re-positioning) against the per-layer behaviour it replaced,
# restored by patching; run from the repository root: PYTHONPATH=. python docs/results/prepare/ab_inprocess.py 600,3k
import sys, time, statistics, torch, json
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv)>2 else 2)
from blend.engine import Engine
from blend.policy import ReusePolicy
import blend.blending as B
from blend.kernels import rope_mix
from evals.bench_phases import SIZES, size_prompts
eng=Engine.load("smollm2-135m")
NEW=(B.PREPARE_GROUP_BYTES, B.rope_rows, B.BlendPlan._tables)
def checked(k,v,cos,sin,out=None):
    none=torch.empty(0,dtype=torch.long)
    return rope_mix(k,v,cos,sin,none,k[:, :0],v[:, :0],trusted_indices=True,out=out)
def nomemo(self, rows): return self.cos[rows], self.sin[rows], self.e+rows
def mode(old):
    B.PREPARE_GROUP_BYTES = 0 if old else NEW[0]
    B.rope_rows = checked if old else NEW[1]
    B.BlendPlan._tables = nomemo if old else NEW[2]
out={}
for size in sys.argv[1].split(','):
    prompts=size_prompts(eng, "../shared/data/musique_dev.json", range(0,3), SIZES[size])
    pol=ReusePolicy.blend(0.15); reuse=ReusePolicy.blend(0.0, guard_margin=None)
    for p in prompts:
        for o in (1,0): mode(o); eng.generate(p,pol,max_new_tokens=1)
        eng.generate(p,ReusePolicy.none(),max_new_tokens=1)
    r={k:[] for k in ('blend_old','blend_new','reuse_old','reuse_new')}
    for rep in range(5):
        for p in prompts:
            f=eng.generate(p,ReusePolicy.none(),max_new_tokens=1).ttft_s
            for o in ((1,0) if rep%2 else (0,1)):
                mode(o); tag='old' if o else 'new'
                r['blend_'+tag].append(eng.generate(p,pol,max_new_tokens=1).ttft_s/f)
                r['reuse_'+tag].append(eng.generate(p,reuse,max_new_tokens=1).ttft_s/f)
    out[size]={k:round(statistics.median(v),4) for k,v in r.items()}
    print(size, out[size], flush=True)
