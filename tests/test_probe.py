"""Query-probed selection (issue 14): the scoring math, the probe selector and the adaptive budget."""

import math
from dataclasses import replace

import pytest
import torch

from blend import probe as P
from blend.policy import BudgetMode, GuardMode, ReusePolicy
from blend.report import ReuseClass
from blend.selectors import SelectionInputs, select, select_auto
from conftest import make_docs, unguarded, unguarded_blend


@pytest.fixture
def probe_seen(monkeypatch):
    """The blend's query probe, spied: the returned dict holds the last ProbeResult under "probe"."""
    import blend.blending as B

    seen: dict = {}
    for name in ("run_probe", "run_probe_first"):  # at the check layer, or first (candidates)
        real = getattr(B, name)

        def spy_probe(*a, _real=real, _name=name, **kw):
            seen["probe"] = _real(*a, **kw)
            seen["calls"] = seen.get("calls", []) + [_name]
            return seen["probe"]

        monkeypatch.setattr(B, name, spy_probe)
    return seen


def test_probe_weight_mean_max_and_skip():
    attn = torch.tensor([[0.1, 0.5], [0.3, 0.1], [0.2, 0.0]])  # (L'=3, N=2)
    assert torch.allclose(P.probe_weight(attn), torch.tensor([0.2, 0.2]))
    assert torch.allclose(P.probe_weight(attn, reduce=P.LayerReduce.MAX), torch.tensor([0.3, 0.5]))
    assert torch.allclose(P.probe_weight(attn, first=1), torch.tensor([0.25, 0.05]))
    with pytest.raises(ValueError):
        P.probe_weight(attn, first=3)


def test_dilate_stays_inside_a_document():
    score = torch.tensor([0.0, 0.0, 5.0, 0.0, 1.0, 0.0])
    doc = torch.tensor([0, 0, 0, 1, 1, 1])
    out = P.dilate(score, doc, 1)
    # row 3 is next to row 2 but in another document: it keeps its own neighbourhood (row 4)
    assert out[1] == pytest.approx(5.0) and out[3] == pytest.approx(1.0) and out[0] == pytest.approx(0.0)
    assert out[2] > out[1]  # the centre keeps its own score as a tie-break
    assert torch.equal(P.dilate(score, doc, 0), score)


def test_doc_budgets_follow_mass_and_respect_sizes():
    counts = torch.tensor([10, 10, 2])
    b = P.doc_budgets(torch.tensor([0.6, 0.2, 0.2]), counts, 10)
    assert int(b.sum()) == 10 and b[0] > b[1] and b[2] <= 2
    capped = P.doc_budgets(torch.tensor([0.0, 0.0, 1.0]), counts, 6)  # doc 2 holds 2 rows: the rest spills over
    assert int(capped.sum()) == 6 and capped[2] == 2
    assert int(P.doc_budgets(torch.tensor([1.0, 1.0, 1.0]), counts, 99).sum()) == 22
    even = P.doc_budgets(torch.tensor([1.0, 0.0, 0.0]), torch.tensor([4, 4, 4]), 6, floor=1.0)
    assert even.tolist() == [2, 2, 2]


def test_select_by_doc_and_sinks():
    score = torch.tensor([0.1, 0.9, 0.5, 0.8, 0.7, 0.2])
    doc = torch.tensor([0, 0, 0, 1, 1, 1])
    assert P.select_by_doc(score, doc, torch.tensor([1, 2])).tolist() == [1, 3, 4]
    offset = torch.tensor([0, 1, 2, 0, 1, 2])
    assert P.with_sinks(torch.tensor([4]), offset, 1).tolist() == [0, 3, 4]


def test_stop_count_and_residual():
    score = torch.tensor([0.5, 0.1, 0.3, 0.1])  # sorted: 0.5 0.3 0.1 0.1; left-over 1.0 .5 .2 .1 0
    assert float(P.residual(score, 2)) == pytest.approx(0.2)
    assert P.stop_count(score, 0.25, 0, 4) == 2
    assert P.stop_count(score, 0.0, 0, 4) == 4
    assert P.stop_count(score, 0.0, 0, 3) == 3  # capped
    assert P.stop_count(score, 5.0, 1, 4) == 1  # floor


def _inputs(n=8):
    g = torch.Generator().manual_seed(0)
    dev = torch.rand(n, generator=g)
    return SelectionInputs(dev, dev, dev, torch.zeros(n, dtype=torch.long), torch.arange(n), None,
                           probe_attn=torch.rand(n, generator=g), v_norm=torch.ones(n))


def test_probe_selector_ranks_probe_attention_times_v_deviation():
    inp = _inputs()
    picked = select("probe", inp, 3)
    assert picked.tolist() == sorted(torch.argsort(inp.probe_attn * inp.dev_v, descending=True)[:3].tolist())
    with pytest.raises(ValueError, match="probe"):
        select("probe", SelectionInputs(inp.dev_k, inp.dev_v, inp.rel_v, inp.doc, inp.offset, None), 3)


def test_select_auto_stops_at_the_target():
    inp = _inputs()
    assert select_auto(inp, 0.0, 5).numel() == 5  # never met: the cap
    assert select_auto(inp, 1e9, 5).numel() == 0
    s = torch.sort(inp.probe_attn * inp.dev_v, descending=True).values
    k = select_auto(inp, float(s[3:].double().sum()) + 1e-6, 8).numel()
    assert k == 3


