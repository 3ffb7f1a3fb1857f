# In-process A/B of the blend's sparse-query attention: the shared prefix of a query block without a mask
# (new) against one masked call per block (old, restored by patching from the previous commit's
# kernels/reference.py, passed as argv[3]); run from the repository root:
#   PYTHONPATH=. python docs/results/attention/ab_inprocess.py 600,3k,6k 2 OLD_REFERENCE.py [ITEMS=0-2] [REPEATS=5] [guard]
# (with "guard": the default near-tie guard on, and the mean beside the median)
import importlib.util, sys, statistics, torch
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
from blend.engine import Engine
from blend.policy import ReusePolicy
import blend.kernels.dispatch as D
from evals.bench_phases import SIZES, _prompts
from evals.metrics import kl_divergence as first_token_kl
spec = importlib.util.spec_from_file_location("old_reference", sys.argv[3])
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
NEW = D.sparse_query_attention_blocked
def mode(use_old): D.sparse_query_attention_blocked = old.sparse_query_attention_blocked if use_old else NEW
eng = Engine.load("smollm2-135m")
lo, hi = (int(x) for x in (sys.argv[4] if len(sys.argv) > 4 else "0-2").split("-"))
reps = int(sys.argv[5]) if len(sys.argv) > 5 else 5
guard = len(sys.argv) > 6 and sys.argv[6] == "guard"
pol = ReusePolicy.blend(0.15) if guard else ReusePolicy.blend(0.15, guard_margin=None)
for size in sys.argv[1].split(','):
    prompts = _prompts(eng, "../shared/data/musique_dev.json", range(lo, hi + 1), SIZES[size])
    kl = {}
    for p in prompts:  # warm: chunks stored, both paths run once; the logits' difference
        ref = eng.generate(p, ReusePolicy.none(), max_new_tokens=1).first_logits
        got = {}
        for o in (1, 0):
            mode(o); got[o] = eng.generate(p, pol, max_new_tokens=1).first_logits
        kl.setdefault('old', []).append(first_token_kl(ref, got[1])); kl.setdefault('new', []).append(first_token_kl(ref, got[0]))
        kl.setdefault('maxdiff', []).append((got[0] - got[1]).abs().max().item())
    r = {'old': [], 'new': []}
    for rep in range(reps):
        for p in prompts:
            f = eng.generate(p, ReusePolicy.none(), max_new_tokens=1).ttft_s
            for o in ((1, 0) if rep % 2 else (0, 1)):
                mode(o); r['old' if o else 'new'].append(eng.generate(p, pol, max_new_tokens=1).ttft_s / f)
    print(size, f"items {lo}-{hi} x {reps}", "guard" if guard else "no guard",
          {k: (round(statistics.median(v), 4), round(statistics.mean(v), 4)) for k, v in r.items()}, "(median, mean)",
          'KL old', [round(x, 6) for x in kl['old']], 'new', [round(x, 6) for x in kl['new']],
          'max |logit diff|', max(kl['maxdiff']), flush=True)
