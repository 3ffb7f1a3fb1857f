"""In-process A/B of RoPE without rotate_half's temporaries (after) against the textbook form (before).

Full prefill and blend@0.15 (guard off) of musique prompts at ~3k tokens (5 passages) and ~600
(5 passages cut to 100 words), old and new alternating per request; logits checked bit-identical.

    OMP_NUM_THREADS=2 .venv/bin/python docs/results/rope/ab_inprocess.py [items]
"""
import statistics
import sys

import torch

import blend.batch_decode
import blend.blending
import blend.model
import blend.probe_pass
import blend.rope as R
from blend.engine import Engine
from blend.evals.data import load_items
from blend.policy import ReusePolicy
from blend.store.memory import MemoryStore

MODULES = (blend.model, blend.probe_pass, blend.blending, blend.batch_decode)
NEW_ROPE, NEW_INTO = R.apply_rope, R.apply_rope_into


def old_rope(x, cos, sin):
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + R.rotate_half(x) * sin


def old_into(out, x, cos, sin):
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    torch.mul(x, cos, out=out)
    out.add_(R.rotate_half(x) * sin)


def use(which):
    for m in MODULES:
        m.apply_rope = old_rope if which == "old" else NEW_ROPE
    blend.model.apply_rope_into = old_into if which == "old" else NEW_INTO


n = int(sys.argv[1]) if len(sys.argv) > 1 else 3
eng = Engine.load("smollm2-135m", quality_gate=False)
items = load_items("../shared/data/musique_dev.json", None, 5)[:n]
sizes = {"3k": lambda t: t, "600": lambda t: " ".join(t.split()[:100])}
blend_policy = ReusePolicy.blend(0.15, guard_margin=None)
for size, cut in sizes.items():
    t = {(m, w): [] for m in ("full", "blend") for w in ("old", "new")}
    same = True
    for it in items:
        prompt = eng.build_prompt(it.question, [cut(x) for x in it.document_texts()])
        e = eng.with_store(MemoryStore())
        e.precompute_chunks([cut(x) for x in it.document_texts()])
        for r in range(2):
            got = {}
            for w in (("old", "new") if r % 2 == 0 else ("new", "old")):
                use(w)
                for m, pol in (("full", ReusePolicy.none()), ("blend", blend_policy)):
                    a = e.generate(prompt, pol, max_new_tokens=1)
                    t[(m, w)].append(a.ttft_s)
                    got[(m, w)] = a.first_logits
            same &= all(torch.equal(got[(m, "old")], got[(m, "new")]) for m in ("full", "blend"))
        e.close()
    use("new")
    f_old, f_new = statistics.median(t[("full", "old")]), statistics.median(t[("full", "new")])
    b_old, b_new = statistics.median(t[("blend", "old")]), statistics.median(t[("blend", "new")])
    print(f"{size}: full prefill {f_old * 1e3:.0f} -> {f_new * 1e3:.0f} ms ({f_new / f_old:.3f}); blend@0.15 "
          f"{b_old * 1e3:.0f} -> {b_new * 1e3:.0f} ms ({b_new / b_old:.3f}); blend / full {b_old / f_old:.4f} -> "
          f"{b_new / f_new:.4f}; logits old == new: {same}", flush=True)