def test_probe_selector_limits_and_cold_equals_warm(tiny_engine_factory):
    eng = tiny_engine_factory()
    prompt = eng.build_prompt("Which?", make_docs(4))
    full = eng.generate(prompt, ReusePolicy.none(), max_new_tokens=1)
    one = eng.generate(prompt, unguarded_blend(1.0, "probe"), max_new_tokens=1)
    assert (one.first_logits - full.first_logits).abs().max() <= 1e-4
    cold = eng.generate(prompt, unguarded_blend(0.2, "probe"), max_new_tokens=1)
    warm = eng.generate(prompt, unguarded_blend(0.2, "probe"), max_new_tokens=1)
    fresh = tiny_engine_factory().generate(prompt, unguarded_blend(0.2, "probe"), max_new_tokens=1)
    assert torch.equal(cold.first_logits, warm.first_logits) and torch.equal(cold.first_logits, fresh.first_logits)
    base = sum(len(d) for d in prompt.documents)
    assert cold.report.recomputed_tokens == round(0.2 * base)


def test_the_probe_sees_every_layer_above_the_check_and_drives_the_selection(tiny_engine, monkeypatch,
                                                                              probe_seen):
    """The probe's attention has one row per layer from the check layer up, is a share of the
    question's attention, and the probe selector keeps exactly the top rows of weight x dV."""
    import blend.blending as B
    from blend.selectors import SelectionInputs as SI

    seen = probe_seen
    real_select = B.select

    def spy_select(name, inp: SI, budget):
        seen["inp"], seen["picked"] = inp, real_select(name, inp, budget)
        return seen["picked"]

    monkeypatch.setattr(B, "select", spy_select)
    prompt = tiny_engine.build_prompt("Which one?", make_docs(4))
    ans = tiny_engine.generate(prompt, unguarded_blend(0.25, "probe", candidates=None), max_new_tokens=1)
    pr, inp = seen["probe"], seen["inp"]
    nb = sum(len(d) for d in prompt.documents[1:])  # doc 1 is exact at its canonical place
    assert pr.attn.shape == (tiny_engine.dims.num_layers - 1, nb)  # check layer 1 .. the top
    assert bool((pr.attn >= 0).all()) and bool((pr.attn.sum(dim=1) <= 1 + 1e-5).all())
    assert pr.entropy is None  # a fixed budget never reads it: the probe skips the LM head
    want = P.top(pr.weight * inp.dev_v, round(0.25 * sum(len(d) for d in prompt.documents)))
    assert torch.equal(torch.sort(want).values, seen["picked"])
    assert ans.report.recomputed_tokens == seen["picked"].numel()


def test_the_probe_shortcut_above_the_check_layer_changes_no_bit(tiny_engine, monkeypatch):
    """Above the check layer the blend writes only its recomputed rows (the probe left the cached
    rows re-positioned); writing every row again, as without the probe, gives the same logits."""
    import blend.blending as B

    prompt = tiny_engine.build_prompt("Which one?", make_docs(4))
    fast = tiny_engine.generate(prompt, unguarded_blend(0.25, "probe"), max_new_tokens=1)
    # a class property that ignores the assignment: probed_at stays None, so every row is written
    monkeypatch.setattr(B.BlendRows, "probed_at", property(lambda _: None, lambda _s, _v: None), raising=False)
    slow = tiny_engine.generate(prompt, unguarded_blend(0.25, "probe"), max_new_tokens=1)
    assert torch.equal(fast.first_logits, slow.first_logits)


def test_auto_budget_reports_the_ratio_it_chose(tiny_engine):
    prompt = tiny_engine.build_prompt("Which?", make_docs(4))
    base = sum(len(d) for d in prompt.documents)
    cap = unguarded_blend(0.15, "probe", budget=BudgetMode.AUTO, max_ratio=0.3, auto_target=0.0)
    a = tiny_engine.generate(prompt, cap, max_new_tokens=1)
    assert a.report.recomputed_tokens == round(0.3 * base) and a.report.ratio == pytest.approx(
        round(0.3 * base) / base)
    loose = tiny_engine.generate(prompt, unguarded_blend(0.15, "probe", budget=BudgetMode.AUTO, auto_target=1e9),
                                 max_new_tokens=1)
    assert loose.report.recomputed_tokens == 0 and loose.report.ratio == 0.0
    mid = unguarded_blend(0.15, "probe", budget=BudgetMode.AUTO, max_ratio=0.3, auto_target=1e-3)
    got = tiny_engine.generate(prompt, mid, max_new_tokens=1).report.recomputed_tokens
    assert 0 <= got <= round(0.3 * base)


@pytest.mark.parametrize("kw", [dict(auto_target=-1.0), dict(auto_target=float("nan")), dict(budget="auto")])
def test_policy_rejects_bad_auto_settings(kw):
    from blend.errors import InvalidPolicyError

    with pytest.raises(InvalidPolicyError):
        ReusePolicy.blend(0.15, "probe", **kw)


