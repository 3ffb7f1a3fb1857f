# A second check layer (gradual filtering) on top of the default probe selector: at layer 1 keep R1
# of the rows, at layer L2 narrow to the final 0.15 (ranked by the same probe weights times the V
# deviation at L2, where the kept rows' neighbours are fresher). Guard off: the blend's own numbers.
#   PYTHONPATH=. OMP_NUM_THREADS=2 python docs/results/issue14/second_check/run.py ITEMS OUT.jsonl
import json, sys, time, statistics
from pathlib import Path
import torch
from blend.engine import Engine
from blend.evals.data import load_items
from blend.evals.metrics import kl_divergence, top1_agree
from blend.evals.sweep import reference_logits
from blend.policy import ReusePolicy
from blend.store.memory import MemoryStore

VARIANTS = {
    "default": dict(),
    "c1=0.25,c3=0.15": dict(check_layers=(1, 3), layer_ratios=(0.25, 0.15)),
    "c1=0.3,c5=0.15": dict(check_layers=(1, 5), layer_ratios=(0.3, 0.15)),
    "c1=0.2,c2=0.15": dict(check_layers=(1, 2), layer_ratios=(0.2, 0.15)),
}
lo, hi = (int(x) for x in sys.argv[1].split("-"))
items = load_items("../shared/data/musique_dev.json", hi + 1, 5)[lo:hi + 1]
eng = Engine.load("smollm2-135m", store=MemoryStore(budget_bytes=2 << 30))
out = open(sys.argv[2], "w")
for n, it in enumerate(items):
    idx = lo + n
    prompt = eng.build_prompt(it.question, it.document_texts())
    ref = reference_logits(eng, prompt, Path("out/ref-logits"))
    pol0 = ReusePolicy.blend(0.15, guard_margin=None)
    eng.precompute(prompt, pol0)
    t0 = time.perf_counter(); eng.prefill(prompt, ReusePolicy.none()); full = time.perf_counter() - t0
    row = {"item": idx}
    for name, kw in VARIANTS.items():
        pol = ReusePolicy.blend(0.15, guard_margin=None, **kw)
        t0 = time.perf_counter(); logits, _, rep = eng.prefill(prompt, pol); dt = time.perf_counter() - t0
        row[name] = {"kl": kl_divergence(ref, logits), "top1": top1_agree(ref, logits), "ttft": dt / full}
    out.write(json.dumps(row) + "\n"); out.flush()
    print(idx, " ".join(f"{k}={v['kl']:.4f}/{v['ttft']:.3f}" for k, v in row.items() if k != "item"), file=sys.stderr, flush=True)
