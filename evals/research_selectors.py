"""Selector research: many selection rules per item, one process, cached references.

    python -m blend.evals.research_selectors --cache /tmp/kvb14 --data FILE --items 0-29 \
        --passages 5 --ratios 0.15 --variants combo,v,pm_dv,... --out rows.jsonl

For each item: full-prefill reference logits and canonical chunk KV come from
the cache (:mod:`blend.evals.research_prep`); an :class:`ItemLab` computes the
check-layer state and the query probe once, and every variant's selection is
replayed from the check layer (same kernels as the engine). One JSON line per
item: KL(full || variant) and top-1 per (variant, ratio), and the adaptive
budget's per-budget residual estimates.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from blend import probe as P
from blend.evals import metrics as M
from blend.evals.data import load_items
from blend.evals.items import parse_item_range
from blend.evals.research_lab import ItemLab, KVDiskCache


@dataclass(frozen=True)
class Ctx:
    """What a variant may look at (one item)."""

    lab: ItemLab
    budget_base: int

    @property
    def st(self):
        return self.lab.state


def _probe_attn(ctx: Ctx, kind: str = "mean") -> torch.Tensor:
    pr = ctx.lab.probe()
    return {"mean": pr.mean, "last": pr.last, "headmax": pr.headmax}[kind]  # (L', nb)


def _w(ctx: Ctx, kind: str = "mean", first: int = 0, reduce: str = "mean") -> torch.Tensor:
    return P.probe_weight(_probe_attn(ctx, kind), first, P.LayerReduce(reduce))


def _score_fn(name: str) -> Callable[[Ctx], torch.Tensor]:
    """Score of a base variant name."""
    st = lambda c: c.st  # noqa: E731
    table: dict[str, Callable[[Ctx], torch.Tensor]] = {
        "v": lambda c: st(c).dev_v,
        "k": lambda c: st(c).dev_k,
        "query": lambda c: st(c).query_attn,
        "combo": lambda c: st(c).query_attn * st(c).dev_v,
        "pm": lambda c: _w(c),  # probe attention, mean over layers
        "pm_dv": lambda c: _w(c) * st(c).dev_v,
        "pm_sqdv": lambda c: _w(c) * st(c).dev_v.sqrt(),
        "pmsq_dv": lambda c: _w(c).sqrt() * st(c).dev_v,
        "pmax_dv": lambda c: _w(c, reduce="max") * st(c).dev_v,
        "pdeep_dv": lambda c: _w(c, first=14) * st(c).dev_v,
        "pshallow_dv": lambda c: P.probe_weight(_probe_attn(c)[:10]) * st(c).dev_v,
        "plast_dv": lambda c: _w(c, "last") * st(c).dev_v,
        "phmax_dv": lambda c: _w(c, "headmax") * st(c).dev_v,
        "pm_rel": lambda c: _w(c) * st(c).dev_v / st(c).v_norm,
        "pm_dkv": lambda c: _w(c) * (st(c).dev_v / st(c).dev_v.mean() + st(c).dev_k / st(c).dev_k.mean()),
        "pmq_dv": lambda c: (_w(c) + st(c).query_attn) * st(c).dev_v,
    }
    if name not in table:
        raise KeyError(name)
    return table[name]


def select_variant(spec: str, ctx: Ctx, ratio: float) -> torch.Tensor:
    """Rows to recompute for one variant spec at one ratio.

    Spec: ``BASE[+span=W][+doc=F][+sink=S][+split]`` where BASE names a score
    (see :func:`_score_fn`); ``span`` dilates within documents, ``doc`` splits the
    budget across documents by the probe's attention mass (F: share spread by
    size), ``sink`` adds the first S rows of every document (inside the budget),
    ``split`` takes half the budget by the score and the rest by V deviation.
    """
    parts = spec.split("+")
    base, mods = parts[0], dict((m.split("=") + ["1"])[:2] for m in parts[1:])
    st = ctx.st
    budget = int(round(ratio * ctx.budget_base))
    score = _score_fn(base)(ctx).float()
    if "auto" in mods:  # adaptive: ratio is the cap; stop when the left-over estimate <= target
        est = score.double() / st.v_norm.double().mean()
        budget = P.stop_count(est, float(mods["auto"]), 0, budget)
    if "autoH" in mods:  # adaptive, the estimate scaled by the probe's first-token entropy
        est = P.entropy(ctx.lab.probe().logits) * score.double() / st.v_norm.double().mean()
        budget = P.stop_count(est, float(mods["autoH"]), 0, budget)
    sinks = int(mods.get("sink", 0))
    if sinks:
        forced = torch.nonzero(st.offset < sinks).flatten()
        budget = max(0, budget - forced.numel())
        score = score.clone()
        score[forced] = -1.0
    if "span" in mods:
        score = P.dilate(score, st.doc, int(mods["span"]))
    if "doc" in mods:
        k = int(st.doc.max()) + 1
        mass = torch.zeros(k).index_add_(0, st.doc, _w(ctx))
        counts = torch.bincount(st.doc, minlength=k)
        picked = P.select_by_doc(score, st.doc, P.doc_budgets(mass, counts, budget, float(mods["doc"])))
    elif "split" in mods:
        first = P.top(score, (budget + 1) // 2)
        taken = torch.zeros(score.numel(), dtype=torch.bool)
        taken[first] = True
        by_v = torch.argsort(st.dev_v, descending=True, stable=True)
        picked = torch.cat([first, by_v[~taken[by_v]][: budget - first.numel()]])
    else:
        picked = P.top(score, budget)
    if sinks:
        picked = P.with_sinks(picked, st.offset, sinks)
    return torch.sort(picked).values


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--cache", type=Path, required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--items", default="0-29")
    p.add_argument("--passages", type=int, default=5)
    p.add_argument("--ratios", default="0.15")
    p.add_argument("--variants", required=True)
    p.add_argument("--residual-scores", default="pm_dv,combo", help="scores whose residual estimates are logged")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--check", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    from blend.engine import Engine

    lo, hi = parse_item_range(a.items)
    items = load_items(a.data, hi + 1, a.passages)[lo:]
    ratios = [float(r) for r in a.ratios.split(",")]
    variants = a.variants.split(",")
    engine = Engine.load("smollm2-135m", quality_gate=False)
    cache = KVDiskCache(a.cache)
    done: dict[int, dict] = {}
    if a.out.exists():
        for line in a.out.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                done[r["index"]] = r
    with a.out.open("a") as f:
        for i, item in enumerate(items, start=lo):
            old = done.get(i, {}).get("kl", {})
            todo = [(v, r) for v in variants for r in ratios if "@" not in v and f"{v}@{r:g}" not in old]
            todo += [(v.split("@")[0], float(v.split("@")[1])) for v in variants if "@" in v and v not in old]
            if not todo:
                continue
            t0 = time.perf_counter()
            prompt = engine.build_prompt(item.question, item.document_texts())
            ref = cache.reference(engine, prompt)
            chunks = [cache.chunk(engine, prompt, j) for j in range(len(prompt.documents))]
            lab = ItemLab(engine, prompt, chunks, check=a.check)
            ctx = Ctx(lab, lab.state.budget_base)
            kl, top1, share = dict(old), dict(done.get(i, {}).get("top1", {})), dict(done.get(i, {}).get("share", {}))
            for v, r in todo:
                rows = select_variant(v, ctx, r)
                logits, _ = lab.run(rows)
                name = f"{v}@{r:g}"
                kl[name] = M.kl_divergence(ref, logits)
                top1[name] = M.top1_agree(ref, logits)
                share[name] = rows.numel() / ctx.budget_base
            pr = lab.probe()
            resid = {}
            for s in a.residual_scores.split(","):
                sc = _score_fn(s)(ctx).double()
                resid[s] = {f"{r:g}": float(P.residual(sc, int(round(r * ctx.budget_base))))
                            for r in (0.0, 0.025, 0.05, 0.075, 0.1, 0.125, 0.15, 0.2, 0.25, 0.3)}
            row = {
                "index": i, "id": item.id, "prompt_tokens": len(prompt), "nb": lab.nb,
                "budget_base": ctx.budget_base, "kl": kl, "top1": top1, "share": share,
                "probe_kl": M.kl_divergence(ref, pr.logits), "residual": resid,
                "probe_entropy": P.entropy(pr.logits), "v_norm_mean": float(lab.state.v_norm.mean()),
                "seconds": time.perf_counter() - t0,
            }
            f.write(json.dumps(row) + "\n")
            f.flush()
            best = sorted(((kl[f'{v}@{r:g}'], f'{v}@{r:g}') for v, r in todo))[:3]
            print(f"item {i}: {row['seconds']:.1f}s probe_kl={row['probe_kl']:.3f} best {best}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
