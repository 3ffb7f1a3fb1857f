"""ReusePolicy validation: a value the engine cannot run is an InvalidPolicyError at construction,
never a TypeError deep inside a prefill, and never a silent change of what the request does."""

from __future__ import annotations

import math

import numpy as np
import pytest

from blend.errors import InvalidPolicyError
from blend.policy import BudgetMode, GuardMode, ProbePrecision, ReuseMode, ReusePolicy


@pytest.mark.parametrize("mode", ["exact", "none", "blend", None, 1])
def test_a_mode_that_is_not_a_reuse_mode_is_refused(mode):
    """A string "exact" used to pass, and every check in the engine (``is ReuseMode.EXACT``) then missed
    it: the request ran the blend path, the explicit opt-in skipped."""
    with pytest.raises(InvalidPolicyError, match="mode must be a ReuseMode"):
        ReusePolicy(mode=mode)


@pytest.mark.parametrize("limit", [math.nan, 1.5, True, "2", -1])
def test_a_prefix_limit_that_is_not_a_segment_count_is_refused(limit):
    with pytest.raises(InvalidPolicyError, match="prefix_limit"):
        ReusePolicy.exact(prefix_limit=limit)


@pytest.mark.parametrize("layers", [(math.nan,), (0.5,), ("1",), (True,), 1, "1"])
def test_check_layers_that_are_not_layer_numbers_are_refused(layers):
    with pytest.raises(InvalidPolicyError, match="check_layers"):
        ReusePolicy(mode=ReuseMode.BLEND, check_layers=layers)


@pytest.mark.parametrize("ratios", [0.1, "0.1"])
def test_layer_ratios_that_are_not_a_sequence_are_refused(ratios):
    with pytest.raises(InvalidPolicyError, match="layer_ratios"):
        ReusePolicy.blend(layer_ratios=ratios)


@pytest.mark.parametrize("seed", [math.nan, 1.5, -1, 2**64, "7", None, np.int64(3)])
def test_a_seed_the_random_selector_cannot_use_is_refused(seed):
    with pytest.raises(InvalidPolicyError, match="seed"):
        ReusePolicy.blend(selector="random", seed=seed)


def test_integer_settings_of_any_integer_type_are_kept(tiny_engine):
    """numpy integers and lists are what a config loader hands over: they stay valid and run."""
    exact = ReusePolicy.exact(prefix_limit=np.int64(1))
    blend = ReusePolicy(mode=ReuseMode.BLEND, check_layers=[np.int64(1)], selector="random", seed=3,
                        guard_margin=None)
    prompt = tiny_engine.build_prompt("Which?", ["Alpha beta gamma.", "Delta epsilon zeta."])
    tiny_engine.generate(prompt, exact, max_new_tokens=1)
    again = tiny_engine.generate(prompt, exact, max_new_tokens=1)  # only the preamble is looked up and stored
    assert [s.reuse_class.value for s in again.report.segments] == ["exact", "computed", "computed", "computed"]
    assert tiny_engine.generate(prompt, blend, max_new_tokens=1).report.policy.startswith("blend@")


@pytest.mark.parametrize("name, value", [("semantic", "false"), ("semantic", 1), ("force", "no"), ("force", None)])
def test_switches_take_only_true_or_false(name, value):
    """``semantic="false"`` is truthy: it turned the experimental donor reuse on."""
    with pytest.raises(InvalidPolicyError, match=f"{name} must be true or false"):
        ReusePolicy.blend(**{name: value})


@pytest.mark.parametrize("n", [True, 1.0, "5"])
def test_min_prompt_tokens_is_a_count(n):
    with pytest.raises(InvalidPolicyError, match="min_prompt_tokens"):
        ReusePolicy.blend(min_prompt_tokens=n)


def test_describe_names_every_setting_that_changes_what_a_blend_runs():
    assert ReusePolicy.blend(threshold=0.5, max_ratio=0.3).describe().startswith("blend@threshold=0.5<=0.3:")
    assert ":random:seed=7:" in ReusePolicy.blend(0.2, "random", seed=7).describe()
    assert ReusePolicy.blend(0.2, "random", seed=7).describe() != ReusePolicy.blend(0.2, "random", seed=8).describe()
    assert ReusePolicy.blend(0.2, semantic=True).describe().endswith(":semantic")
    assert "seed" not in ReusePolicy.blend(0.2).describe() and "semantic" not in ReusePolicy.blend(0.2).describe()


