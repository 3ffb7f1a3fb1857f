"""A blend's recomputed rows may attend in bf16 above the first check layer (AttentionPrecision, opt-in)."""

import pytest
import torch

from blend.errors import InvalidPolicyError
from blend.policy import AttentionPrecision as AP
from blend.policy import ReuseMode, ReusePolicy
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
    from blend.probe_pass import attention_dtype, resolve_attention_precision

    cpu, f32, bf16 = torch.device("cpu"), torch.float32, torch.bfloat16
    amx, avx2 = frozenset({"amx_bf16"}), frozenset({"avx2", "fma"})
    assert resolve_attention_precision(AP.AUTO, f32, cpu, amx) is AP.BF16
    assert resolve_attention_precision(AP.AUTO, f32, cpu, avx2) is AP.COMPUTE
    assert resolve_attention_precision(AP.AUTO, f32, torch.device("cuda"), amx) is AP.COMPUTE
    assert resolve_attention_precision(AP.BF16, bf16, cpu, amx) is AP.COMPUTE  # nothing to cast
    assert resolve_attention_precision(AP.BF16, f32, cpu, avx2) is AP.BF16  # asked for outright: obeyed
    assert attention_dtype(AP.BF16, f32) == bf16 and attention_dtype(AP.COMPUTE, f32) == f32
    prompt = tiny_engine.build_prompt("Which one?", make_docs(3))
    here = resolve_attention_precision(AP.AUTO, f32, cpu, this_cpu_flags())
    auto = tiny_engine.generate(prompt, unguarded_blend(0.3, "v", attention_precision=AP.AUTO), max_new_tokens=1)
    same = tiny_engine.generate(prompt, unguarded_blend(0.3, "v", attention_precision=here), max_new_tokens=1)
    assert "auto" not in auto.report.policy and torch.equal(auto.first_logits, same.first_logits)


def test_attention_precision_is_a_blend_option_everywhere():
    from blend.cli import build_parser
    from blend.evals.methods import MethodError, parse_method
    from blend.options import policy_from_args
    from blend.serve.intake import policy_for
    from blend.serve.schemas import KvblendOptions

    with pytest.raises(InvalidPolicyError, match="blend option"):
        ReusePolicy(mode=ReuseMode.EXACT, attention_precision=AP.BF16)
    with pytest.raises(InvalidPolicyError, match="AttentionPrecision"):
        ReusePolicy.blend(attention_precision="bf16")
    base = ["ask", "q", "--doc", "d"]
    for value in ("compute", "bf16", "auto"):
        args = build_parser("ask").parse_args(base + ["--reuse", "blend", "--attention-precision", value])
        assert policy_from_args(args).attention_precision is AP(value)
        assert policy_for(KvblendOptions(reuse="blend", attention_precision=value), "").attention_precision is AP(value)
        assert parse_method(f"blend@0.15:attn={value}").policy().attention_precision is AP(value)
    with pytest.raises(InvalidPolicyError, match="--attention-precision only applies"):
        policy_from_args(build_parser("ask").parse_args(base + ["--attention-precision", "bf16"]))
    for mode in ("exact", "none"):
        with pytest.raises(InvalidPolicyError, match="attention_precision is a blend option"):
            policy_for(KvblendOptions(reuse=mode, attention_precision="bf16"), "")
    with pytest.raises(ValueError):
        KvblendOptions(reuse="blend", attention_precision="fp8")
    with pytest.raises(MethodError):
        parse_method("blend@0.15:attn=fp8")
    m = parse_method("blend@0.15:probe:attn=bf16")
    assert m.canonical.endswith(":attn=bf16") and "attn=bf16" in m.series()
    assert type(m).from_dict(m.to_dict(), m.name).policy() == m.policy()