def test_entropy_and_sensitivity():
    assert P.entropy(torch.zeros(4)) == pytest.approx(float(torch.log(torch.tensor(4.0))))
    assert P.entropy(torch.tensor([100.0, 0.0, 0.0])) == pytest.approx(0.0, abs=1e-6)
    inp = _inputs()
    s = torch.sort(inp.probe_attn * inp.dev_v, descending=True).values.double()
    t = float(s[3:].sum()) + 1e-6
    assert select_auto(inp, t, 8).numel() == 3
    assert select_auto(inp, 2 * t, 8, sensitivity=2.0).numel() == 3  # the estimate scales with the entropy
    assert select_auto(inp, t, 8, sensitivity=2.0).numel() > 3


def test_the_cli_exposes_the_adaptive_budget():
    from blend.cli import build_parser
    from blend.options import policy_from_args

    args = build_parser("ask").parse_args(["ask", "q", "--doc", "d", "--reuse", "blend", "--budget", "auto",
                                           "--max-ratio", "0.3", "--auto-target", "0.01"])
    pol = policy_from_args(args)
    assert pol.budget is BudgetMode.AUTO and pol.max_ratio == 0.3 and pol.auto_target == 0.01
    assert pol.selector == "probe" and pol.needs_probe  # the default selector
    assert "auto(0.01)<=0.3" in pol.describe()


def test_the_adaptive_budget_gets_the_probe_entropy(tiny_engine, probe_seen):
    from blend.policy import BudgetMode

    seen = probe_seen
    prompt = tiny_engine.build_prompt("Which one?", make_docs(4))
    tiny_engine.generate(prompt, unguarded_blend(0.3, "probe", budget=BudgetMode.AUTO, max_ratio=0.3),
                         max_new_tokens=1)
    assert 0.0 <= seen["probe"].entropy <= math.log(tiny_engine.dims.vocab) + 1e-6


def test_a_bf16_probe_only_ranks_rows(tiny_engine, monkeypatch):
    """probe=bf16 runs the probe's GEMMs on a bf16 copy of the weights; the blend's own pass stays
    in the compute dtype: at ratio 1.0 (every row recomputed whatever the ranking) the logits are
    bit-identical to the compute-dtype probe's, and only the probe ever sees bf16 weights."""
    import blend.model as M
    import blend.probe_pass as probe_pass
    from blend.policy import ProbePrecision

    runner = tiny_engine.runner
    assert runner.layers_in(runner.dtype) is runner.layers
    bf = runner.layers_in(torch.bfloat16)
    assert bf is runner.layers_in(torch.bfloat16)  # made once
    assert bf[0].w_qkv.dtype == torch.bfloat16 and bf[0].input_norm.dtype == runner.dtype
    calls = []
    real = M.layer_forward

    def spy(w, *a, **kw):
        calls.append(w.w_qkv.dtype)
        return real(w, *a, **kw)

    real_top = M.layer_attention_only

    def spy_top(w, *a, **kw):
        calls.append(w.w_qkv.dtype)
        return real_top(w, *a, **kw)

    monkeypatch.setattr(M, "layer_forward", spy)
    monkeypatch.setattr(probe_pass, "layer_attention_only", spy_top)  # the probe's top layer: attention only
    prompt = tiny_engine.build_prompt("Which one?", make_docs(4))
    full = tiny_engine.generate(prompt, unguarded_blend(1.0, "probe", probe_precision=ProbePrecision.COMPUTE),
                                max_new_tokens=1)  # the default (auto) is bf16 on some CPUs
    calls.clear()
    half = tiny_engine.generate(prompt, unguarded_blend(1.0, "probe", probe_precision=ProbePrecision.BF16),
                                max_new_tokens=1)
    assert torch.equal(full.first_logits, half.first_logits)
    layers = tiny_engine.dims.num_layers
    assert calls.count(torch.bfloat16) == layers  # the probe, first (candidates): layer 0 .. the top
    assert calls.count(runner.dtype) == layers  # the blend's own pass
    low = tiny_engine.generate(prompt, unguarded_blend(0.25, "probe", probe_precision=ProbePrecision.BF16),
                               max_new_tokens=1)
    assert bool(torch.isfinite(low.first_logits).all()) and ":probe=bf16" in low.report.policy


def test_top2_margin():
    assert P.top2_margin(torch.tensor([3.0, 1.0, 2.5])) == pytest.approx(0.5)
    assert P.top2_margin(torch.tensor([0.0, 0.0])) == 0.0


