# Exploration: a cost-aware probe selector. The default ranks a document row by probe weight x V deviation
# and leans to late rows, whose queries attend over most of the keys; dividing the score by
# (keys the row attends / T)^gamma spends the budget on cheaper rows. Same items, same process, interleaved;
# guard off; TTFT over full prefill timed just before. Patches the selector (an experiment, not the engine).
#   PYTHONPATH=. OMP_NUM_THREADS=2 python docs/results/issue14/cost_aware/run.py ITEMS OUT.jsonl
import json, sys, time
from pathlib import Path
import torch
import blend.blending as B
import blend.selectors as S
from blend.engine import Engine
from blend.evals.data import load_items
from blend.evals.metrics import kl_divergence, top1_agree
from blend.evals.sweep import reference_logits
from blend.policy import ReusePolicy
from blend.store.memory import MemoryStore

STATE = {"gamma": 0.0, "cost": None, "pairs": []}
REAL_SELECT, REAL_SCORE = B.Checker.select, S._probe_score


def select(self, check, active, q, k, v, k_all, k_pos, probe=None):
    plan = self.plan
    n_doc = int((active < plan.nb).sum())
    rows = active[:n_doc]
    free = torch.nonzero(~plan.forced[rows]).flatten()
    keys = (plan.pos[rows[free]] + 1).float()  # (M,) keys each row attends (causal)
    STATE["cost"] = keys / float(k_pos.shape[0])
    sel = REAL_SELECT(self, check, active, q, k, v, k_all, k_pos, probe)
    kept = active[sel.keep]
    STATE["pairs"].append(float((plan.pos[kept] + 1).sum()) / (k_pos.shape[0] ** 2 / 2))  # share of causal pairs
    return sel


def score(inp):
    s = REAL_SCORE(inp)
    g = STATE["gamma"]
    return s if not g else s / STATE["cost"].clamp_min(1e-3).pow(g)


B.Checker.select = select
S._probe_score = score
VARIANTS = [("default", 0.15, 0.0), ("g0.5", 0.15, 0.5), ("g1", 0.15, 1.0), ("g1@0.18", 0.18, 1.0)]
lo, hi = (int(x) for x in sys.argv[1].split("-"))
items = load_items("../shared/data/musique_dev.json", hi + 1, 5)[lo:hi + 1]
eng = Engine.load("smollm2-135m", store=MemoryStore(budget_bytes=2 << 30))
out = open(sys.argv[2], "w")
for n, it in enumerate(items):
    prompt = eng.build_prompt(it.question, it.document_texts())
    ref = reference_logits(eng, prompt, Path("out/ref-logits"))
    eng.precompute(prompt, ReusePolicy.blend(0.15, guard_margin=None))
    t0 = time.perf_counter(); eng.prefill(prompt, ReusePolicy.none()); full = time.perf_counter() - t0
    row = {"item": lo + n}
    for name, ratio, g in (VARIANTS if n % 2 == 0 else VARIANTS[::-1]):
        STATE["gamma"], STATE["pairs"] = g, []
        t0 = time.perf_counter(); logits, _, rep = eng.prefill(prompt, ReusePolicy.blend(ratio, guard_margin=None))
        dt = time.perf_counter() - t0
        row[name] = {"kl": kl_divergence(ref, logits), "top1": top1_agree(ref, logits), "ttft": dt / full,
                     "pairs": STATE["pairs"][-1] if STATE["pairs"] else None}
    out.write(json.dumps(row) + "\n"); out.flush()
    print(row["item"], " ".join(f"{k}={v['kl']:.4f}/{v['ttft']:.3f}/{v['pairs']:.3f}" for k, v in row.items() if k != "item"),
          file=sys.stderr, flush=True)
