"""A blend's recomputed rows may attend, and run their linear layers, in bf16 above the first check layer
(RecomputePrecision, opt-in: ``attention_precision``, ``linear_precision``)."""

import pytest
import torch

from blend.errors import InvalidPolicyError, InvalidRequestError
from blend.policy import RecomputePrecision as AP
from dataclasses import replace

from blend.policy import GuardMode, ReuseMode, ReusePolicy
from conftest import make_docs, unguarded_blend


def _offsets(ans):
    return [s.recomputed_offsets for s in ans.report.segments]


def test_bf16_attention_moves_the_numbers_not_the_rows(tiny_engine):
    """Opt-in bf16 attention: the same rows recomputed (selection runs at the check layer, below the
    layers it touches), the first-token logits within bf16 rounding of the compute-dtype blend but not
    equal to them (so the cast ran), the report names it, and the default is unchanged."""
    prompt = tiny_engine.build_prompt("Which one?", make_docs(4))
    base = tiny_engine.generate(prompt, unguarded_blend(0.3, "probe"), max_new_tokens=1)
    again = tiny_engine.generate(prompt, unguarded_blend(0.3, "probe", attention_precision=AP.COMPUTE),
                                 max_new_tokens=1)
    bf16 = tiny_engine.generate(prompt, unguarded_blend(0.3, "probe", attention_precision=AP.BF16),
                                max_new_tokens=1)
    assert torch.equal(base.first_logits, again.first_logits)  # COMPUTE is the default
    assert _offsets(bf16) == _offsets(base) and bf16.report.recomputed_tokens == base.report.recomputed_tokens
    assert bf16.report.recomputed_tokens > 0
    diff = (bf16.first_logits - base.first_logits).abs().max().item()
    assert 0 < diff < 0.05 * base.first_logits.abs().max().item()
    assert ":attn=bf16" in bf16.report.policy and ":attn" not in base.report.policy


def test_bf16_attention_leaves_the_check_layer_and_below_alone(tiny_engine, monkeypatch):
    """Only layers above the first check layer attend in bf16; the cache keeps the engine's dtype."""
    import blend.blending as blending

    seen = []
    real = blending.sparse_query_attention

    def spy(q, q_pos, k, v, k_pos, scale, plan=None):
        seen.append(q.dtype)
        assert k.dtype == v.dtype == q.dtype
        return real(q, q_pos, k, v, k_pos, scale, plan=plan)

    monkeypatch.setattr(blending, "sparse_query_attention", spy)
    prompt = tiny_engine.build_prompt("Which one?", make_docs(3))
    policy = unguarded_blend(0.3, "v", check_layers=(1,), attention_precision=AP.BF16)
    ans = tiny_engine.generate(prompt, policy, max_new_tokens=1, keep_cache=True)
    layers = tiny_engine.dims.num_layers
    assert seen[:2] == [torch.float32] * 2  # layers 0 and 1 (the check layer): every row in float32
    assert seen[2:] == [torch.bfloat16] * (layers - 2)
    assert ans.cache.k[0].dtype == torch.float32


def test_auto_attention_precision_resolves_per_engine(tiny_engine):
    from blend.cpu_features import this_cpu_flags
    from blend.probe_pass import recompute_dtype, resolve_recompute_precision

    cpu, f32, bf16 = torch.device("cpu"), torch.float32, torch.bfloat16
    amx, avx2 = frozenset({"amx_bf16"}), frozenset({"avx2", "fma"})
    assert resolve_recompute_precision(AP.AUTO, f32, cpu, amx) is AP.BF16
    assert resolve_recompute_precision(AP.AUTO, f32, cpu, avx2) is AP.COMPUTE
    assert resolve_recompute_precision(AP.AUTO, f32, torch.device("cuda"), amx) is AP.COMPUTE
    assert resolve_recompute_precision(AP.BF16, bf16, cpu, amx) is AP.COMPUTE  # nothing to cast
    assert resolve_recompute_precision(AP.BF16, f32, cpu, avx2) is AP.BF16  # asked for outright: obeyed
    assert recompute_dtype(AP.BF16, f32) == bf16 and recompute_dtype(AP.COMPUTE, f32) == f32
    prompt = tiny_engine.build_prompt("Which one?", make_docs(3))
    here = resolve_recompute_precision(AP.AUTO, f32, cpu, this_cpu_flags())
    auto = tiny_engine.generate(prompt, unguarded_blend(0.3, "v", attention_precision=AP.AUTO), max_new_tokens=1)
    same = tiny_engine.generate(prompt, unguarded_blend(0.3, "v", attention_precision=here), max_new_tokens=1)
    assert "auto" not in auto.report.policy and torch.equal(auto.first_logits, same.first_logits)


