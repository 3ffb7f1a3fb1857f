"""How long a bf16 full prefill's answer stays the fp32 full prefill's: a reference for the blend's.

Per musique item (5 passages): the fp32 engine's full-prefill greedy answer (up to 32 tokens, one
line, as `kvblend eval` answers) and the bf16 engine's, their leading tokens in common, and the
first-token KL between them. A bf16 full prefill is a numeric perturbation people accept (its
first-token KL is ~10x below a blend@0.15's), so its curve is the floor the blend's is read against.

    OMP_NUM_THREADS=2 .venv/bin/python -u docs/results/issue14/answer_survival/bf16_floor.py 30-99 OUT.jsonl [DATA]

DATA: what `kvblend eval --data` takes (default the musique file; e.g. synthetic:two-hop).
"""

from __future__ import annotations

import json
import sys

from blend.engine import Engine
from blend.evals import metrics as M
from blend.evals.data import load_item_range
from blend.policy import ReusePolicy

lo, hi = map(int, sys.argv[1].split("-"))
data = sys.argv[3] if len(sys.argv) > 3 else "../shared/data/musique_dev.json"
fp32 = Engine.load(model="smollm2-135m", dtype="float32", quality_gate=False)
bf16 = Engine.load(model="smollm2-135m", dtype="bfloat16", quality_gate=False)
with open(sys.argv[2], "w") as out:
    for i, item in zip(range(lo, hi + 1), load_item_range(data, range(lo, hi + 1), 5)):
        prompt = fp32.build_prompt(item.question, item.document_texts())
        a = fp32.generate(prompt, ReusePolicy.none(), max_new_tokens=32)
        b = bf16.generate(bf16.build_prompt(item.question, item.document_texts()), ReusePolicy.none(),
                          max_new_tokens=32)
        ref, got = [int(t) for t in a.token_ids], [int(t) for t in b.token_ids]
        row = dict(index=i, full_tokens=ref, bf16_tokens=got, same_tokens=M.common_prefix(ref, got),
                   identical=ref == got, kl=M.kl_divergence(a.first_logits, b.first_logits),
                   top1=M.top1_agree(a.first_logits, b.first_logits))
        print(json.dumps({k: v for k, v in row.items() if not k.endswith("_tokens") or k == "same_tokens"}),
              flush=True)
        out.write(json.dumps(row) + "\n")
        out.flush()
