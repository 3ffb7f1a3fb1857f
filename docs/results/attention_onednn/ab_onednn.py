# In-process A/B: attention on oneDNN's GEMMs (new: KVBLEND_ATTENTION_GEMM=auto on an AMD CPU: the blend's
# query blocks from 2,048 keys and every chunked prefill from 1,024 keys and 128 queries, the full prefill's
# segments included) against torch's CPU flash op everywhere (old: =flash). Each mode's blend TTFT is divided
# by a full prefill timed in the same mode just before it (the change makes the full prefill faster too).
# The policy is a per-process setting (it is in the engine's provenance); switching it under one loaded
# engine is for this benchmark only (its stored chunks are computed under 1,024 keys: the same bits either
# way). Alternating order, two threads by default; run from the repository root:
#   PYTHONPATH=. python docs/results/attention_onednn/ab_onednn.py 600,3k,6k [THREADS=2] [ITEMS=0-2] [REPEATS=5] [guard]
import os, sys, torch
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
from blend.kernels.onednn_attention import ENV_VAR, attention_gemm_policy, onednn_route_default
from evals.interleaved import ab_over_sizes

assert onednn_route_default(), "the oneDNN route is not this CPU's default: set the A/B's new mode by hand"


def set_mode(mode):
    os.environ[ENV_VAR] = "flash" if mode == "old" else "auto"
    attention_gemm_policy.cache_clear()


ab_over_sizes(set_mode, sys.argv[1], sys.argv[3] if len(sys.argv) > 3 else "0-2",
              int(sys.argv[4]) if len(sys.argv) > 4 else 5, len(sys.argv) > 5 and sys.argv[5] == "guard",
              full_per_mode=True)