@pytest.mark.parametrize("field, flag, key", [("attention_precision", "--attention-precision", "attn"),
                                               ("linear_precision", "--linear-precision", "lin")])
def test_recompute_precisions_are_blend_options_everywhere(field, flag, key):
    from blend.cli import build_parser
    from blend.evals.methods import MethodError, parse_method
    from blend.options import policy_from_args
    from blend.serve.intake import policy_for
    from blend.serve.schemas import KvblendOptions

    with pytest.raises(InvalidPolicyError, match="blend option"):
        ReusePolicy(mode=ReuseMode.EXACT, **{field: AP.BF16})
    with pytest.raises(InvalidPolicyError, match="RecomputePrecision"):
        ReusePolicy.blend(**{field: "bf16"})
    base = ["ask", "q", "--doc", "d"]
    for value in ("compute", "bf16", "auto"):
        args = build_parser("ask").parse_args(base + ["--reuse", "blend", flag, value])
        assert getattr(policy_from_args(args), field) is AP(value)
        assert getattr(policy_for(KvblendOptions(reuse="blend", **{field: value}), ""), field) is AP(value)
        assert getattr(parse_method(f"blend@0.15:{key}={value}").policy(), field) is AP(value)
    with pytest.raises(InvalidPolicyError, match=f"{flag} only applies"):
        policy_from_args(build_parser("ask").parse_args(base + [flag, "bf16"]))
    for mode in ("exact", "none"):
        with pytest.raises(InvalidPolicyError, match=f"{field} is a blend option"):
            policy_for(KvblendOptions(reuse=mode, **{field: "bf16"}), "")
    with pytest.raises(ValueError):
        KvblendOptions(reuse="blend", **{field: "fp8"})
    with pytest.raises(MethodError):
        parse_method(f"blend@0.15:{key}=fp8")
    m = parse_method(f"blend@0.15:probe:{key}=bf16")
    assert m.canonical.endswith(f":{key}=bf16") and f"{key}=bf16" in m.series()
    assert type(m).from_dict(m.to_dict(), m.name).policy() == m.policy()
    assert f":{key}=bf16" in m.policy().describe()


def test_bf16_linear_layers_move_the_numbers_not_the_rows(tiny_engine):
    """linear_precision bf16: the layers above the first check layer run on the engine's bf16 copy of the
    weights, the ones up to it on its own; the same rows recomputed, logits within bf16 rounding but not
    equal, and the guard's widened second pass takes the same weights."""
    from types import SimpleNamespace

    from blend.blend_plan import pass_layers

    prompt = tiny_engine.build_prompt("Which one?", make_docs(4))
    base = tiny_engine.generate(prompt, unguarded_blend(0.3, "probe"), max_new_tokens=1)
    lin = tiny_engine.generate(prompt, unguarded_blend(0.3, "probe", linear_precision=AP.BF16), max_new_tokens=1)
    both = tiny_engine.generate(prompt, unguarded_blend(0.3, "probe", linear_precision=AP.BF16,
                                                        attention_precision=AP.BF16), max_new_tokens=1)
    assert _offsets(lin) == _offsets(base) == _offsets(both)
    for ans in (lin, both):
        diff = (ans.first_logits - base.first_logits).abs().max().item()
        assert 0 < diff < 0.05 * base.first_logits.abs().max().item()
    assert not torch.equal(lin.first_logits, both.first_logits)
    assert ":lin=bf16" in lin.report.policy and ":attn" not in lin.report.policy
    runner = tiny_engine.runner
    policy = unguarded_blend(0.3, "v", check_layers=(1,), linear_precision=AP.BF16)
    plan = SimpleNamespace(last_check=1)  # all pass_layers reads of a plan
    layers = pass_layers(runner, plan, policy)
    assert [w.w_down.dtype for w in layers] == [torch.float32] * 2 + [torch.bfloat16] * (len(runner.layers) - 2)
    assert layers[:2] == list(runner.layers[:2])
    assert pass_layers(runner, plan, unguarded_blend(0.3, "v", check_layers=(1,))) is None
    widened = ReusePolicy.blend(0.3, "probe", linear_precision=AP.BF16, guard_margin=1e9, guard_ratio=0.6,
                                guard_mode=GuardMode.WIDEN)  # the guard always fires, going on from the check
    ans = tiny_engine.generate(prompt, widened, max_new_tokens=1)
    plain = tiny_engine.generate(prompt, replace(widened, linear_precision=AP.COMPUTE), max_new_tokens=1)
    assert "widen" in ans.report.guard and _offsets(ans) == _offsets(plain)
    assert not torch.equal(ans.first_logits, plain.first_logits)


