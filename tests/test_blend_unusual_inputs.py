"""Blends on unusual but legitimate requests: budgets that select nothing or everything, gradual
filtering that narrows later, an adaptive budget given its cap as the ratio too, chunk texts with extra
whitespace, and an all-exact blend found hot. Each test failed before its fix."""

import json

import pytest
import torch

from blend.errors import InvalidPolicyError
from blend.policy import BudgetMode, ReusePolicy
from blend.report import ReuseClass
from conftest import make_docs, unguarded_blend


@pytest.mark.parametrize("policy", [
    unguarded_blend(ratio=1e-4, selector="v"),  # round(1e-4 x ~800 document tokens) = 0 rows
    unguarded_blend(ratio=1e-4, candidates=None),  # the probe selector, every row computed up to the check
    unguarded_blend(threshold=1e9),  # no row deviates that much
    unguarded_blend(budget=BudgetMode.AUTO, auto_target=1e9),  # the target is met with no row
], ids=["ratio", "ratio-no-candidates", "threshold", "auto"])
def test_a_blend_that_selects_no_row_reports_valid_json(tiny_engine, policy):
    prompt = tiny_engine.build_prompt("Which?", make_docs(3))
    ans = tiny_engine.generate(prompt, policy, max_new_tokens=1)
    assert ans.report.recomputed_tokens == 0
    assert ans.report.deviation is not None and ans.report.deviation.selected_min is None
    json.dumps(ans.report.to_dict(), allow_nan=False)  # the server's JSONResponse refuses NaN (a 500)


def test_a_later_check_layer_that_drops_rows_counts_as_approximate_for_the_guard(tiny_engine):
    prompt = tiny_engine.build_prompt("Which?", make_docs(4))
    full = tiny_engine.generate(prompt, ReusePolicy.none(), max_new_tokens=1).first_logits
    kw = dict(ratio=1.0, check_layers=(1, 2), selector="v", guard_margin=1e9)  # any blend that kept KV is guarded
    narrowed = tiny_engine.generate(prompt, ReusePolicy.blend(layer_ratios=(1.0, 0.0), **kw), max_new_tokens=1)
    unguarded = tiny_engine.generate(prompt, ReusePolicy.blend(layer_ratios=(1.0, 0.0), **{**kw, "guard_margin": None}),
                                     max_new_tokens=1)
    assert (unguarded.first_logits - full).abs().max() > 1e-3  # above layer 2 every document row was reused
    assert narrowed.report.guard  # so the guard recomputes it
    assert (narrowed.first_logits - full).abs().max() <= 1e-4
    whole = tiny_engine.generate(prompt, ReusePolicy.blend(layer_ratios=(1.0, 1.0), **kw), max_new_tokens=1)
    assert not whole.report.guard  # every row recomputed at every layer: nothing approximate to guard


def test_the_adaptive_budget_runs_whatever_the_fixed_ratio_says(tiny_engine):
    prompt = tiny_engine.build_prompt("Which?", make_docs(4))
    kw = dict(budget=BudgetMode.AUTO, auto_target=0.0, max_ratio=0.3)  # target 0: the cap, max_ratio's rows
    with pytest.raises(InvalidPolicyError, match="set max_ratio=0 instead"):  # a fixed ratio is refused, not ignored
        unguarded_blend(ratio=0.0, **kw)
    capped = tiny_engine.generate(prompt, unguarded_blend(ratio=0.3, **kw), max_new_tokens=1)  # the cap, said twice
    default = tiny_engine.generate(prompt, unguarded_blend(**kw), max_new_tokens=1)
    assert capped.report.recomputed_tokens == default.report.recomputed_tokens > 0
    assert capped.report.ratio == default.report.ratio > 0
    assert torch.equal(capped.first_logits, default.first_logits)


@pytest.mark.parametrize("text", ["abc def ghi\n\n\n", "  abc def ghi\n\n", "abc def ghi \n\n"])
def test_precomputed_chunks_are_found_whatever_whitespace_the_text_carries(tiny_engine_factory, text):
    eng = tiny_engine_factory()
    docs = [make_docs(1)[0], text]
    eng.precompute_chunks(docs)
    ans = eng.generate(eng.build_prompt("Which?", docs), unguarded_blend(), max_new_tokens=1)
    assert [s.reuse_class for s in ans.report.segments[1:-1]] == [ReuseClass.EXACT, ReuseClass.BLENDED]