def test_the_near_tie_guard_recomputes_only_under_its_margin(tiny_engine):
    """Every blend reports its first-token gap; under guard_margin the request is recomputed: at
    guard_ratio 1.0 by the exact path (preamble and first document shared: bit-identical to
    exact reuse with prefix_limit=2, which is bit-identical to its own cold run), else by a blend at that
    ratio (bit-identical to asking for it outright). TTFT covers both passes."""
    prompt = tiny_engine.build_prompt("Which one?", make_docs(4))
    plain = tiny_engine.generate(prompt, unguarded_blend(0.15, "probe"), max_new_tokens=1)
    gap = plain.report.first_token_margin
    assert gap is not None and gap >= 0 and plain.report.guard == ""
    assert gap == pytest.approx(P.top2_margin(plain.first_logits), abs=1e-12)
    full = tiny_engine.generate(prompt, ReusePolicy.exact(prefix_limit=2), max_new_tokens=1)
    hit = tiny_engine.generate(prompt, ReusePolicy.blend(0.15, "probe", guard_margin=gap + 1.0, guard_ratio=1.0),
                               max_new_tokens=1)
    assert torch.equal(hit.first_logits, full.first_logits)
    assert hit.report.ratio == 1.0 and "recomputed at ratio 1" in hit.report.guard
    assert [s.reuse_class for s in hit.report.segments][:3] == [ReuseClass.EXACT, ReuseClass.EXACT,
                                                                 ReuseClass.COMPUTED]  # doc 1 reused
    again = tiny_engine.generate(prompt, unguarded_blend(0.15, "probe"), max_new_tokens=1)  # nothing stored:
    assert torch.equal(again.first_logits, plain.first_logits)  # a later blend of this order still blends
    assert hit.report.first_token_margin == pytest.approx(gap) and hit.report.to_dict()["guard"] == hit.report.guard
    assert ":guard=" in hit.report.policy and hit.report.timings.ttft_s > 0
    mid = tiny_engine.generate(prompt, ReusePolicy.blend(0.15, "probe", guard_margin=gap + 1.0, guard_ratio=0.4),
                               max_new_tokens=1)
    at_ratio = tiny_engine.generate(prompt, unguarded_blend(0.4, "probe"), max_new_tokens=1)
    assert torch.equal(mid.first_logits, at_ratio.first_logits) and mid.report.ratio == 0.4
    miss = tiny_engine.generate(prompt, ReusePolicy.blend(0.15, "probe", guard_margin=gap / 2), max_new_tokens=1)
    assert miss.report.guard == "" and miss.report.ratio == 0.15
    assert torch.equal(miss.first_logits, plain.first_logits)


def test_the_guard_answers_from_the_recomputed_cache(tiny_engine):
    """A guarded request decodes from the recompute's cache: its whole answer equals exact reuse's."""
    prompt = tiny_engine.build_prompt("Which one?", make_docs(4))
    guarded = ReusePolicy.blend(0.15, "probe", guard_margin=1e9, guard_ratio=1.0)
    cold = tiny_engine.generate(prompt, guarded, max_new_tokens=6, stop_at_newline=False)
    full = tiny_engine.generate(prompt, ReusePolicy.exact(prefix_limit=2), max_new_tokens=6, stop_at_newline=False)
    hit = tiny_engine.generate(prompt, guarded, max_new_tokens=6, stop_at_newline=False)
    assert hit.token_ids == full.token_ids and hit.report.guard
    # the cold request blended chunks it computed canonically just before: it guards as the warm one does
    assert cold.report.guard == hit.report.guard and cold.token_ids == hit.token_ids
    assert torch.equal(cold.first_logits, hit.first_logits)
    # its report still says which chunks this request computed, though the recompute found them stored
    assert ReuseClass.COMPUTED in [s.reuse_class for s in cold.report.segments[2:-1]]
    assert ReuseClass.COMPUTED not in [s.reuse_class for s in hit.report.segments[:2]]


def test_a_guard_ratio_at_or_below_the_blends_takes_the_exact_path(tiny_engine):
    """The guard never answers a near tie with the budget it already had (or less): a guard ratio at or
    below the blend's own runs the exact path; an adaptive budget's redo runs at the fixed guard ratio."""
    prompt = tiny_engine.build_prompt("Which one?", make_docs(4))
    full = tiny_engine.generate(prompt, ReusePolicy.exact(prefix_limit=2), max_new_tokens=1)
    for ratio in (0.3, 0.4):
        ans = tiny_engine.generate(prompt, ReusePolicy.blend(ratio, "probe", guard_margin=1e9, guard_ratio=0.3),
                                   max_new_tokens=1)
        assert ans.report.ratio == 1.0 and torch.equal(ans.first_logits, full.first_logits)
    assert ReusePolicy.blend(0.15).guard_ratio_for(0.15) == 0.3
    # a threshold blend is judged by the share it selected: all it may (0.5) -> the exact path ...
    capped = ReusePolicy.blend(0.15, "probe", threshold=0.0, max_ratio=0.5, guard_margin=1e9, guard_ratio=0.3)
    assert tiny_engine.generate(prompt, capped, max_new_tokens=1).report.ratio == 1.0
    # ... none -> blended again at the guard ratio (from the start here: tests/test_guard_widen.py has the rest)
    idle = ReusePolicy.blend(0.15, "probe", threshold=1e9, max_ratio=0.5, guard_margin=1e9, guard_ratio=0.3,
                             guard_mode=GuardMode.RESTART)
    again = tiny_engine.generate(prompt, idle, max_new_tokens=1)
    at_guard = tiny_engine.generate(prompt, unguarded_blend(0.3, "probe"), max_new_tokens=1)
    assert again.report.ratio == 0.3 and torch.equal(again.first_logits, at_guard.first_logits)
    assert ReusePolicy.blend(0.15).guard_ratio_for(0.3) == 1.0
    auto = ReusePolicy.blend(0.15, "probe", budget=BudgetMode.AUTO, max_ratio=0.2, auto_target=1e9,
                             guard_margin=1e9, guard_ratio=0.4, guard_mode=GuardMode.RESTART)
    redo = tiny_engine.generate(prompt, auto, max_new_tokens=1)
    at = tiny_engine.generate(prompt, unguarded_blend(0.4, "probe"), max_new_tokens=1)
    assert redo.report.ratio == 0.4 and torch.equal(redo.first_logits, at.first_logits)
    # what it spent counts both passes: the budget's own choice, then the guard's 0.4
    first = tiny_engine.generate(prompt, unguarded(auto), max_new_tokens=1).report.ratio
    assert redo.report.spent == pytest.approx(first + 0.4) and redo.report.to_dict()["spent"] == redo.report.spent
    assert at.report.spent == at.report.ratio == 0.4  # unguarded: the one pass
    assert tiny_engine.generate(prompt, ReusePolicy.exact(), max_new_tokens=1).report.spent is None