@pytest.mark.parametrize("selector, kw", [("v", dict(threshold=0.5, max_ratio=0.5)),
                                          ("v", dict(layer_ratios=(0.5, 0.2))),
                                          ("probe", dict(ratio=0.3))])
def test_every_check_layer_selects_the_same_rows_under_bf16(tiny_engine, monkeypatch, selector, kw):
    """With several check layers, bf16 starts above the last one: a later check layer reads K/V that
    only float32 layers produced, so every check keeps the same rows (starting above the first one
    changed a later check's rows, and a threshold's counts)."""
    import blend.blending as blending

    kept = []
    real = blending.Checker.select

    def spy(self, check, active, *args, **kwargs):
        sel = real(self, check, active, *args, **kwargs)
        kept.append((check.layer, active[sel.keep].tolist()))
        return sel

    monkeypatch.setattr(blending.Checker, "select", spy)
    prompt = tiny_engine.build_prompt("Which one?", make_docs(6, words=40))
    checks = (1, 3) if selector == "v" else (1, 2)
    runs = {}
    for name, extra in (("fp32", {}), ("attn", dict(attention_precision=AP.BF16)),
                        ("lin", dict(linear_precision=AP.BF16))):
        kept.clear()
        ans = tiny_engine.generate(prompt, unguarded_blend(selector=selector, check_layers=checks, **kw, **extra),
                                   max_new_tokens=1)
        runs[name] = (list(kept), ans.report.check_rows)
    assert len(runs["fp32"][0]) == len(checks)
    assert runs["attn"] == runs["fp32"] == runs["lin"]


def test_full_reuse_reports_float32_for_the_rows_it_never_recomputes(tiny_engine):
    """Ratio 0 recomputes no document row above a check layer: the report does not name bf16 there."""
    prompt = tiny_engine.build_prompt("Which one?", make_docs(3))
    both = dict(attention_precision=AP.BF16, linear_precision=AP.BF16)
    reuse = tiny_engine.generate(prompt, unguarded_blend(0.0, "v", **both), max_new_tokens=1)
    plain = tiny_engine.generate(prompt, unguarded_blend(0.0, "v"), max_new_tokens=1)
    assert ":attn" not in reuse.report.policy and ":lin" not in reuse.report.policy
    assert torch.equal(reuse.first_logits, plain.first_logits)


