"""Does selecting spans around the rows the question reads keep the blend's answer on full prefill's facts?

The answer-survival run showed the default blend's answers keep full prefill's opening (a restatement of
the question) and part ways at the fact, which is read from document rows. The question's attention (the
probe) finds where the question's own words sit in a document; the fact is often a few tokens away from
them. This lab dilates the probe's per-row weight (``blend.probe.dilate``: a row's weight becomes the max
over its neighbours within W rows of the same document) before candidate pre-selection and scoring, so the
15% budget goes to spans around the question's reads.

Per musique item (5 passages): full prefill's greedy answer (32 tokens max, one line) and its logits along
that answer (teacher-forced), then for each window W: the blend's first-token KL, teacher-forced KL and
agreement along full's answer, and how many leading answer tokens it shares with full's. Near-tie guard
off (the guard is the same for every W; this isolates the selection).

    OMP_NUM_THREADS=2 .venv/bin/python -u docs/results/issue14/answer_survival/span_lab.py 0-29 0,4,12 OUT.jsonl
"""

from __future__ import annotations

import json
import sys

import torch

import blend.blending as bl
from blend.engine import Engine
from blend.evals import metrics as M
from blend.evals.data import load_item_range
from blend.policy import ReusePolicy
from blend.probe import dilate
from blend.probe_pass import ProbeResult

WINDOW = 0


class SpanProbe(ProbeResult):
    """The probe's result whose per-row weight is dilated over ``WINDOW`` rows of the same document."""

    doc: torch.Tensor | None = None

    @property
    def weight(self) -> torch.Tensor:
        w = self.attn.mean(dim=0)  # (nb,)
        return w if WINDOW == 0 else dilate(w, self.doc, WINDOW)


def _spans(run):
    def wrapped(model, plan, *a, **k):
        res = run(model, plan, *a, **k)
        out = SpanProbe(res.attn, res.entropy)
        object.__setattr__(out, "doc", plan.doc[: plan.nb])  # (nb,) document of each blended row
        return out
    return wrapped


bl.run_probe_first, bl.run_probe = _spans(bl.run_probe_first), _spans(bl.run_probe)
lo, hi = map(int, sys.argv[1].split("-"))
windows = [int(x) for x in sys.argv[2].split(",")]
engine = Engine.load(model="smollm2-135m", dtype="float32", quality_gate=False)
pol = ReusePolicy.blend(0.15, "probe", guard_margin=None)
full_pol = ReusePolicy.none()
with open(sys.argv[3], "w") as out:
    for i, item in zip(range(lo, hi + 1), load_item_range("../shared/data/musique_dev.json", range(lo, hi + 1), 5)):
        prompt = engine.build_prompt(item.question, item.document_texts())
        engine.precompute(prompt, pol)
        full = engine.generate(prompt, full_pol, max_new_tokens=32, keep_cache=True)
        cont = [int(t) for t in full.token_ids]
        full_tf = engine.teacher_forced_logits(prompt, full_pol, cont, answer=full) if cont else None
        row = {"index": i, "answer_tokens": len(cont)}
        for w in windows:
            WINDOW = w
            ans = engine.generate(prompt, pol, max_new_tokens=32, keep_cache=True)
            got = [int(t) for t in ans.token_ids]
            r = {"kl": M.kl_divergence(full.first_logits, ans.first_logits),
                 "top1": M.top1_agree(full.first_logits, ans.first_logits),
                 "same_tokens": M.common_prefix(cont, got), "answer_tokens": len(got)}
            if cont:
                tf = engine.teacher_forced_logits(prompt, pol, cont, answer=ans)
                r["tf_agreement"] = M.teacher_forced_agreement(tf, cont)
                r["tf_kl"] = M.mean_kl_rows(full_tf, tf, len(cont))
            row[f"w{w}"] = r
        print(json.dumps({k: (v if not isinstance(v, dict) else {a: round(b, 4) for a, b in v.items()})
                          for k, v in row.items()}), flush=True)
        out.write(json.dumps(row) + "\n")
        out.flush()
