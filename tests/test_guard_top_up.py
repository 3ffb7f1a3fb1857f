"""The near-tie guard's top-up remedy (issue 14): a guarded blend keeps its first pass and computes only
the rows the guard ratio adds (and the question), from the check layer up."""

from dataclasses import replace

import pytest
import torch

import blend.blending as B
from blend.policy import BudgetMode, GuardRemedy, ReusePolicy
from conftest import make_docs, unguarded_blend

TOP_UP = GuardRemedy.TOP_UP


def _guarded(ratio: float, guard_ratio: float, **kw) -> ReusePolicy:
    """A blend whose guard always fires (tiny random models' first tokens are near ties anyway)."""
    return ReusePolicy.blend(ratio, guard_margin=1e9, guard_ratio=guard_ratio, guard_remedy=TOP_UP, **kw)


@pytest.fixture
def prompt(tiny_engine):
    return tiny_engine.build_prompt("Which one?", make_docs(4, words=40))


@pytest.fixture
def top_ups(monkeypatch):
    """Spy on blend.blending.top_up: the TopUp objects it ran."""
    seen: list = []
    real = B.top_up

    def spy(model, top, cache):
        seen.append(top)
        return real(model, top, cache)

    import blend.engine as E

    monkeypatch.setattr(E, "top_up", spy)
    return seen


def test_a_top_up_from_nothing_equals_a_blend_at_the_guard_ratio(tiny_engine, prompt, top_ups):
    """With every row computed up to the check (no candidates) and a first pass that selected no document
    row, topping up to 0.5 runs exactly the rows a blend at 0.5 runs, from the same layer inputs: the same
    logits (to float rounding: the check layer's projections ran over more rows in the first pass) and the
    same answer, decoded from the topped-up cache."""
    tiny = 1e-4  # rounds to a budget of 0 rows: the check runs, selects nothing
    for selector in ("probe", "v"):
        kw = dict(selector=selector, candidates=None)
        up = tiny_engine.generate(prompt, _guarded(tiny, 0.5, **kw), max_new_tokens=6, stop_at_newline=False)
        direct = tiny_engine.generate(prompt, unguarded_blend(0.5, **kw), max_new_tokens=6, stop_at_newline=False)
        assert "topped up to ratio 0.5" in up.report.guard
        torch.testing.assert_close(up.first_logits, direct.first_logits, rtol=1e-5, atol=1e-5)
        assert up.token_ids == direct.token_ids
        assert up.report.ratio == pytest.approx(direct.report.ratio, abs=0.01) and up.report.spent == up.report.ratio
        picked = [s.recomputed for s in up.report.segments]
        assert picked == [s.recomputed for s in direct.report.segments]
        assert [s.recomputed_offsets for s in up.report.segments] == \
            [s.recomputed_offsets for s in direct.report.segments]
    assert len(top_ups) == 2


def test_a_top_up_adds_rows_to_the_first_pass_and_recomputes_only_those(tiny_engine, prompt, top_ups):
    """With candidates (the default), the first pass's selection stays, the added rows are the selector's
    next ones up to the guard ratio (the candidates widen to cover it), and only they and the question
    run from the check layer up."""
    first = tiny_engine.generate(prompt, unguarded_blend(0.15, "probe", guard_remedy=TOP_UP), max_new_tokens=1)
    up = tiny_engine.generate(prompt, _guarded(0.15, 0.3), max_new_tokens=1)
    (top,) = top_ups
    base = sum(len(d) for d in prompt.documents)
    nq = len(prompt.question)
    assert top.rows.shape[0] == top.added + nq and top.h.shape == (top.added + nq, tiny_engine.runner.dims.hidden)
    assert top.layer == 1 and bool((top.rows[:-nq] < top.plan.nb).all())
    s1 = sum(s.recomputed for s in first.report.segments)
    both = sum(s.recomputed for s in up.report.segments)
    assert s1 == round(0.15 * base) and both == s1 + top.added == round(0.3 * base)
    for a, b in zip(first.report.segments, up.report.segments):  # the first pass's rows are all still there
        assert set(a.recomputed_offsets) <= set(b.recomputed_offsets)
    assert up.report.ratio == pytest.approx(both / base) and up.report.spent == up.report.ratio
    assert up.report.first_token_margin == pytest.approx(first.report.first_token_margin)
    assert "+top-up" in up.report.policy and "rows added" in up.report.guard
    assert not torch.equal(up.first_logits, first.first_logits)  # the top-up changed the answer's inputs


