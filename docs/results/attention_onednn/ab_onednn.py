# In-process A/B: the blend's blocked attention on oneDNN's GEMMs (new, KVBLEND_ATTENTION_GEMM=auto on an
# AMD CPU) against torch's CPU flash op (old, =flash). The variable is read when a plan is made (once per
# active row set), so each request runs wholly in its mode. Alternating order, two threads by default;
# run from the repository root:
#   PYTHONPATH=. python docs/results/attention_onednn/ab_onednn.py 600,3k,6k [THREADS=2] [ITEMS=0-2] [REPEATS=5] [guard]
import os, sys, torch
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
from blend.kernels.onednn_attention import ENV_VAR, onednn_route_default
from evals.interleaved import ab_over_sizes

assert onednn_route_default(), "the oneDNN route is not this CPU's default: set the A/B's new mode by hand"


def set_mode(mode):
    os.environ[ENV_VAR] = "flash" if mode == "old" else "auto"


ab_over_sizes(set_mode, sys.argv[1], sys.argv[3] if len(sys.argv) > 3 else "0-2",
              int(sys.argv[4]) if len(sys.argv) > 4 else 5, len(sys.argv) > 5 and sys.argv[5] == "guard")