@pytest.mark.parametrize("mode", [GuardMode.RESTART, GuardMode.WIDEN])
def test_explicit_layer_ratios_are_what_a_blend_runs_reports_and_guards_from(tiny_engine, mode):
    """``layer_ratios`` overrides ``ratio`` at the check layers: a blend given ``layer_ratios=(0.1,)`` is
    the blend at 0.1, reports 0.1, and its guard recomputes at the guard ratio (the blend at 0.3, bit for
    bit, in either mode), not again at the 0.1 its layer ratios said, counting 0.1 + 0.3 as spent."""
    prompt = tiny_engine.build_prompt("Which one?", make_docs(4))
    at_01 = tiny_engine.generate(prompt, unguarded_blend(0.1, "probe", candidates=None), max_new_tokens=1)
    told = tiny_engine.generate(prompt, unguarded_blend(0.15, "probe", candidates=None, layer_ratios=(0.1,)),
                                max_new_tokens=1)
    assert torch.equal(told.first_logits, at_01.first_logits) and told.report.ratio == 0.1
    at_03 = tiny_engine.generate(prompt, unguarded_blend(0.3, "probe", candidates=None), max_new_tokens=1)
    guarded = ReusePolicy.blend(0.15, "probe", candidates=None, layer_ratios=(0.1,), guard_margin=1e9,
                                guard_ratio=0.3, guard_mode=mode)
    redo = tiny_engine.generate(prompt, guarded, max_new_tokens=1)
    assert torch.equal(redo.first_logits, at_03.first_logits) and "recomputed at ratio 0.3" in redo.report.guard
    assert redo.report.spent == pytest.approx(0.1 + redo.report.ratio)
    # a first check already at the guard ratio: the exact path, whatever ``ratio`` says
    up = replace(guarded, layer_ratios=(0.3,))
    assert tiny_engine.generate(prompt, up, max_new_tokens=1).report.ratio == 1.0
    # several check layers: the guard's blend keeps the guard ratio at every one (no narrowing below it)
    two = ReusePolicy.blend(0.15, "probe", check_layers=(1, 2), layer_ratios=(0.15, 0.1), guard_margin=1e9,
                            guard_ratio=0.3, guard_mode=mode)
    flat = tiny_engine.generate(prompt, unguarded_blend(0.3, "probe", check_layers=(1, 2)), max_new_tokens=1)
    assert torch.equal(tiny_engine.generate(prompt, two, max_new_tokens=1).first_logits, flat.first_logits)
    assert two.at_guard_ratio(0.3) == unguarded_blend(0.3, "probe", check_layers=(1, 2))  # the guard's mode reset
    assert told.report.policy.startswith("blend@0.1:") and ReusePolicy.blend(layer_ratios=(0.15,)).describe() \
        .startswith("blend@0.15:") and "blend@0.15,0.1:" in two.describe()


def test_the_guard_is_on_by_default_and_never_fires_on_exact_results(tiny_engine):
    from blend.defaults import DEFAULT_GUARD_MARGIN, DEFAULT_GUARD_RATIO

    default = ReusePolicy.blend(0.15)
    assert default.guarded and (default.guard_margin, default.guard_ratio) == (DEFAULT_GUARD_MARGIN,
                                                                               DEFAULT_GUARD_RATIO) == (0.7, 0.3)
    assert not unguarded_blend(0.15).guarded and not ReusePolicy.exact(cache_salt="").guarded
    one = tiny_engine.build_prompt("Which one?", make_docs(1))  # doc 1 at its canonical place: exact
    ans = tiny_engine.generate(one, ReusePolicy.blend(0.15, "probe", guard_margin=1e9), max_new_tokens=1)
    assert ans.report.guard == ""


@pytest.mark.parametrize("kw", [dict(guard_margin=-1.0), dict(guard_margin=float("nan")), dict(guard_ratio=1.5),
                                dict(guard_margin="1")])
def test_policy_rejects_bad_guard_settings(kw):
    from blend.errors import InvalidPolicyError

    with pytest.raises(InvalidPolicyError):
        ReusePolicy.blend(0.15, "probe", **kw)


