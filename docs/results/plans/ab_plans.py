# In-process A/B: what a blend's attention derives from positions alone (query positions, RoPE tables,
# the blocked attention's blocks and masks, the probe's causal mask) made once per active row set (new)
# against once per layer (old: restored by patching BlendRows and ProbeRows to rebuild them at every
# layer, as before). Alternating order, two threads by default; run from the repository root:
#   PYTHONPATH=. python docs/results/plans/ab_plans.py 600,3k,6k [THREADS=2] [ITEMS=0-2] [REPEATS=5] [guard]
import sys, torch
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
from blend import blending as B, probe_pass as P
from blend.kernels import attention_probs
from blend.rope import apply_rope
from evals.interleaved import ab_over_sizes

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


def set_mode(mode):
    B.BlendRows._active_queries = old_active if mode == "old" else NEW_ACTIVE
    P.ProbeRows.attend = old_probe if mode == "old" else NEW_PROBE


ab_over_sizes(set_mode, sys.argv[1], sys.argv[3] if len(sys.argv) > 3 else "0-2",
              int(sys.argv[4]) if len(sys.argv) > 4 else 5, len(sys.argv) > 5 and sys.argv[5] == "guard")