def test_cold_equals_warm_with_the_top_up(tiny_engine_factory, prompt):
    """A cold request (chunks computed canonically, then blended and topped up) gives the warm one's bits."""
    eng = tiny_engine_factory()
    p = eng.build_prompt("Which one?", make_docs(4, words=40))
    cold = eng.generate(p, _guarded(0.15, 0.3), max_new_tokens=4, stop_at_newline=False)
    warm = eng.generate(p, _guarded(0.15, 0.3), max_new_tokens=4, stop_at_newline=False)
    assert cold.report.guard and cold.report.guard == warm.report.guard
    assert torch.equal(cold.first_logits, warm.first_logits) and cold.token_ids == warm.token_ids


def test_where_the_top_up_does_not_apply_the_guard_re_blends(tiny_engine, prompt, top_ups):
    """An adaptive budget, a threshold, two check layers and a guard ratio that means the exact path take
    the re-blend (or the exact path) as before; a guard that does not fire leaves the first pass alone."""
    for policy in (_guarded(0.15, 0.3, budget=BudgetMode.AUTO, max_ratio=0.2, auto_target=1e9),
                   _guarded(0.15, 0.3, threshold=1e9, max_ratio=0.5),
                   _guarded(0.2, 0.4, check_layers=(1, 2), layer_ratios=(0.2, 0.1)),
                   _guarded(0.3, 0.3)):
        assert policy.top_up_ratio() is None
        ans = tiny_engine.generate(prompt, policy, max_new_tokens=1)
        assert "recomputed at ratio" in ans.report.guard
    assert top_ups == []
    quiet = replace(_guarded(0.15, 0.3), guard_margin=0.0)
    plain = tiny_engine.generate(prompt, unguarded_blend(0.15, guard_remedy=TOP_UP), max_new_tokens=1)
    ans = tiny_engine.generate(prompt, quiet, max_new_tokens=1)
    assert ans.report.guard == "" and torch.equal(ans.first_logits, plain.first_logits) and top_ups == []


def test_the_top_up_leaves_an_unguarded_blend_unchanged(tiny_engine, prompt):
    """Choosing the top-up remedy changes nothing for a blend the guard does not touch, except that the
    candidates cover the guard's budget (here 2 x 0.15 already does): the same bits."""
    a = tiny_engine.generate(prompt, unguarded_blend(0.15), max_new_tokens=3, stop_at_newline=False)
    b = tiny_engine.generate(prompt, replace(_guarded(0.15, 0.3), guard_margin=0.0), max_new_tokens=3,
                             stop_at_newline=False)
    assert torch.equal(a.first_logits, b.first_logits) and a.token_ids == b.token_ids


def test_the_context_only_blend_keeps_nothing_for_a_top_up(tiny_engine, prompt):
    """The vLLM connector's blend (question=False) has no first token to guard: no hidden rows are kept."""
    logits, cache, report = tiny_engine.prefill(prompt, _guarded(0.15, 0.3), question=False)
    assert logits is None and report.guard == ""


def test_policy_validates_the_remedy():
    from blend.errors import InvalidPolicyError

    with pytest.raises(InvalidPolicyError, match="guard_remedy"):
        ReusePolicy.blend(0.15, guard_remedy="top-up")
    assert ReusePolicy.blend(0.15, guard_remedy=TOP_UP).top_up_ratio() == 0.3
    assert ReusePolicy.blend(0.15, guard_remedy=TOP_UP, guard_margin=None).top_up_ratio() is None
