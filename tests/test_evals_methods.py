"""Method spec parsing."""

import re

import pytest

from blend.defaults import DEFAULT_AUTO_TARGET
from blend.evals.methods import MethodError, MethodKind, parse_method, parse_methods, split_specs
from blend.policy import BudgetMode, GuardMode, ProbePrecision


def test_parse_simple_methods():
    assert parse_method("full").kind is MethodKind.FULL
    assert parse_method("prefix").kind is MethodKind.PREFIX
    r = parse_method("reuse")
    assert r.kind is MethodKind.REUSE and r.ratio == 0.0


def test_parse_blend_with_suffixes():
    m = parse_method("blend@0.15:v:check=1,2")
    assert (m.kind, m.ratio, m.selector, m.check_layers) == (MethodKind.BLEND, 0.15, "v", (1, 2))
    assert m.name == "blend@0.15:v:check=1,2" and m.series() == "v check=1,2"
    q = parse_method("blend@0.1:query")
    assert (q.ratio, q.selector, q.check_layers) == (0.1, "query", ())
    d = parse_method("blend@1.0")
    assert d.selector is None and d.canonical == "blend@1" and d.name == "blend@1.0"
    c = parse_method("blend@0.2:check=3:k")
    assert (c.selector, c.check_layers) == ("k", (3,))


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("blend@1.5:v", "ratio must be in [0, 1]"),
        ("blend@-0.1", "ratio must be in [0, 1]"),
        ("blend@x:v", "not a number"),
        ("blend@0.1:bogus", "unknown selector 'bogus'"),
        ("blend@0.1:v:k", "more than one selector"),
        ("blend@0.1:check=a", "must be integers"),
        ("blend@0.1:check=1,1", "distinct"),
        ("blend0.1", "unknown method"),
        ("fulll", "unknown method"),
    ],
)
def test_bad_specs(spec, needle):
    with pytest.raises(MethodError) as e:
        parse_method(spec)
    assert needle in str(e.value) and spec in str(e.value)


def test_split_keeps_check_lists():
    assert split_specs("full, blend@0.15:v:check=1,2,reuse,blend@0.1:query") == [
        "full", "blend@0.15:v:check=1,2", "reuse", "blend@0.1:query"
    ]


def test_parse_methods_full_first_and_duplicates():
    ms = parse_methods("reuse,blend@0.3:v")
    assert [m.name for m in ms] == ["full", "reuse", "blend@0.3:v"]
    assert [m.name for m in parse_methods("reuse,full")] == ["full", "reuse"]
    with pytest.raises(MethodError, match="same method"):
        parse_methods("blend@0.10:v,blend@0.1:v")
    with pytest.raises(MethodError, match="empty"):
        parse_methods(" , ")


def test_probe_precision_in_a_method_spec():
    from blend.policy import ProbePrecision

    m = parse_method("blend@0.15:probe:probe=bf16")
    assert m.canonical == "blend@0.15:probe:probe=bf16" and m.policy().probe_precision is ProbePrecision.BF16
    assert parse_method("blend@0.15:probe").policy().probe_precision is ProbePrecision.AUTO
    for bad in ("blend@0.15:probe=fp8", "blend@0.15:probe=bf16:probe=bf16"):
        with pytest.raises(MethodError):
            parse_method(bad)


def test_guard_in_a_method_spec():
    m = parse_method("blend@0.15:probe:guard=0.5@0.3")
    assert m.guard == (0.5, 0.3) and m.canonical == "blend@0.15:probe:guard=0.5@0.3"
    pol = m.policy()
    assert pol.guard_margin == 0.5 and pol.guard_ratio == 0.3 and pol.guarded
    assert parse_method("blend@0.15:guard=1").policy().guard_margin == 1.0
    off = parse_method("blend@0.15:probe:guard=off")
    assert off.guard == (None, None) and off.policy().guard_margin is None and not off.policy().guarded
    assert "guard=off" in off.series()
    for bad in ("blend@0.15:guard=x", "blend@0.15:guard=-1", "blend@0.15:guard=1@2", "blend@0.1:guard=1:guard=2"):
        with pytest.raises(MethodError):
            parse_method(bad)