def test_a_huge_candidate_factor_takes_every_row(tiny_engine):
    prompt = tiny_engine.build_prompt("Which?", make_docs(3))
    huge = tiny_engine.generate(prompt, unguarded_blend(candidates=1e308), max_new_tokens=1)  # factor x budget: inf
    every = tiny_engine.generate(prompt, unguarded_blend(candidates=1e6), max_new_tokens=1)
    assert torch.equal(huge.first_logits, every.first_logits)
    assert huge.report.recomputed_tokens == every.report.recomputed_tokens > 0


def test_an_all_exact_blend_reports_its_first_token_gap_when_found_hot(tiny_engine):
    prompt = tiny_engine.build_prompt("Which?", make_docs(3))
    tiny_engine.generate(prompt, ReusePolicy.exact(), max_new_tokens=1)  # stores this order's exact KV
    loaded = tiny_engine.generate(prompt, ReusePolicy.blend(), max_new_tokens=1)  # all exact: keeps it hot
    hot = tiny_engine.generate(prompt, ReusePolicy.blend(), max_new_tokens=1)  # the hot prefix attached
    assert torch.equal(loaded.first_logits, hot.first_logits)
    assert loaded.report.first_token_margin is not None
    assert hot.report.first_token_margin == loaded.report.first_token_margin


def _cold_then_warm(eng, monkeypatch, docs):
    """A cold blend of ``docs`` counting the canonical chunks it computes, then the same blend warm.

    Returns:
        (engine, cold answer, warm answer, chunks the cold one computed).
    """
    from blend.segments import SegmentCache

    calls = []
    real = SegmentCache.canonical_kv
    monkeypatch.setattr(SegmentCache, "canonical_kv", lambda self, *a, **kw: calls.append(1) or real(self, *a, **kw))
    prompt = eng.build_prompt("Which?", docs)
    cold = eng.generate(prompt, unguarded_blend(ratio=0.25), max_new_tokens=2, stop_at_newline=False)
    monkeypatch.setattr(SegmentCache, "canonical_kv", real)
    warm = eng.generate(prompt, unguarded_blend(ratio=0.25), max_new_tokens=2, stop_at_newline=False)
    return eng, cold, warm, len(calls)


def test_a_document_repeated_in_one_prompt_is_computed_once_cold(tiny_engine_factory, monkeypatch):
    """A retriever that returns one chunk twice: the cold blend computes its canonical KV once and uses it
    for both copies (the numbers a second computation gives, bit for bit), and says so; warm == cold."""
    docs = make_docs(3)
    docs = [docs[0], docs[1], docs[2], docs[1]]  # documents 1 and 3 share a text
    eng, cold, warm, computed = _cold_then_warm(tiny_engine_factory(), monkeypatch, docs)
    assert computed == 3  # documents 0, 1 and 2; 4 before: document 3 computed again
    rep = [s for s in cold.report.segments if s.kind.value == "document"]
    assert rep[3].reuse_class is ReuseClass.COMPUTED and "document 1" in rep[3].note
    assert torch.equal(cold.first_logits, warm.first_logits) and cold.token_ids == warm.token_ids
    assert [s.reuse_class for s in warm.report.segments if s.kind.value == "document"][1:] == [ReuseClass.BLENDED] * 3


@pytest.mark.parametrize("order", [(0, 0), (0, 1, 0)])
def test_a_repeat_of_the_first_document_is_computed_once_cold(tiny_engine_factory, monkeypatch, order):
    """The first document is fetched on its own (it is exact at its canonical position), the rest after:
    a later copy of its text was computed and stored a second time, and reported as a plain miss."""
    base = make_docs(2)
    eng, cold, warm, computed = _cold_then_warm(tiny_engine_factory(), monkeypatch, [base[i] for i in order])
    assert computed == len(set(order))
    last = [s for s in cold.report.segments if s.kind.value == "document"][-1]
    assert last.reuse_class is ReuseClass.COMPUTED and "the same text as document 0" in last.note
    assert torch.equal(cold.first_logits, warm.first_logits) and cold.token_ids == warm.token_ids
