"""Does the query probe's own first-token gap predict the blend's (the near-tie guard's trigger)?

Per musique item: the probe's first-token distribution (question rows over re-positioned cached KV,
bf16 GEMMs: a ratio-0 blend) top-2 gap, the unguarded blend@0.15's gap, and both first-token KLs
against a full prefill.

    OMP_NUM_THREADS=2 .venv/bin/python -u docs/results/issue14/early_guard/margins.py 0-29 OUT.jsonl
"""

from __future__ import annotations

import json
import sys

import torch

import blend.probe_pass as pp
from blend.engine import Engine
from blend.policy import ReusePolicy
from blend.probe import top2_margin
from blend.evals.data import load_item_range
from blend.evals import metrics as M

seen: list[float] = []
_orig = pp._probe


def _probe(model, rows, h_q, start, skip, gemm_dtype, want_entropy):
    """The probe, always with its LM head; records its first token's top-2 gap."""
    layers = model.layers_in(gemm_dtype or model.dtype)
    h = model.run_layers(h_q, rows, start=start, layers=layers)  # (Nq, C)
    logits = model.logits(h[-1:])[0]
    seen.append(float(top2_margin(logits)))
    return pp.ProbeResult(torch.stack(rows.mass[skip:]), pp.entropy(logits) if want_entropy else None)


pp._probe = _probe
lo, hi = map(int, sys.argv[1].split("-"))
out = open(sys.argv[2], "w")
engine = Engine.load(model="smollm2-135m", dtype="float32", quality_gate=False)
pol = ReusePolicy.blend(0.15, "probe", guard_margin=None)
for it_i, item in zip(range(lo, hi + 1), load_item_range("../shared/data/musique_dev.json", range(lo, hi + 1), 5)):
    prompt = engine.build_prompt(item.question, item.document_texts())
    engine.precompute(prompt, pol)
    full = engine.generate(prompt, ReusePolicy.none(), max_new_tokens=1)
    seen.clear()
    ans = engine.generate(prompt, pol, max_new_tokens=1)
    row = dict(item=it_i, probe_margin=seen[0], blend_margin=float(top2_margin(ans.first_logits)),
               ref_margin=float(top2_margin(full.first_logits)),
               kl=float(M.kl_divergence(full.first_logits, ans.first_logits)),
               top1=float(M.top1_agree(full.first_logits, ans.first_logits)))
    print(json.dumps(row), flush=True)
    out.write(json.dumps(row) + "\n")
    out.flush()