def test_auto_target_in_a_method_spec():
    m = parse_method("blend@0.3:probe:auto=0.006")
    pol = m.policy()
    assert m.auto and m.auto_target == 0.006 and m.canonical == "blend@0.3:probe:auto=0.006"
    assert pol.budget is BudgetMode.AUTO and pol.auto_target == 0.006 and pol.max_ratio == 0.3
    assert "auto=0.006" in m.series() and m.to_dict()["auto_target"] == 0.006
    plain = parse_method("blend@0.3:probe:auto")
    assert plain.auto_target is None and plain.policy().auto_target == DEFAULT_AUTO_TARGET
    for bad in ("blend@0.3:auto=x", "blend@0.3:auto=0", "blend@0.3:auto=-1", "blend@0.3:auto=nan",
                "blend@0.3:auto:auto=0.1"):
        with pytest.raises(MethodError):
            parse_method(bad)


def test_a_method_round_trips_through_its_json_and_plots_under_its_own_series():
    """The plot rebuilt a method from its JSON by hand and dropped its guard mode: a `gmode=widen` blend was drawn
    on the same line as the default one."""
    import dataclasses

    from blend.evals.methods import Method, parse_methods
    from blend.evals.plot import series

    for spec in ("blend@0.15:probe:guard=0.7@0.3:gmode=widen", "blend@0.3:v:check=1,2", "reuse", "full",
                 "blend@0.15:probe:cand=off:temp=1.05", "blend@0.3:auto=0.04:probe=bf16"):
        m = next(x for x in parse_methods(spec) if x.name == spec)
        assert Method.from_dict(m.to_dict(), name=m.name) == dataclasses.replace(m, canonical="")  # (not in the JSON)
    two = [m for m in parse_methods("blend@0.15:probe:guard=0.7@0.3,blend@0.15:probe:guard=0.7@0.3:gmode=widen")
           if m.kind.value == "blend"]
    lines = series({m.name: {"spec": m.to_dict()} for m in two})
    assert len(lines) == 2


@pytest.mark.parametrize("spec, needle", [
    ("blend@0.15:probe:guard=off:gmode=widen", "gmode= says how the near-tie guard recomputes"),
    ("blend@0.15:guard=off:gmode=restart", "guard=off turns the guard off"),  # explicit, even at its default
    ("blend@0.15:v:cand=4", "cand= set the query probe, which selector 'v' never runs"),
    ("blend@0.15:combo:cand=off", "selector 'combo' never runs"),
    ("blend@0.15:k:probe=bf16", "probe= set the query probe"),
    ("blend@0.15:lead:cand=2:probe=auto", "cand= and probe= set the query probe"),
    # whatever else the policy refuses is refused when the spec is parsed, not when its run starts
    ("blend@0.3:v:auto", "the adaptive budget ranks rows by the probe score"),
])
def test_a_spec_part_the_blend_would_not_read_is_refused(spec, needle):
    """blend@0.15:probe:guard=off:gmode=widen ran unguarded and was labelled gmode=widen in the results;
    blend@0.15:v:cand=4 ran the v selector exactly as without cand=4."""
    with pytest.raises(MethodError, match=re.escape(f"method '{spec}': ")) as e:
        parse_method(spec)
    assert needle in str(e.value)
    with pytest.raises(MethodError, match=re.escape(needle)):  # a --methods list: the same error
        parse_methods(f"full,{spec}")


def test_the_probe_and_guard_parts_stay_with_what_reads_them():
    """Beside the guard, or beside a selector that runs the probe (the default selector, probe, included),
    each part reaches the policy."""
    assert parse_method("blend@0.15:probe:guard=off").policy().guarded is False
    widen = parse_method("blend@0.15:guard=0.7@0.5:gmode=widen").policy()
    assert (widen.guard_ratio, widen.guard_mode) == (0.5, GuardMode.WIDEN)
    assert parse_method("blend@0.15:cand=off").policy().candidates is None
    attn = parse_method("blend@0.15:probe_attn:cand=3:probe=bf16").policy()
    assert (attn.candidates, attn.probe_precision) == (3.0, ProbePrecision.BF16)
    auto = parse_method("blend@0.3:probe:auto:cand=2").policy()
    assert (auto.budget, auto.max_ratio, auto.candidates) == (BudgetMode.AUTO, 0.3, 2.0)
    assert parse_method("blend@0.15:v:guard=off").policy().selector == "v"