def test_the_bf16_weight_copy_is_built_once_under_concurrent_first_use(tiny_engine_factory, monkeypatch):
    import threading
    import time

    import blend.model as model_module

    runner = tiny_engine_factory().runner
    calls = []
    real = model_module.dense

    def slow_dense(w):
        calls.append(1)
        time.sleep(0.002)  # a real model's copy takes seconds: the window two first requests race in
        return real(w)

    monkeypatch.setattr(model_module, "dense", slow_dense)
    start = threading.Barrier(4)
    got = []

    def first_use():
        start.wait()
        got.append(runner.layers_in(torch.float16))

    threads = [threading.Thread(target=first_use) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 4 * len(runner.layers)  # one build: four matrices per layer
    assert all(g is got[0] for g in got)


def test_the_server_sets_defaults_for_requests_that_name_none(tiny_engine):
    """`kvblend serve --attention-precision/--linear-precision`: blend requests naming neither get the
    server's; a request's own value wins (compute included); start-up builds the bf16 weight copy."""
    from blend.serve.cli import build_parser, config_from_args
    from blend.serve.config import ServeConfig
    from blend.serve.intake import policy_for
    from blend.serve.schemas import KvblendOptions

    cfg = config_from_args(build_parser().parse_args(["--attention-precision", "bf16", "--linear-precision", "auto"]))
    assert (cfg.attention_precision, cfg.linear_precision) == ("bf16", "auto")
    assert (ServeConfig().attention_precision, ServeConfig().linear_precision) == ("compute", "compute")
    with pytest.raises(ValueError, match="attention_precision"):
        ServeConfig(attention_precision="fp8")
    server = (cfg.attention_precision, cfg.linear_precision)
    named_none = policy_for(KvblendOptions(reuse="blend"), "", precisions=server)
    assert (named_none.attention_precision, named_none.linear_precision) == (AP.BF16, AP.AUTO)
    own = policy_for(KvblendOptions(reuse="blend", attention_precision="compute"), "", precisions=server)
    assert (own.attention_precision, own.linear_precision) == (AP.COMPUTE, AP.AUTO)
    assert policy_for(KvblendOptions(reuse="exact"), "", precisions=server) == ReusePolicy.exact()
    assert policy_for(KvblendOptions(reuse="exact", linear_precision="compute"), "") == ReusePolicy.exact()
    from blend.policy import ProbePrecision

    runner = tiny_engine.runner
    assert not runner.has_layers_in(torch.bfloat16)
    tiny_engine.prepare_blend(ProbePrecision.COMPUTE)  # the probe in float32: no copy
    assert not runner.has_layers_in(torch.bfloat16)
    tiny_engine.prepare_blend(ProbePrecision.COMPUTE, linear=AP.BF16)
    assert runner.has_layers_in(torch.bfloat16)


_BOTH_BF16 = dict(attention_precision=AP.BF16, linear_precision=AP.BF16)


def _blend(**kw):
    return ReusePolicy.blend(0.3, "v", guard_margin=None, **kw)


def test_an_exact_only_blend_does_not_report_bf16(tiny_engine):
    """A blend that re-positions nothing (one document; or take_exact finding every document exact, as
    a refining server's blends do) runs the exact path in float32: its report must not name bf16, as full
    reuse's does not (resolve_precisions)."""
    one = tiny_engine.build_prompt("Which one?", make_docs(1))
    a = tiny_engine.generate(one, _blend(**_BOTH_BF16), max_new_tokens=1)
    b = tiny_engine.generate(one, _blend(), max_new_tokens=1)
    assert torch.equal(a.first_logits, b.first_logits)  # nothing ran in bf16
    assert ":attn" not in a.report.policy and ":lin" not in a.report.policy, a.report.policy

    three = tiny_engine.build_prompt("Which two?", make_docs(3))
    exact = tiny_engine.generate(three, ReusePolicy.exact(), max_new_tokens=1)  # stores this order's exact KV
    taken = tiny_engine.generate(three, _blend(take_exact=True, **_BOTH_BF16), max_new_tokens=1)
    assert torch.equal(taken.first_logits, exact.first_logits)  # the exact path, bit for bit
    assert ":attn" not in taken.report.policy and ":lin" not in taken.report.policy, taken.report.policy


@pytest.mark.parametrize("value", ["bf16", "fp8", 7])
def test_the_vllm_entry_refuses_precisions_outside_a_blend(value):
    """kvblend serve refuses a precision under reuse exact/none; the vLLM entry under mode exact
    accepted any value (even an unknown one) and dropped it."""
    from blend.integrations.vllm.plan import PARAMS_KEY, parse_blend_params

    with pytest.raises(InvalidRequestError):
        parse_blend_params({PARAMS_KEY: {"mode": "exact", "attention_precision": value}}, 10)
    assert parse_blend_params({PARAMS_KEY: {"mode": "exact", "linear_precision": None}}, 10) is None  # null: unnamed
    assert parse_blend_params({PARAMS_KEY: {"mode": "exact", "linear_precision": "compute"}}, 10) is None


def test_the_vllm_chat_rewrite_refuses_a_precision_under_mode_exact():
    from test_vllm_chat import TOK, chat_body

    from blend.integrations.vllm.chat import chat_to_completion
    from blend.integrations.vllm.plan import PARAMS_KEY

    with pytest.raises(InvalidRequestError):
        chat_to_completion(chat_body(kv_transfer_params={PARAMS_KEY: {"mode": "exact", "attention_precision": "fp8"}}),
                           TOK)
