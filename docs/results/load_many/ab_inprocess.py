"""In-process A/B of the exact path's load: per-segment loads (before) vs load_many (after).

Warm exact hits of bench_prefill's ~3.6k-token filler prefix (24 short documents) and of a musique
prompt (5 passages, ~3.1k tokens), with the hot-prefix cache off so that every request loads its
rows from the store; old and new alternate per request. Ratios are against a cold (full) prefill
of the same prompt measured in the same process.

    OMP_NUM_THREADS=2 .venv/bin/python docs/results/load_many/ab_inprocess.py
"""
import statistics
import sys

import torch

from blend.engine import Engine
from blend.evals.bench_prefill import _filler
from blend.evals.data import load_items
from blend.model import ModelRunner
from blend.policy import ReusePolicy
from blend.rope import rotate_half
from blend.store.memory import MemoryStore

REPEATS = int(sys.argv[1]) if len(sys.argv) > 1 else 8


def old_rope_into(out, x, cos, sin):
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    torch.mul(x, cos, out=out)
    out.add_(rotate_half(x) * sin)


def old_load_many(self, cache, segs):
    for seg in segs:  # the code before: one segment at a time, rotate_half's temporaries
        start = cache.length
        s = seg.k.shape[2]
        pos = torch.arange(start, start + s, device=self.device)
        cos, sin = self.rope(pos)
        cache.set_positions(start, pos)
        for i in range(self.dims.num_layers):
            k = seg.k[i].to(device=self.device, dtype=self.dtype)
            v = seg.v[i].to(device=self.device, dtype=self.dtype)
            k_rows, v_rows = cache.rows(i, start, start + s)
            old_rope_into(k_rows, k, cos, sin)
            v_rows.copy_(v)
        cache.advance(s)


new_load_many = ModelRunner.load_many
eng = Engine.load("smollm2-135m", quality_gate=False)
docs = []
while len(eng.build_prompt("q", docs)) < 3500:
    docs.append(_filler(len(docs)))
q = ("Considering every section above, which repairs ran over budget, what changes to the ferry timetable were "
     "announced, and what is still wrong with the library roof? Please answer in one short sentence that names "
     "each of the three items clearly and briefly. If a section does not mention one of them, say which section "
     "would be the right place to look for it next.")
item = load_items("../shared/data/musique_dev.json", None, 5)[30]
prompts = {"filler, 24 docs": eng.build_prompt(q, docs),
           "musique 30, 5 docs": eng.build_prompt(item.question, item.document_texts())}
for name, prompt in prompts.items():
    e = eng.with_store(MemoryStore())
    e.segments.hot.budget_bytes = 0  # no hot prefix: every warm request loads
    cold = e.generate(prompt, ReusePolicy.exact(), max_new_tokens=1)
    times = {"old": [], "new": []}
    logits = {}
    for r in range(REPEATS):
        for which in (("old", "new") if r % 2 == 0 else ("new", "old")):
            ModelRunner.load_many = old_load_many if which == "old" else new_load_many
            a = e.generate(prompt, ReusePolicy.exact(), max_new_tokens=1)
            times[which].append(a.ttft_s)
            logits[which] = a.first_logits
    ModelRunner.load_many = new_load_many
    same = torch.equal(logits["old"], logits["new"]) and torch.equal(logits["new"], cold.first_logits)
    mo, mn = statistics.median(times["old"]), statistics.median(times["new"])
    print(f"{name}: {len(prompt)} tokens, {len(prompt.segments) - 2} documents; cold {cold.ttft_s:.3f} s; "
          f"warm old {mo * 1e3:.1f} ms ({mo / cold.ttft_s:.4f}x), new {mn * 1e3:.1f} ms ({mn / cold.ttft_s:.4f}x), "
          f"new/old {mn / mo:.3f}; logits old == new == cold: {same}", flush=True)
    e.close()
