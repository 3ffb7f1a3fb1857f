# In-process A/B: what a blend's attention derives from positions alone (query positions, RoPE tables,
# the blocked attention's blocks and masks, the probe's causal mask) made once per active row set (new)
# against once per layer (old: restored by patching BlendRows and ProbeRows to rebuild them at every
# layer, as before). Alternating order, two threads by default; run from the repository root:
#   PYTHONPATH=. python docs/results/plans/ab_plans.py 600,3k,6k [THREADS=2] [ITEMS=0-2] [REPEATS=5] [guard]
import statistics, sys, torch
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
from blend import blending as B, probe_pass as P
from blend.engine import Engine
from blend.kernels import attention_probs, sparse_query_attention
from blend.policy import ReusePolicy
from blend.rope import apply_rope
from evals.bench_phases import SIZES, _prompts
from evals.metrics import kl_divergence as first_token_kl

NEW_ACTIVE, NEW_PROBE = B.BlendRows._active_queries, P.ProbeRows.attend


def old_active(self, active):  # per layer: gathers, and the blocked attention plans every call itself
    plan = self.plan
    return B._ActiveQueries(active, plan.pos[active], plan.cos[active], plan.sin[active], None)


def old_probe(self, layer, q):  # per layer: gathers and the causal mask
    plan, rows = self.plan, self.q_rows
    k_all, v_all = self.cache.view(layer, plan.e + plan.n)
    q_rot = apply_rope(q, plan.cos[rows], plan.sin[rows])
    out, probs = attention_probs(q_rot, plan.pos[rows], k_all, v_all, self.k_pos, self.scale)
    self.mass.append(probs.mean(dim=(0, 1))[plan.e:plan.e + plan.nb])
    return out.transpose(0, 1).reshape(q.shape[1], -1)


def mode(use_old):
    B.BlendRows._active_queries = old_active if use_old else NEW_ACTIVE
    P.ProbeRows.attend = old_probe if use_old else NEW_PROBE


eng = Engine.load("smollm2-135m")
lo, hi = (int(x) for x in (sys.argv[3] if len(sys.argv) > 3 else "0-2").split("-"))
reps = int(sys.argv[4]) if len(sys.argv) > 4 else 5
guard = len(sys.argv) > 5 and sys.argv[5] == "guard"
pol = ReusePolicy.blend(0.15) if guard else ReusePolicy.blend(0.15, guard_margin=None)
for size in sys.argv[1].split(','):
    prompts = _prompts(eng, "../shared/data/musique_dev.json", range(lo, hi + 1), SIZES[size])
    same = True
    kl = []
    for p in prompts:  # warm: chunks stored, both paths run once; their logits must be bit-identical
        ref = eng.generate(p, ReusePolicy.none(), max_new_tokens=1).first_logits
        got = {}
        for o in (1, 0):
            mode(o); got[o] = eng.generate(p, pol, max_new_tokens=1).first_logits
        same &= torch.equal(got[0], got[1])
        kl.append(first_token_kl(ref, got[0]))
    r = {'old': [], 'new': []}
    for rep in range(reps):
        for p in prompts:
            f = eng.generate(p, ReusePolicy.none(), max_new_tokens=1).ttft_s
            for o in ((1, 0) if rep % 2 else (0, 1)):
                mode(o); r['old' if o else 'new'].append(eng.generate(p, pol, max_new_tokens=1).ttft_s / f)
    print(size, f"items {lo}-{hi} x {reps}", "guard" if guard else "no guard",
          {k: (round(statistics.median(v), 4), round(statistics.mean(v), 4)) for k, v in r.items()}, "(median, mean)",
          "paired new/old median", round(statistics.median(n / o for n, o in zip(r['new'], r['old'])), 4),
          "logits bit-identical:", same, "KL", [round(x, 6) for x in kl], flush=True)