@pytest.mark.parametrize("kw", [dict(selector="v"), dict(selector="combo"), dict(selector="probe"),
                                dict(selector="split", check_layers=(0, 2)), dict(selector="probe", threshold=0.1),
                                dict(selector="probe", budget=BudgetMode.AUTO)])
def test_check_layer_0_with_a_deviation_ranking_is_refused(kw):
    """Layer 0's K/V depend on the token alone: fresh and cached rows are equal there, every
    deviation is 0, and such a selector would pick rows by position without a word."""
    layers = kw.pop("check_layers", (0,))
    with pytest.raises(InvalidPolicyError, match="check layer 0"):
        ReusePolicy.blend(0.15, check_layers=layers, **kw)


@pytest.mark.parametrize("selector", ["probe_attn", "query", "lead", "random"])
def test_check_layer_0_takes_the_selectors_that_need_no_deviation(selector):
    assert ReusePolicy.blend(0.15, selector, check_layers=0).check_layers == (0,)


def test_an_adaptive_budget_takes_only_the_probe_selector_and_no_threshold():
    """It ranks by the probe score: another selector would be named in the report and ignored."""
    with pytest.raises(InvalidPolicyError, match="probe score"):
        ReusePolicy.blend(0.15, "v", budget=BudgetMode.AUTO)
    with pytest.raises(InvalidPolicyError, match="two stopping rules"):
        ReusePolicy.blend(0.15, "probe", budget=BudgetMode.AUTO, threshold=0.2)
    assert ReusePolicy.blend(0.15, "probe", budget=BudgetMode.AUTO).budget is BudgetMode.AUTO


@pytest.mark.parametrize("mode", [ReuseMode.EXACT, ReuseMode.NONE])
@pytest.mark.parametrize("setting", [dict(ratio=0.5), dict(selector="v"), dict(check_layers=(2,)), dict(threshold=0.1),
                                     dict(max_ratio=0.3), dict(budget=BudgetMode.AUTO), dict(guard_margin=None),
                                     dict(guard_ratio=1.0), dict(candidates=None), dict(reused_temperature=1.0),
                                     dict(min_prompt_tokens=10), dict(seed=3), dict(auto_target=0.01)])
def test_a_blend_setting_on_an_exact_or_no_reuse_policy_is_refused_not_ignored(mode, setting):
    name = next(iter(setting))
    with pytest.raises(InvalidPolicyError, match=f"{name} is a blend setting"):
        ReusePolicy(mode=mode, **setting)


def test_exact_and_no_reuse_policies_keep_their_defaults_and_may_carry_force():
    for policy in (ReusePolicy.exact(), ReusePolicy.none(), ReusePolicy.one_pass(), ReusePolicy.exact(prefix_limit=1),
                   ReusePolicy(mode=ReuseMode.EXACT, check_layers=[1], force=True)):
        assert policy.mode is not ReuseMode.BLEND


def test_a_prefix_limit_on_a_blend_is_refused():
    """A blend looks up every document: the limit would be dropped without a word."""
    with pytest.raises(InvalidPolicyError, match="prefix_limit is an exact-reuse setting"):
        ReusePolicy.blend(prefix_limit=1)


@pytest.mark.parametrize("kw", [dict(budget=BudgetMode.AUTO), dict(threshold=0.2)])
def test_a_fixed_ratio_beside_an_adaptive_budget_or_a_threshold_is_refused(kw):
    """Both pick each prompt's share up to max_ratio (0.5 by default): blend(0.3, budget=auto) recomputed up
    to 0.5 and reported nothing about the 0.3."""
    with pytest.raises(InvalidPolicyError, match=r"ratio=0.3 is a fixed budget.*set max_ratio=0.3 instead"):
        ReusePolicy.blend(0.3, "probe", **kw)
    assert ReusePolicy.blend(0.3, "probe", max_ratio=0.3, **kw).max_ratio == 0.3  # the cap, given twice
    assert ReusePolicy.blend(selector="probe", max_ratio=0.3, **kw).max_ratio == 0.3