def test_the_cli_exposes_the_guard():
    from blend.cli import build_parser
    from blend.options import policy_from_args

    base = ["ask", "q", "--doc", "d", "--reuse", "blend"]
    pol = policy_from_args(build_parser("ask").parse_args(base + ["--guard-margin", "0.7", "--guard-ratio", "0.25"]))
    assert pol.guard_margin == 0.7 and pol.guard_ratio == 0.25 and pol.guarded
    off = policy_from_args(build_parser("ask").parse_args(base + ["--guard-margin", "off"]))
    assert off.guard_margin is None and not off.guarded


def test_probe_attn_ranks_by_the_probe_alone_and_works_at_check_layer_zero(tiny_engine, probe_seen):
    """probe_attn keeps the rows the question reads most at depth (no V deviation): at check layer 0
    fresh and cached V are the same numbers, so no row is computed in full before selecting; ratio
    1.0 there is full prefill."""
    seen = probe_seen
    prompt = tiny_engine.build_prompt("Which one?", make_docs(4))
    tiny_engine.generate(prompt, unguarded_blend(0.15, "probe"), max_new_tokens=1)  # warm the chunks
    ans = tiny_engine.generate(prompt, unguarded_blend(0.25, "probe_attn", check_layers=0), max_new_tokens=1)
    pr = seen["probe"]
    assert pr.attn.shape[0] == tiny_engine.dims.num_layers  # probed from layer 0
    budget = round(0.25 * sum(len(d) for d in prompt.documents))
    want = torch.sort(P.top(pr.weight, budget)).values
    picked, lo = [], 0
    for seg in ans.report.segments[2:-1]:  # the blended documents (doc 1 is exact), in order
        picked += [lo + o for o in seg.recomputed_offsets]
        lo += seg.tokens
    assert picked == want.tolist()
    full = tiny_engine.generate(prompt, ReusePolicy.none(), max_new_tokens=1)
    one = tiny_engine.generate(prompt, unguarded_blend(1.0, "probe_attn", check_layers=0), max_new_tokens=1)
    torch.testing.assert_close(one.first_logits, full.first_logits, rtol=0, atol=1e-4)


def _select_spy(monkeypatch) -> dict:
    """The blend's selector, spied: the dict holds the last call's inputs and picks."""
    import blend.blending as B

    seen: dict = {}
    real_select = B.select

    def spy(name, inp, budget):
        seen["inp"], seen["budget"], seen["picked"] = inp, budget, real_select(name, inp, budget)
        return seen["picked"]

    monkeypatch.setattr(B, "select", spy)
    return seen


def test_candidates_compute_only_the_rows_the_question_reads_most(tiny_engine, monkeypatch, probe_seen):
    """With candidates F the probe runs first (once, from layer 0); only the F x budget document rows
    with the largest probe weight reach the check layer, and the selector picks its budget among them."""
    sel = _select_spy(monkeypatch)
    prompt = tiny_engine.build_prompt("Which one?", make_docs(4))
    base = sum(len(d) for d in prompt.documents)
    budget = round(0.15 * base)
    ans = tiny_engine.generate(prompt, unguarded_blend(0.15, "probe", candidates=2.0), max_new_tokens=1)
    assert probe_seen["calls"] == ["run_probe_first"]
    pr, inp = probe_seen["probe"], sel["inp"]
    nb = sum(len(d) for d in prompt.documents[1:])  # doc 1 is exact at its canonical place
    assert pr.attn.shape == (tiny_engine.dims.num_layers - 1, nb)  # the same layers as the probe at the check
    assert inp.dev_v.numel() == math.ceil(2.0 * budget) < nb  # the candidates, not every row
    cand = torch.sort(P.top(pr.weight, math.ceil(2.0 * budget))).values  # rows relative to e
    assert torch.equal(inp.probe_attn, pr.weight[cand])
    assert torch.equal(sel["picked"], torch.sort(P.top(pr.weight[cand] * inp.dev_v, budget)).values)
    assert ans.report.recomputed_tokens == budget
    assert ":cand=2" in ans.report.policy


def test_a_candidates_deviation_is_the_one_measured_over_every_row(tiny_engine, monkeypatch, probe_seen):
    """Layer 0's cached KV is exact (it depends on the token and its position only), so a
    candidate's V deviation at check layer 1 is the same number, to float rounding, as when every
    row was computed through layer 0."""
    sel = _select_spy(monkeypatch)
    prompt = tiny_engine.build_prompt("Which one?", make_docs(4))
    tiny_engine.generate(prompt, unguarded_blend(0.1, "probe", candidates=None), max_new_tokens=1)
    every = sel["inp"].dev_v  # (nb,) every blended row was computed through layer 0
    tiny_engine.generate(prompt, unguarded_blend(0.1, "probe", candidates=1.5), max_new_tokens=1)
    budget = round(0.1 * sum(len(d) for d in prompt.documents))
    cand = torch.sort(P.top(probe_seen["probe"].weight, math.ceil(1.5 * budget))).values  # (C,) relative to e
    assert sel["inp"].dev_v.numel() == cand.numel() < every.numel()
    torch.testing.assert_close(sel["inp"].dev_v, every[cand], rtol=1e-5, atol=1e-5)


