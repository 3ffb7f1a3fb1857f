"""The near-tie guard's second pass from the first pass's check layer (``GuardMode.WIDEN`` / ``EXTEND``).

A guarded request whose first token is a near tie is recomputed at the guard ratio. RESTART blends
again from the start; WIDEN goes on from the first pass's rows entering its check layer (no second
fetch, re-positioning, probe or layers below the check) and keeps every row the first pass recomputed;
EXTEND computes only the rows the first pass did not recompute and leaves that pass's KV for the rest.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_docs, unguarded_blend

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
    at = tiny_engine.generate(prompt, unguarded_blend(0.3, selector, candidates=None), max_new_tokens=6,
                              stop_at_newline=False)
    w = tiny_engine.generate(prompt, guarded(GuardMode.WIDEN, selector=selector, candidates=None),
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


def test_extend_leaves_the_first_passs_kv_above_the_check_and_computes_the_rest(tiny_engine):
    """EXTEND: the rows the first pass recomputed keep its KV above the check layer (bit for bit the
    cache of the first pass alone there); the newly kept rows are computed; what it spent counts the
    new rows only."""
    prompt = tiny_engine.build_prompt("Which one?", make_docs(4))
    first = tiny_engine.generate(prompt, unguarded_blend(0.15, "probe"), max_new_tokens=1, keep_cache=True)
    ext = tiny_engine.generate(prompt, guarded(GuardMode.EXTEND), max_new_tokens=1, keep_cache=True)
    wid = tiny_engine.generate(prompt, guarded(GuardMode.WIDEN), max_new_tokens=1, keep_cache=True)
    assert rows_of(ext) == rows_of(wid)  # the same rows recomputed by one pass or the other
    layers = tiny_engine.dims.num_layers
    segs = first.report.segments
    old = [s.start + o for s in segs for o in s.recomputed_offsets]  # absolute rows of the first pass
    new = sorted({s.start + o for s in ext.report.segments for o in s.recomputed_offsets} - set(old))
    assert old and new
    old_t, new_t = torch.tensor(old), torch.tensor(new)
    for layer in range(2, layers):  # above the check layer (1)
        k_first, v_first = first.cache.view(layer)
        k_ext, v_ext = ext.cache.view(layer)
        assert torch.equal(k_ext[:, old_t], k_first[:, old_t]) and torch.equal(v_ext[:, old_t], v_first[:, old_t])
        assert not torch.equal(k_ext[:, new_t], k_first[:, new_t])  # the new rows are no longer the reused ones
    base = budget_base(prompt)
    assert ext.report.spent == pytest.approx(0.15 + len(new) / base, abs=1e-9)
    assert wid.report.spent == pytest.approx(0.15 + (len(old) + len(new)) / base, abs=1e-9)
    assert "(extend: from check layer 1)" in ext.report.guard


def test_a_guard_ratio_the_candidates_do_not_cover_blends_again_from_the_start(tiny_engine):
    """0.4 is more than the first pass's 2 x 0.15 candidates: the guard restarts (bit for bit the blend at
    0.4); so does a policy with two check layers. RESTART never widens."""
    prompt = tiny_engine.build_prompt("Which one?", make_docs(4))
    at = tiny_engine.generate(prompt, unguarded_blend(0.4, "probe"), max_new_tokens=1)
    for mode in GuardMode:
        ans = tiny_engine.generate(prompt, guarded(mode, guard_ratio=0.4), max_new_tokens=1)
        assert torch.equal(ans.first_logits, at.first_logits) and "check layer" not in ans.report.guard
    two = dict(check_layers=(1, 2), layer_ratios=(0.15, 0.15))
    at2 = tiny_engine.generate(prompt, unguarded_blend(0.3, "probe", **two), max_new_tokens=1)
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
    auto = ReusePolicy.blend(0.15, "probe", budget=BudgetMode.AUTO, max_ratio=0.2, guard_mode=GuardMode.EXTEND)
    assert auto.candidate_share == pytest.approx(0.4)  # F x the adaptive budget's cap
    assert not ReusePolicy.blend(0.15, "probe", guard_mode=GuardMode.RESTART).guard_widens(0.3)
    assert not ReusePolicy.blend(0.15, "probe", check_layers=(1, 2), guard_mode=GuardMode.WIDEN).guard_widens(0.3)


def test_a_widened_guard_is_the_same_cold_and_warm(tiny_engine_factory):
    """A cold request (chunks computed canonically, then blended) widens exactly as the warm one."""
    eng = tiny_engine_factory()
    prompt = eng.build_prompt("Which one?", make_docs(4))
    for mode in (GuardMode.WIDEN, GuardMode.EXTEND):
        pol = guarded(mode, cache_salt=mode.value)  # a salt per mode: each mode's first request is cold
        cold = eng.generate(prompt, pol, max_new_tokens=4, stop_at_newline=False)
        warm = eng.generate(prompt, pol, max_new_tokens=4, stop_at_newline=False)
        assert torch.equal(cold.first_logits, warm.first_logits) and cold.token_ids == warm.token_ids
        assert cold.report.guard == warm.report.guard and f"({mode.value}:" in warm.report.guard


def test_the_guard_mode_is_checked_named_and_exposed():
    from blend.cli import build_parser
    from blend.options import policy_from_args
    from blend.serve.schemas import KvblendOptions
    from evals.methods import MethodError, parse_method

    with pytest.raises(InvalidPolicyError):
        ReusePolicy.blend(0.15, guard_mode="widen")  # a plain string is not a mode
    assert ReusePolicy.blend(0.15, guard_mode=GuardMode.EXTEND).describe().endswith("@0.3/extend")
    assert "/" not in ReusePolicy.blend(0.15).describe().rsplit(":", 1)[-1]  # the default is not spelled out
    base = ["ask", "q", "--doc", "d", "--reuse", "blend"]
    for name in GUARD_MODE_NAMES:
        assert policy_from_args(build_parser("ask").parse_args(base + ["--guard-mode", name])).guard_mode.value == name
        assert KvblendOptions(guard_mode=name).guard_mode == name
    with pytest.raises(SystemExit):
        build_parser("ask").parse_args(base + ["--guard-mode", "later"])
    with pytest.raises(ValueError):
        KvblendOptions(guard_mode="later")
    m = parse_method("blend@0.15:probe:gmode=extend")
    assert m.canonical == "blend@0.15:probe:gmode=extend" and m.policy().guard_mode is GuardMode.EXTEND
    for bad in ("blend@0.15:gmode=later", "blend@0.15:gmode=widen:gmode=widen"):
        with pytest.raises(MethodError):
            parse_method(bad)
