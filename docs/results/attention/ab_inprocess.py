# In-process A/B of the blend's sparse-query attention: the shared prefix of a query block without a mask
# (new) against one masked call per block (old, restored by patching from the previous commit's
# kernels/reference.py, passed as argv[3]); run from the repository root:
#   PYTHONPATH=. python docs/results/attention/ab_inprocess.py 600,3k,6k 2 OLD_REFERENCE.py [ITEMS=0-2] [REPEATS=5] [guard]
# (with "guard": the default near-tie guard on, and the mean beside the median)
import importlib.util, sys, torch
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
import blend.kernels.dispatch as D
from evals.interleaved import ab_over_sizes
spec = importlib.util.spec_from_file_location("old_reference", sys.argv[3])
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
NEW = D.sparse_query_attention_blocked
def set_mode(mode):  # the old function takes no plan (made per call inside it then)
    D.sparse_query_attention_blocked = (lambda *a, plan=None, **kw: old.sparse_query_attention_blocked(*a, **kw)) \
        if mode == "old" else NEW


def logit_diff(res):
    diff = max((a - b).abs().max().item() for a, b in zip(res.logits["new"], res.logits["old"]))
    return f"KL old {[round(x, 6) for x in res.kl('old')]} max |logit diff| {diff}"


ab_over_sizes(set_mode, sys.argv[1], sys.argv[4] if len(sys.argv) > 4 else "0-2",
              int(sys.argv[5]) if len(sys.argv) > 5 else 5, len(sys.argv) > 6 and sys.argv[6] == "guard", logit_diff)