def test_candidates_keep_the_invariants(tiny_engine_factory):
    """Ratio 1.0 is full prefill; cold equals warm and a fresh engine bit for bit; the guard and the
    adaptive budget run on top of it (the budget's cap sets the candidate count)."""
    eng = tiny_engine_factory()
    prompt = eng.build_prompt("Which?", make_docs(4))
    full = eng.generate(prompt, ReusePolicy.none(), max_new_tokens=1)
    one = eng.generate(prompt, unguarded_blend(1.0, "probe", candidates=2.0), max_new_tokens=1)
    torch.testing.assert_close(one.first_logits, full.first_logits, rtol=0, atol=1e-4)
    pol = unguarded_blend(0.2, "probe", candidates=2.0)
    cold = eng.generate(prompt, pol, max_new_tokens=1)
    warm = eng.generate(prompt, pol, max_new_tokens=1)
    fresh = tiny_engine_factory().generate(prompt, pol, max_new_tokens=1)
    assert torch.equal(cold.first_logits, warm.first_logits) and torch.equal(cold.first_logits, fresh.first_logits)
    auto = eng.generate(prompt, unguarded_blend(0.3, "probe", budget=BudgetMode.AUTO, max_ratio=0.3,
                                                  auto_target=0.0, candidates=2.0), max_new_tokens=1)
    base = sum(len(d) for d in prompt.documents)
    assert auto.report.recomputed_tokens == min(round(0.3 * base), sum(len(d) for d in prompt.documents[1:]))
    # a selector without the probe ignores the factor: the same bits as without it
    v = eng.generate(prompt, unguarded_blend(0.2, "v"), max_new_tokens=1)
    v2 = eng.generate(prompt, unguarded_blend(0.2, "v", candidates=2.0), max_new_tokens=1)
    assert torch.equal(v.first_logits, v2.first_logits) and ":cand" not in v2.report.policy


@pytest.mark.parametrize("bad", [0.5, 0.0, -1.0, float("nan")])
def test_policy_rejects_a_candidate_factor_under_one(bad):
    from blend.errors import InvalidPolicyError

    with pytest.raises(InvalidPolicyError):
        unguarded_blend(0.15, "probe", candidates=bad)


def test_the_cli_the_api_and_the_harness_expose_candidates():
    from blend.cli import build_parser
    from blend.defaults import DEFAULT_CANDIDATES
    from blend.evals.methods import MethodError, parse_method
    from blend.options import policy_from_args
    from blend.serve.intake import policy_for
    from blend.serve.schemas import KvblendOptions

    base = ["ask", "q", "--doc", "d", "--reuse", "blend"]
    assert policy_from_args(build_parser("ask").parse_args(base + ["--candidates", "3"])).candidates == 3.0
    assert policy_from_args(build_parser("ask").parse_args(base + ["--candidates", "off"])).candidates is None
    with pytest.raises(SystemExit):
        build_parser("ask").parse_args(base + ["--candidates", "0.5"])
    m = parse_method("blend@0.15:probe:cand=2")
    assert m.policy().candidates == 2.0 and m.canonical == "blend@0.15:probe:cand=2"
    off = parse_method("blend@0.15:probe:cand=off")
    assert off.policy().candidates is None and off.canonical == "blend@0.15:probe:cand=off"
    assert parse_method("blend@0.15:probe").policy().candidates == DEFAULT_CANDIDATES
    for bad in ("blend@0.15:probe:cand=0.9", "blend@0.15:probe:cand=2:cand=off", "blend@0.15:probe:cand=x"):
        with pytest.raises(MethodError):
            parse_method(bad)
    assert policy_for(KvblendOptions(reuse="blend", candidates=2.5), "").candidates == 2.5
    with pytest.raises(ValueError):
        KvblendOptions(reuse="blend", candidates=0.5)


def test_auto_probe_precision_is_bf16_only_where_the_cpu_has_it(tiny_engine):
    """probe=auto: bf16 for a float32 engine on a CPU with avx512_bf16 or amx_bf16, the compute dtype
    elsewhere (emulated bf16 is slower than fp32) and for engines already in bf16 or on a GPU; the
    report names what ran, never "auto"."""
    from blend.cpu_features import this_cpu_flags
    from blend.policy import ProbePrecision as PP
    from blend.probe_pass import probe_gemm_dtype, resolve_probe_precision

    cpu, f32 = torch.device("cpu"), torch.float32
    amx, avx512, avx2 = frozenset({"amx_bf16"}), frozenset({"avx512_bf16", "avx2"}), frozenset({"avx2", "fma"})
    assert resolve_probe_precision(PP.AUTO, f32, cpu, amx) is PP.BF16
    assert resolve_probe_precision(PP.AUTO, f32, cpu, avx512) is PP.BF16
    assert resolve_probe_precision(PP.AUTO, f32, cpu, avx2) is PP.COMPUTE
    assert resolve_probe_precision(PP.AUTO, f32, torch.device("cuda"), amx) is PP.COMPUTE
    assert resolve_probe_precision(PP.AUTO, torch.bfloat16, cpu, amx) is PP.COMPUTE
    assert resolve_probe_precision(PP.COMPUTE, f32, cpu, amx) is PP.COMPUTE
    assert resolve_probe_precision(PP.BF16, f32, cpu, avx2) is PP.BF16  # asked for outright: obeyed
    assert probe_gemm_dtype(PP.AUTO, f32, cpu, amx) == torch.bfloat16
    assert probe_gemm_dtype(PP.AUTO, f32, cpu, avx2) == f32
    prompt = tiny_engine.build_prompt("Which one?", make_docs(4))
    here = resolve_probe_precision(PP.AUTO, tiny_engine.runner.dtype, tiny_engine.runner.device, this_cpu_flags())
    auto = tiny_engine.generate(prompt, unguarded_blend(0.25, "probe", probe_precision=PP.AUTO), max_new_tokens=1)
    same = tiny_engine.generate(prompt, unguarded_blend(0.25, "probe", probe_precision=here), max_new_tokens=1)
    assert f":probe={here.value}" in auto.report.policy and "auto" not in auto.report.policy
    assert torch.equal(auto.first_logits, same.first_logits)


