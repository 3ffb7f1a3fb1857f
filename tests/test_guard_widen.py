"""The near-tie guard's second pass from the first pass's check layer (``GuardMode.WIDEN``).

A guarded request whose first token is a near tie is recomputed at the guard ratio. RESTART (the
default) blends again from the start; WIDEN goes on from the first pass's rows entering its check layer
(no second fetch, re-positioning, probe or layers below the check), selects among that pass's
candidates and keeps every row it recomputed.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_docs, unguarded, unguarded_blend

from blend.errors import InvalidPolicyError
from blend.policy import GUARD_MODE_NAMES, BudgetMode, GuardMode, ReusePolicy


def guarded(mode: GuardMode, ratio: float = 0.15, selector: str = "probe", guard_ratio: float = 0.3, **kw):
    """A blend whose guard always fires (margin 1e9), at ``guard_ratio``, in ``mode``."""
    return ReusePolicy.blend(ratio, selector, guard_margin=1e9, guard_ratio=guard_ratio, guard_mode=mode, **kw)


def rows_of(answer) -> list[tuple[int, ...]]:
    return [s.recomputed_offsets for s in answer.report.segments]


def budget_base(prompt) -> int:
    return sum(len(d) for d in prompt.documents)


@pytest.mark.parametrize("selector", ["v", "probe", "combo"])
def test_widen_without_candidates_is_the_blend_at_the_guard_ratio(tiny_engine, selector):
    """With every row computed up to the check layer, a widened guard is, bit for bit, what a blend at
    the guard ratio computes: the first token's logits, the whole answer and the rows recomputed (a
    top-k of the same scores keeps the 0.15 selection inside the 0.3 one)."""
    prompt = tiny_engine.build_prompt("Which one?", make_docs(4))
    every_row = {"candidates": None} if selector == "probe" else {}  # (other selectors run no probe at all)
    at = tiny_engine.generate(prompt, unguarded_blend(0.3, selector, **every_row), max_new_tokens=6,
                              stop_at_newline=False)
    w = tiny_engine.generate(prompt, guarded(GuardMode.WIDEN, selector=selector, **every_row),
                             max_new_tokens=6, stop_at_newline=False)
    assert "(widen: from check layer 1)" in w.report.guard
    assert torch.equal(w.first_logits, at.first_logits) and w.token_ids == at.token_ids
    assert rows_of(w) == rows_of(at)
    base = budget_base(prompt)
    assert w.report.ratio == pytest.approx(round(0.3 * base) / base)  # the share it recomputed
    assert w.report.spent == pytest.approx(0.15 + w.report.ratio)  # both passes above the check


def test_widen_keeps_the_first_passs_rows_and_draws_from_its_candidates(tiny_engine):
    """With candidate pre-selection the widened rows are the first pass's candidates (2 x 0.15 = the
    guard's 0.3): the same numbers as one blend at 0.3 whose candidates are those rows (factor 1.0),
    where both count the same rows; every row the first pass recomputed is recomputed again."""
    for n_docs in (3, 5, 6):
        prompt = tiny_engine.build_prompt("Which one?", make_docs(n_docs))
        base = budget_base(prompt)
        assert math.ceil(2 * round(0.15 * base)) == round(0.3 * base)  # the same candidate count either way
        first = tiny_engine.generate(prompt, unguarded_blend(0.15, "probe"), max_new_tokens=1)
        one = tiny_engine.generate(prompt, unguarded_blend(0.3, "probe", candidates=1.0), max_new_tokens=1)
        w = tiny_engine.generate(prompt, guarded(GuardMode.WIDEN), max_new_tokens=1)
        assert torch.equal(w.first_logits, one.first_logits) and rows_of(w) == rows_of(one)
        for mine, before in zip(rows_of(w), rows_of(first)):
            assert set(before) <= set(mine)


def test_widen_spends_what_it_recomputed_above_the_check(tiny_engine):
    """A widened answer's report: its ratio is the share of reused document rows recomputed above the
    check (the first pass's rows among them) and what it spent adds that to the first pass's 0.15."""
    prompt = tiny_engine.build_prompt("Which one?", make_docs(4))
    first = tiny_engine.generate(prompt, unguarded_blend(0.15, "probe"), max_new_tokens=1)
    wid = tiny_engine.generate(prompt, guarded(GuardMode.WIDEN), max_new_tokens=1)
    n = sum(len(r) for r in rows_of(wid))
    assert n >= sum(len(r) for r in rows_of(first))
    base = budget_base(prompt)
    assert wid.report.ratio == pytest.approx(n / base) and wid.report.spent == pytest.approx(0.15 + n / base)
    assert wid.report.guard.endswith("(widen: from check layer 1)") and wid.report.to_dict()["spent"] > 0.15


def test_a_widened_guard_says_when_its_candidates_held_fewer_rows_than_the_guard_ratio(tiny_engine):
    """The candidates are 2 x round(0.15 x base) rows; where round(0.3 x base) is one more, the widened pass
    recomputes the candidates' share, and its guard note says so instead of only naming 0.3."""
    prompt = next(p for w in range(8, 60) for p in [tiny_engine.build_prompt("Which one?", make_docs(4, words=w))]
                  if 2 * round(0.15 * budget_base(p)) < round(0.3 * budget_base(p)))
    wid = tiny_engine.generate(prompt, guarded(GuardMode.WIDEN), max_new_tokens=1)
    n = sum(len(r) for r in rows_of(wid))
    assert n == 2 * round(0.15 * budget_base(prompt)) and wid.report.ratio == pytest.approx(n / budget_base(prompt))
    assert wid.report.guard.endswith(f"(widen: from check layer 1, its candidates only {n / budget_base(prompt):.3g} "
                                     "of the document rows)")


def test_a_guard_ratio_the_candidates_do_not_cover_blends_again_from_the_start(tiny_engine):
    """0.4 is more than the first pass's 2 x 0.15 candidates: the guard restarts (bit for bit the blend at
    0.4); so does a policy with two check layers. RESTART never widens."""
    prompt = tiny_engine.build_prompt("Which one?", make_docs(4))
    at = tiny_engine.generate(prompt, unguarded_blend(0.4, "probe"), max_new_tokens=1)
    for mode in GuardMode:
        ans = tiny_engine.generate(prompt, guarded(mode, guard_ratio=0.4), max_new_tokens=1)
        assert torch.equal(ans.first_logits, at.first_logits) and "check layer" not in ans.report.guard
    two = dict(check_layers=(1, 2), layer_ratios=(0.15, 0.15))
    # the guard's blend: 0.3 at both check layers (its explicit layer ratios dropped)
    at2 = tiny_engine.generate(prompt, unguarded_blend(0.3, "probe", check_layers=(1, 2)), max_new_tokens=1)
    w2 = tiny_engine.generate(prompt, guarded(GuardMode.WIDEN, **two), max_new_tokens=1)
    assert torch.equal(w2.first_logits, at2.first_logits) and "check layer" not in w2.report.guard
    restart = tiny_engine.generate(prompt, guarded(GuardMode.RESTART), max_new_tokens=1)
    at3 = tiny_engine.generate(prompt, unguarded_blend(0.3, "probe"), max_new_tokens=1)
    assert torch.equal(restart.first_logits, at3.first_logits) and restart.report.ratio == 0.3


def test_guard_widens_follows_the_candidates_share():
    p = ReusePolicy.blend(0.15, "probe", guard_mode=GuardMode.WIDEN)
    assert p.candidate_share == pytest.approx(0.3) and p.guard_widens(0.3) and not p.guard_widens(0.31)
    assert not p.guard_widens(1.0)  # the exact path
    assert ReusePolicy.blend(0.15, "v", guard_mode=GuardMode.WIDEN).candidate_share == 1.0  # no probe: every row
    assert ReusePolicy.blend(0.15, "probe", candidates=None, guard_mode=GuardMode.WIDEN).guard_widens(0.9)
    auto = ReusePolicy.blend(0.15, "probe", budget=BudgetMode.AUTO, max_ratio=0.2, guard_mode=GuardMode.WIDEN)
    assert auto.candidate_share == pytest.approx(0.4)  # F x the adaptive budget's cap
    assert not ReusePolicy.blend(0.15, "probe", guard_mode=GuardMode.RESTART).guard_widens(0.3)
    assert not ReusePolicy.blend(0.15, "probe", check_layers=(1, 2), guard_mode=GuardMode.WIDEN).guard_widens(0.3)


def test_a_widened_guard_is_the_same_cold_and_warm(tiny_engine_factory):
    """A cold request (chunks computed canonically, then blended) widens exactly as the warm one."""
    eng = tiny_engine_factory()
    prompt = eng.build_prompt("Which one?", make_docs(4))
    pol = guarded(GuardMode.WIDEN)
    cold = eng.generate(prompt, pol, max_new_tokens=4, stop_at_newline=False)
    warm = eng.generate(prompt, pol, max_new_tokens=4, stop_at_newline=False)
    assert torch.equal(cold.first_logits, warm.first_logits) and cold.token_ids == warm.token_ids
    assert cold.report.guard == warm.report.guard and "(widen:" in warm.report.guard


def test_the_guard_mode_is_checked_named_and_exposed():
    from blend.cli import build_parser
    from blend.options import policy_from_args
    from blend.serve.schemas import KvblendOptions
    from evals.methods import MethodError, parse_method

    with pytest.raises(InvalidPolicyError):
        ReusePolicy.blend(0.15, guard_mode="widen")  # a plain string is not a mode
    assert ReusePolicy.blend(0.15, guard_mode=GuardMode.WIDEN).describe().endswith("@0.3/widen")
    assert "/" not in ReusePolicy.blend(0.15).describe().rsplit(":", 1)[-1]  # the default is not spelled out
    base = ["ask", "q", "--doc", "d", "--reuse", "blend"]
    for name in GUARD_MODE_NAMES:
        assert policy_from_args(build_parser("ask").parse_args(base + ["--guard-mode", name])).guard_mode.value == name
        assert KvblendOptions(guard_mode=name).guard_mode == name
    with pytest.raises(SystemExit):
        build_parser("ask").parse_args(base + ["--guard-mode", "later"])
    with pytest.raises(ValueError):
        KvblendOptions(guard_mode="later")
    m = parse_method("blend@0.15:probe:gmode=widen")
    assert m.canonical == "blend@0.15:probe:gmode=widen" and m.policy().guard_mode is GuardMode.WIDEN
    for bad in ("blend@0.15:gmode=later", "blend@0.15:gmode=extend", "blend@0.15:gmode=widen:gmode=widen"):
        with pytest.raises(MethodError):
            parse_method(bad)


def test_a_threshold_or_adaptive_blend_widens_from_candidates_that_cover_its_cap(tiny_engine):
    """A threshold blend computes candidates for its cap (2 x 0.5: every row); one that selected nothing
    widens to the guard ratio as a blend at 0.3 whose candidates are every row (the probe run first) does.
    An adaptive
    budget's candidates (2 x max_ratio 0.2) cover a guard ratio of 0.4: it widens too, spending its own
    choice plus what the second pass computed."""
    prompt = tiny_engine.build_prompt("Which one?", make_docs(4))
    idle = ReusePolicy.blend(0.15, "probe", threshold=1e9, max_ratio=0.5, guard_margin=1e9, guard_ratio=0.3,
                             guard_mode=GuardMode.WIDEN)
    again = tiny_engine.generate(prompt, idle, max_new_tokens=1)
    at = tiny_engine.generate(prompt, unguarded_blend(0.3, "probe", candidates=4.0), max_new_tokens=1)  # 1.2 > 1
    assert "(widen:" in again.report.guard and torch.equal(again.first_logits, at.first_logits)
    auto = ReusePolicy.blend(0.15, "probe", budget=BudgetMode.AUTO, max_ratio=0.2, auto_target=1e9,
                             guard_margin=1e9, guard_ratio=0.4, guard_mode=GuardMode.WIDEN)
    redo = tiny_engine.generate(prompt, auto, max_new_tokens=1)
    first = tiny_engine.generate(prompt, unguarded(auto), max_new_tokens=1).report.ratio
    assert "(widen:" in redo.report.guard and redo.report.ratio >= first
    assert redo.report.spent == pytest.approx(first + redo.report.ratio)


def test_a_restarted_guard_reports_the_share_its_redo_recomputed(tiny_engine):
    """Bug 1: the guard's restart blend may hold fewer free rows than round(guard_ratio x base) (the first
    document, exact, counts in the base); the Checker then reports the share recomputed, but _guard
    overwrites it with the target: report.ratio 0.3 and spent 0.45 for a redo that recomputed 0.234."""
    d = make_docs(3, words=60, seed=1)
    prompt = tiny_engine.build_prompt("What is the answer?", [d[0] + " " + d[1], d[2][:250]])
    docs = sum(len(x) for x in prompt.documents)
    blended = sum(len(x) for x in prompt.documents[1:])
    assert round(0.15 * docs) < blended < round(0.3 * docs)  # the first pass is approximate, the redo is not
    ans = tiny_engine.generate(prompt, ReusePolicy.blend(0.15, guard_margin=1e9), max_new_tokens=1)
    rep = ans.report
    assert rep.guard and rep.recomputed_tokens == blended  # the redo recomputed every blended row
    share = rep.recomputed_tokens / docs
    assert rep.ratio == share, (rep.ratio, share)  # fails: 0.3
    assert abs(rep.spent - (0.15 + share)) < 1e-9, rep.spent  # fails: 0.45


def test_the_guard_never_reruns_an_adaptive_blend_at_the_same_rows(tiny_engine):
    """Bug 2: guard_ratio_for compares shares; an adaptive budget at its cap (max_ratio 0.3, README's
    configuration) recomputes floor(0.3 x base) rows = 0.2998 < 0.3, so the guard 'recomputes at 0.3':
    round(0.3 x base) rows, the same rows, the same logits bit for bit, the near tie untouched, spent doubled.
    The docs promise: a guard never answers a near tie with the same budget (exact path instead)."""
    prompt = tiny_engine.build_prompt("Which one?", make_docs(5, words=30, seed=3)[:4])
    base = sum(len(x) for x in prompt.documents)
    assert int(0.3 * base) == round(0.3 * base) and 0.3 * base != int(0.3 * base)
    first = tiny_engine.generate(prompt, ReusePolicy.blend(budget=BudgetMode.AUTO, max_ratio=0.3, auto_target=0.0,
                                                           guard_margin=None), max_new_tokens=1)
    guarded = tiny_engine.generate(prompt, ReusePolicy.blend(budget=BudgetMode.AUTO, max_ratio=0.3, auto_target=0.0,
                                                             guard_margin=1e9), max_new_tokens=1)
    assert first.report.recomputed_tokens == int(0.3 * base)  # at its cap
    assert guarded.report.guard
    # fails: the redo recomputed the very rows of the first pass and answers with its logits
    assert not torch.equal(guarded.first_logits, first.first_logits), "the guard re-ran the same blend"
    assert guarded.report.ratio == 1.0  # fails: 0.3 (should have taken the exact path)


def test_a_widened_guard_that_got_its_rows_adds_no_shortfall_note(tiny_engine):
    """Bug 3: the widen note compares shares rounded to 3 digits: 248 of 825 rows (= round(0.3 x 825), the
    guard's whole budget) is 0.3006 -> 0.301 != 0.3, so the report says 'its candidates only 0.301 of the
    document rows' although they held every row the guard ratio asks (and a 1-row shortfall at a large
    base, 0.29967 -> 0.3, goes unmentioned)."""
    prompt = tiny_engine.build_prompt("Which one?", make_docs(4, words=30, seed=5))
    base = sum(len(x) for x in prompt.documents)
    wid = tiny_engine.generate(prompt, ReusePolicy.blend(guard_margin=1e9, guard_mode=GuardMode.WIDEN),
                               max_new_tokens=1)
    assert wid.report.recomputed_tokens == round(0.3 * base)  # every row the guard ratio asks
    assert wid.report.guard.endswith("(widen: from check layer 1)"), wid.report.guard
