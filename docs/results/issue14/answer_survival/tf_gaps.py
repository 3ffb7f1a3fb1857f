"""Where along full prefill's answer does the blend's next token differ, and is it a near tie there?

Teacher-forced along full prefill's greedy answer (32 tokens max, one line): at every position, the
unguarded default blend@0.15's top-2 gap (nats) and whether its argmax is full's token; full's own gap
beside it. If the blend's disagreements sat at its own near ties, a guard on every decode step (not only
the first token) could catch them.

    OMP_NUM_THREADS=1 .venv/bin/python -u docs/results/issue14/answer_survival/tf_gaps.py 0-29 OUT.jsonl
"""

from __future__ import annotations

import json
import sys

import torch

from blend.engine import Engine
from blend.evals.data import load_item_range
from blend.policy import ReusePolicy


def gaps(logits: torch.Tensor) -> list[float]:
    """(T, V) logits -> each row's top-2 log-probability gap (nats)."""
    top = torch.log_softmax(logits.double(), dim=-1).topk(2, dim=-1).values  # (T, 2)
    return (top[:, 0] - top[:, 1]).tolist()


lo, hi = map(int, sys.argv[1].split("-"))
engine = Engine.load(model="smollm2-135m", dtype="float32", quality_gate=False)
pol = ReusePolicy.blend(0.15, "probe", guard_margin=None)
full_pol = ReusePolicy.none()
with open(sys.argv[2], "w") as out:
    for i, item in zip(range(lo, hi + 1), load_item_range("../shared/data/musique_dev.json", range(lo, hi + 1), 5)):
        prompt = engine.build_prompt(item.question, item.document_texts())
        engine.precompute(prompt, pol)
        full = engine.generate(prompt, full_pol, max_new_tokens=32, keep_cache=True)
        cont = [int(t) for t in full.token_ids]
        if not cont:
            continue
        full_tf = engine.teacher_forced_logits(prompt, full_pol, cont, answer=full)[: len(cont)]  # (n, V)
        ans = engine.generate(prompt, pol, max_new_tokens=1, keep_cache=True)
        tf = engine.teacher_forced_logits(prompt, pol, cont, answer=ans)[: len(cont)]  # (n, V)
        row = {"index": i, "tokens": cont, "blend_gap": gaps(tf), "full_gap": gaps(full_tf),
               "agree": (tf.argmax(-1) == torch.tensor(cont)).tolist()}
        print(json.dumps({"index": i, "n": len(cont), "disagree_at": [p for p, a in enumerate(row["agree"]) if not a],
                          "gaps_there": [round(row["blend_gap"][p], 3) for p, a in enumerate(row["agree"]) if not a]}),
              flush=True)
        out.write(json.dumps(row) + "\n")
        out.flush()
