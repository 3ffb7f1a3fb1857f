"""Per item: full logits, blend@0.15 (guard off) logits, the probe's (ratio-0 blend) logits; blend@0.3 logits.

Does how far the blend moved the first-token decision from the probe's (a ratio-0 blend) predict how far it still is
from full prefill's? (A per-prompt guard trigger for issue 14.) Run:
    OMP_NUM_THREADS=2 python docs/results/issue14/guard_trigger/guard_study.py 0-29 tune.jsonl
    python docs/results/issue14/guard_trigger/analyze.py tune.jsonl > analysis.txt
"""
import sys, json, torch
import blend.probe_pass as pp, blend.blending as bl
from blend.engine import Engine
from blend.defaults import DEFAULT_EVAL_DATA, DEFAULT_MODEL
from blend.store.memory import MemoryStore
from blend.evals.data import load_item_range
from blend.evals.methods import parse_methods
from blend.evals.metrics import kl_divergence
captured = {}
_orig_entropy = pp.entropy
def _ent(logits):
    captured["probe"] = logits.detach().clone()
    return _orig_entropy(logits)
pp.entropy = _ent
_orig_rpf = bl.run_probe_first
def _rpf(*a, **k):
    k["want_entropy"] = True
    return _orig_rpf(*a, **k)
bl.run_probe_first = _rpf
eng = Engine.load(DEFAULT_MODEL, dtype="float32", store=MemoryStore(), quality_gate=False)
ms = {m.name: m.policy() for m in parse_methods("full,blend@0.15:guard=off,blend@0.3:guard=off")}
first, last = map(int, sys.argv[1].split("-")); items = range(first, last + 1)
out = open(sys.argv[2], "w")  # closed at exit
for it_i, it in zip(items, load_item_range(DEFAULT_EVAL_DATA, items, 5)):
    p = eng.build_prompt(it.question, it.document_texts())
    row = {"item": it_i}
    logits = {}
    for name, pol in ms.items():
        eng.precompute(p, pol)
        captured.clear()
        a = eng.generate(p, pol, max_new_tokens=1)
        logits[name] = a.first_logits.double()
        if "probe" in captured and name.startswith("blend@0.15"):
            logits["probe"] = captured["probe"].double()
    f = logits["full"]
    b1, b2 = torch.topk(logits["blend@0.15:guard=off"], 2).indices.tolist()  # the blend's top-2 tokens
    for name, l in logits.items():
        top = torch.topk(l, 2)
        row[name] = {"top": top.indices.tolist(), "gap": float(top.values[0] - top.values[1]),
                     "kl": kl_divergence(f.float(), l.float()) if name != "full" else 0.0,
                     "d15": float(l[b1] - l[b2])}  # the blend's top-2 tokens' logit difference under this method
    out.write(json.dumps(row) + "\n"); out.flush()
    print(it_i, {k: (round(v["gap"], 3), round(v["kl"], 4)) for k, v in row.items() if k != "item"}, flush=True)