def test_a_ratio_beside_other_layer_ratios_is_refused():
    """The first check layer recomputes layer_ratios[0]: blend(0.3, layer_ratios=(0.1,)) recomputed 0.1."""
    with pytest.raises(InvalidPolicyError, match=r"ratio=0.3 beside layer_ratios \(0.1,\)"):
        ReusePolicy.blend(0.3, layer_ratios=(0.1,))
    assert ReusePolicy.blend(layer_ratios=(0.1,)).first_ratio == ReusePolicy.blend(0.1, layer_ratios=(0.1,)).first_ratio


def test_a_cap_or_a_target_on_a_fixed_budget_is_refused():
    """A fixed ratio is its own budget: blend(0.4, max_ratio=0.3) recomputed 0.4."""
    with pytest.raises(InvalidPolicyError, match="max_ratio caps an adaptive budget or a threshold"):
        ReusePolicy.blend(0.4, max_ratio=0.3)
    with pytest.raises(InvalidPolicyError, match="auto_target is the stopping target of budget auto"):
        ReusePolicy.blend(0.15, auto_target=0.01)
    with pytest.raises(InvalidPolicyError, match="auto_target is the stopping target of budget auto"):
        ReusePolicy.blend(0.15, threshold=0.1, auto_target=0.01)


def test_the_guards_second_pass_of_an_adaptive_budget_is_a_fixed_budget():
    auto = ReusePolicy.blend(selector="probe", budget=BudgetMode.AUTO, max_ratio=0.2, auto_target=0.01)
    again = auto.at_guard_ratio(0.3)
    assert (again.budget, again.ratio, again.guard_margin) == (BudgetMode.FIXED, 0.3, None)


@pytest.mark.parametrize("setting", [dict(guard_ratio=0.5), dict(guard_ratio=1.0), dict(guard_mode=GuardMode.WIDEN)])
def test_a_guard_setting_without_the_guard_is_refused(setting):
    """guard_ratio and guard_mode only say how a near tie is recomputed: with the guard off (guard_margin None)
    blend(guard_margin=None, guard_ratio=0.5) ran unguarded and said nothing about the 0.5."""
    name = next(iter(setting))
    with pytest.raises(InvalidPolicyError, match=f"{name} is a setting of the near-tie guard, which is off"):
        ReusePolicy.blend(0.15, guard_margin=None, **setting)
    assert getattr(ReusePolicy.blend(0.15, guard_margin=0.7, **setting), name) == setting[name]  # guarded: read
    assert ReusePolicy.blend(0.15, guard_margin=None).guarded is False  # the defaults, unguarded


@pytest.mark.parametrize("selector", ["v", "k", "kv", "lead", "query", "random", "combo", "split"])
@pytest.mark.parametrize("setting", [dict(candidates=None), dict(candidates=4.0),
                                     dict(probe_precision=ProbePrecision.BF16),
                                     dict(probe_precision=ProbePrecision.COMPUTE)])
def test_a_probe_setting_with_a_selector_that_runs_no_probe_is_refused(selector, setting):
    """candidates and probe_precision are the query probe's: selector v with candidates=None or
    probe_precision=bf16 ran exactly as without them."""
    name = next(iter(setting))
    with pytest.raises(InvalidPolicyError, match=f"{name} is a setting of the query probe, which selector "
                                                 f"'{selector}' never runs"):
        ReusePolicy.blend(0.15, selector, **setting)
    assert ReusePolicy.blend(0.15, selector).candidate_share == 1.0  # the defaults stay allowed


@pytest.mark.parametrize("selector", ["probe", "probe_attn"])
def test_the_probe_selectors_take_the_probe_settings(selector):
    p = ReusePolicy.blend(0.15, selector, candidates=None, probe_precision=ProbePrecision.BF16)
    assert p.needs_probe and p.candidates is None and p.probe_precision is ProbePrecision.BF16


def test_the_guards_second_pass_drops_the_guards_own_settings():
    """The second pass is unguarded: it keeps no guard ratio or mode it would refuse (and never read)."""
    p = ReusePolicy.blend(0.15, guard_margin=1e9, guard_ratio=0.4, guard_mode=GuardMode.WIDEN)
    again = p.at_guard_ratio(0.4)
    assert (again.guard_margin, again.guard_ratio, again.guard_mode) == (None, 0.3, GuardMode.RESTART)
    assert again == ReusePolicy.blend(0.4, guard_margin=None)


