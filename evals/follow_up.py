"""bench_prefill's ``follow-up`` case: a conversation's third turn over the first turn's documents, exact and
blended (see :mod:`blend.evals.bench_prefill`'s docstring, item 4)."""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass, replace

import torch

from blend.defaults import DEFAULT_RATIO
from blend.engine import Engine
from blend.evals.data import load_item_range
from blend.evals.metrics import kl_divergence
from blend.policy import ReusePolicy
from blend.prompt import Prompt, Role, Turn
from blend.report import ReuseClass
from blend.store.memory import MemoryStore

FOLLOW_UP = "Which of the documents above says so? Answer with its title or its first words."
FOLLOW_UP_2 = "Quote the sentence of that document that supports the answer."


@dataclass(frozen=True)
class FollowUpRow:
    """Medians over items and repeats: seconds, and ratios to the third turn's full prefill."""

    items: int
    prompt_tokens: int
    history_tokens: int  # the question segment: both earlier turns, their answers and the new question
    computed_tokens: int  # of which the exact path computes (the last answer and the new question)
    full_s: float
    exact_ratio: float  # same documents: preamble, documents and both earlier turns an exact hit (loaded, not hot)
    exact_documents_only_ratio: float  # the same, the question segment computed whole (before turns were stored)
    blend_ratio: float  # documents reordered: blended at the default ratio
    blend_kl_mean: float  # first-token KL of the blend to the reordered prompt's full prefill
    blend_kl_max: float


def bench_follow_up(model: str, data: str, items: range, repeats: int, passages: int = 5,
                    answer_tokens: int = 32) -> FollowUpRow:
    """A conversation's third turn over the first turn's documents (see the module docstring)."""
    eng = Engine.load(model, quality_gate=False).with_store(MemoryStore())
    # the exact arms run on an engine over the same store and weights whose hot-prefix cache keeps nothing: every
    # repeat loads the stored turns (the first repeat's request would otherwise leave them hot for the others)
    loader = eng.with_store(eng.store)
    loader.segments.hot.budget_bytes = 0
    chosen = load_item_range(data, items, passages)
    full, exact, docs_only, blend, kls, tokens, hist, computed = [], [], [], [], [], [], [], []
    for it in chosen:
        texts = it.document_texts()
        eng.precompute_chunks(texts)  # ingest: the documents' canonical chunk KV, as a RAG index holds it
        history: tuple[Turn, ...] = ()
        for question in (it.question, FOLLOW_UP):  # turns 1 and 2, answered under exact reuse (they store their turns)
            ans = eng.generate(eng.build_prompt(question, texts, history=history), ReusePolicy.exact(),
                               max_new_tokens=answer_tokens)
            history += (Turn(Role.USER, question), Turn(Role.ASSISTANT, ans.text.strip() or "I do not know."))
        same = eng.build_prompt(FOLLOW_UP_2, texts, history=history)
        whole = Prompt((*same.segments[:-1], replace(same.question, turn_ends=())))  # no turn parts
        moved = eng.build_prompt(FOLLOW_UP_2, texts[1:] + texts[:1], history=history)
        runs = {"none": (same, ReusePolicy.one_pass()), "exact": (same, ReusePolicy.exact()),
                "exact_docs": (whole, ReusePolicy.exact()),
                "moved_none": (moved, ReusePolicy.one_pass()), "blend": (moved, ReusePolicy.blend(ratio=DEFAULT_RATIO))}
        names = list(runs)
        # exact reuse is bit-identical to no reuse (the same segment schedule, untimed here); the timed
        # reference is the one-pass full prefill, the fastest
        identity = eng.generate(same, ReusePolicy.none(), max_new_tokens=1).first_logits
        if it is chosen[0]:  # warm-up: every arm's first call (the probe's bf16 weights, ...) is no sample
            for name, (prompt, policy) in runs.items():
                (loader if name.startswith("exact") else eng).generate(prompt, policy, max_new_tokens=1)
        for r in range(repeats):
            t, logits = {}, {}
            for name in names[r % len(names):] + names[: r % len(names)]:  # rotated per repeat
                prompt, policy = runs[name]
                ans = (loader if name.startswith("exact") else eng).generate(prompt, policy, max_new_tokens=1)
                t[name], logits[name] = ans.ttft_s, ans.first_logits
                if name.startswith("exact") and any(s.reuse_class is not ReuseClass.EXACT
                                                    for s in ans.report.segments[:-1]):
                    raise RuntimeError(f"{name}: the third turn's documents and earlier turns were not an exact hit")
            if not torch.equal(logits["exact"], identity):
                raise RuntimeError("the third turn's exact reuse is not bit-identical to its prefill without reuse")
            full.append(t["none"])
            exact.append(t["exact"] / t["none"])
            docs_only.append(t["exact_docs"] / t["none"])
            blend.append(t["blend"] / t["moved_none"])
            kls.append(kl_divergence(logits["moved_none"], logits["blend"]))
            tokens.append(len(same))
            hist.append(len(same.question))
            computed.append(len(same.question.parts()[-1]))
        print(f"third turn of item {it.id}: full {full[-1]:.2f} s, exact {exact[-1]:.3f}x "
              f"(documents only {docs_only[-1]:.3f}x), blend {blend[-1]:.3f}x", file=sys.stderr, flush=True)
    return FollowUpRow(len(chosen), int(statistics.median(tokens)), int(statistics.median(hist)),
                       int(statistics.median(computed)), statistics.median(full), statistics.median(exact),
                       statistics.median(docs_only), statistics.median(blend), statistics.fmean(kls), max(kls))