def test_the_cli_the_api_and_the_harness_expose_the_probe_precision():
    from blend.cli import build_parser
    from blend.evals.methods import parse_method
    from blend.options import policy_from_args
    from blend.policy import ProbePrecision as PP
    from blend.serve.intake import policy_for
    from blend.serve.schemas import KvblendOptions

    base = ["ask", "q", "--doc", "d", "--reuse", "blend"]
    for value in ("compute", "bf16", "auto"):
        args = build_parser("ask").parse_args(base + ["--probe-precision", value])
        assert policy_from_args(args).probe_precision is PP(value)
        assert policy_for(KvblendOptions(reuse="blend", probe_precision=value), "").probe_precision is PP(value)
    with pytest.raises(SystemExit):
        build_parser("ask").parse_args(base + ["--probe-precision", "fp8"])
    with pytest.raises(ValueError):
        KvblendOptions(reuse="blend", probe_precision="fp8")
    assert parse_method("blend@0.15:probe:probe=auto").policy().probe_precision is PP.AUTO


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2"])
def test_a_bf16_probe_runs_on_models_with_qkv_biases(model):
    """Qwen2 adds a Q/K/V bias inside the GEMM: the probe's bf16 layer copy carries it in bf16 too
    (an fp32 bias beside bf16 weights failed in F.linear); ratio 1.0 stays bit-identical."""
    from blend.engine import Engine
    from blend.policy import ProbePrecision

    eng = Engine.load(model)
    prompt = eng.build_prompt("Which one?", make_docs(3))
    for ratio in (0.25, 1.0):
        fp = eng.generate(prompt, unguarded_blend(ratio, "probe", force=True, probe_precision=ProbePrecision.COMPUTE),
                          max_new_tokens=1)
        bf = eng.generate(prompt, unguarded_blend(ratio, "probe", force=True, probe_precision=ProbePrecision.BF16),
                          max_new_tokens=1)
        assert bool(torch.isfinite(bf.first_logits).all())
        if ratio == 1.0:
            assert torch.equal(fp.first_logits, bf.first_logits)


def test_prepare_blend_builds_the_probe_copy_before_the_first_request(tiny_engine_factory):
    """A server calls ``prepare_blend`` at start-up so the first blend request does not pay for the
    probe's weight copy; the copy it builds is the one a request then uses."""
    from blend.policy import ProbePrecision as PP

    eng = tiny_engine_factory()
    runner = eng.runner
    assert not runner.has_layers_in(torch.bfloat16)
    assert eng.prepare_blend(PP.BF16) == torch.bfloat16
    assert runner.has_layers_in(torch.bfloat16)  # built now
    made = runner.layers_in(torch.bfloat16)
    eng.generate(eng.build_prompt("Which one?", make_docs(4)),
                 unguarded_blend(0.25, "probe", probe_precision=PP.BF16), max_new_tokens=1)
    assert runner.layers_in(torch.bfloat16) is made  # reused, not rebuilt
    assert eng.prepare_blend(PP.COMPUTE) == runner.dtype  # nothing to copy


@pytest.mark.parametrize("kw", [dict(budget=BudgetMode.AUTO, auto_target=0.0), dict(threshold=0.0)])
@pytest.mark.parametrize("max_ratio", [0.2505, 0.35])
def test_a_cap_is_never_exceeded_by_rounding(tiny_engine, kw, max_ratio):
    """``max_ratio`` is a cap: the rows it allows round down (0.35 of 1090 rows is 381, not 382)."""
    prompt = tiny_engine.build_prompt("Which one?", make_docs(4))
    out = tiny_engine.generate(prompt, unguarded_blend(0.15, "probe", max_ratio=max_ratio, **kw), max_new_tokens=1)
    assert 0 < out.report.ratio <= max_ratio


def test_prepare_blend_reads_the_donor_log_of_a_semantic_engine(tiny_engine_factory):
    """The donor index attached to its log on the first blend request, under a lock every request takes: a
    full log takes seconds to replay, which the first requests paid."""
    donors = tiny_engine_factory(experimental_semantic=True).segments.donors
    eng = tiny_engine_factory(experimental_semantic=True)
    assert eng.segments.donors._index is None
    eng.prepare_blend()
    assert eng.segments.donors._index is not None
    plain = tiny_engine_factory()
    plain.prepare_blend()
    assert plain.segments.donors._index is None and donors._index is None  # nothing to read without the flag