def test_a_numpy_ratio_runs_and_its_report_is_json(tiny_engine):
    """np.float32(0.15) is a valid ratio; the report carried it as report.ratio, and json.dumps of
    report.to_dict() raised TypeError (float32 is not JSON serializable)."""
    import json

    prompt = tiny_engine.build_prompt("Which?", ["Alpha beta gamma.", "Delta epsilon zeta."])
    for policy in (ReusePolicy.blend(np.float32(0.15), guard_margin=None), ReusePolicy.blend(np.float32(0.15))):
        report = tiny_engine.generate(prompt, policy, max_new_tokens=1).report
        assert type(report.ratio) is float and type(report.spent) is float
        assert json.loads(json.dumps(report.to_dict()))["ratio"] == report.ratio


# ---- the blend-only settings: one list for the policy and kvblend serve's options --------------------------------

SERVE_ONLY_OPTIONS = {"reuse", "stop_at_newline", "return_tokens"}  # kvblend options that are no policy setting


def test_every_kvblend_option_is_a_policy_blend_setting_or_a_serve_option():
    """kvblend serve refuses its blend options under exact or none from the policy's own list: a new option
    must be one of them (or named here as the server's), or it would be dropped without a word."""
    from blend.policy import POLICY_DEFAULTS
    from blend.policy_rules import BLEND_OPTIONS
    from blend.serve.intake import BLEND_SETTINGS
    from blend.serve.schemas import KvblendOptions

    options = set(KvblendOptions.model_fields)
    assert set(BLEND_SETTINGS) == options - SERVE_ONLY_OPTIONS and set(BLEND_SETTINGS) <= set(BLEND_OPTIONS)
    assert set(BLEND_OPTIONS) <= set(POLICY_DEFAULTS)
    for name in BLEND_SETTINGS:  # each option's own default is the policy's (None: the server's default)
        default = KvblendOptions.model_fields[name].default
        want = POLICY_DEFAULTS[name]
        assert default is None or default == getattr(want, "value", want), name


def _serve_value(value):
    """A blend setting's value as kvblend serve's option takes it (an enum by its name)."""
    return value.value if hasattr(value, "value") else value


@pytest.mark.parametrize("mode", ["exact", "none"])
@pytest.mark.parametrize("name, value", [
    ("ratio", 0.3), ("ratio", 0.15), ("selector", "v"), ("selector", "probe"), ("semantic", True), ("semantic", False),
    ("guard_margin", None), ("guard_margin", 0.7), ("guard_margin", 0.0), ("guard_ratio", 1.0), ("guard_ratio", 0.3),
    ("guard_mode", GuardMode.WIDEN), ("guard_mode", GuardMode.RESTART), ("candidates", None), ("candidates", 2.0),
    ("candidates", 3.0), ("probe_precision", ProbePrecision.BF16), ("probe_precision", ProbePrecision.AUTO),
    ("reused_temperature", 1.0), ("reused_temperature", 1.05), ("take_exact", True), ("take_exact", False),
    ("attention_precision", "bf16"), ("attention_precision", "compute"), ("linear_precision", "auto"),
    ("linear_precision", "compute"),
])
def test_kvblend_serve_and_the_policy_refuse_the_same_blend_settings_under_exact_or_none(mode, name, value):
    from blend.policy import RecomputePrecision
    from blend.serve.intake import policy_for
    from blend.serve.schemas import KvblendOptions

    typed = RecomputePrecision(value) if name.endswith("_precision") and name != "probe_precision" else value
    try:
        ReusePolicy(mode=ReuseMode(mode), **{name: typed})
        policy_refuses = False
    except InvalidPolicyError:
        policy_refuses = True
    try:
        policy_for(KvblendOptions(reuse=mode, **{name: _serve_value(value)}), "")
        serve_refuses = False
    except InvalidPolicyError as e:
        serve_refuses = True
        assert "is a blend option" in str(e)
    assert serve_refuses == policy_refuses
