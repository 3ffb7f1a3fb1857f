"""The reused rows' attention temperature (APE's temperature on independently encoded KV)."""

import math

import pytest
import torch

from blend.defaults import DEFAULT_REUSED_TEMPERATURE, REUSED_TEMPERATURE_RANGE
from blend.errors import InvalidPolicyError
from blend.policy import ReusePolicy
from blend.report import ReuseClass
from conftest import make_docs, unguarded_blend


def _prefill(engine, prompt, **kw):
    logits, cache, report = engine.prefill(prompt, unguarded_blend(**kw))
    return logits, cache, report


def test_temperature_one_ratio_one_and_full_reuse_change_no_bit(tiny_engine):
    """A blend without a temperature uses the default one; at ratio 1 every document row is recomputed
    and with no check layer (full reuse) nothing is tempered, so T changes no bit there."""
    prompt = tiny_engine.build_prompt("Which one?", make_docs(4))
    tiny_engine.precompute(prompt, unguarded_blend())
    assert torch.equal(_prefill(tiny_engine, prompt, ratio=0.25)[0],
                       _prefill(tiny_engine, prompt, ratio=0.25, reused_temperature=DEFAULT_REUSED_TEMPERATURE)[0])
    for ratio in (1.0, 0.0):
        assert torch.equal(_prefill(tiny_engine, prompt, ratio=ratio, reused_temperature=1.0)[0],
                           _prefill(tiny_engine, prompt, ratio=ratio, reused_temperature=1.7)[0])
    assert not torch.equal(_prefill(tiny_engine, prompt, ratio=0.25, reused_temperature=1.0)[0],
                           _prefill(tiny_engine, prompt, ratio=0.25, reused_temperature=1.7)[0])


def test_temperature_divides_only_the_reused_rows_keys_above_the_check_layer(tiny_engine):
    """Cache K of the blended documents' rows that were not recomputed is the untempered K / T at
    every layer above the first check layer (T = 2: an exact division); layers up to the check, the
    exact prefix, V and the selection itself are untouched."""
    prompt = tiny_engine.build_prompt("Which one?", make_docs(4))
    tiny_engine.precompute(prompt, unguarded_blend())
    _, c1, r1 = _prefill(tiny_engine, prompt, ratio=0.25, check_layers=1, reused_temperature=1.0)
    _, c2, r2 = _prefill(tiny_engine, prompt, ratio=0.25, check_layers=1, reused_temperature=2.0)
    assert "temp=2" in r2.policy and "temp" not in r1.policy
    blended = [s for s in r1.segments if s.reuse_class is ReuseClass.BLENDED]
    assert blended and [s.recomputed_offsets for s in blended] == \
        [s.recomputed_offsets for s in r2.segments if s.reuse_class is ReuseClass.BLENDED]
    stale = torch.tensor([s.start + o for s in blended for o in range(s.tokens) if o not in s.recomputed_offsets])
    e = blended[0].start
    for layer in range(tiny_engine.dims.num_layers):
        k1, v1 = c1.view(layer)
        k2, v2 = c2.view(layer)
        assert torch.equal(k1[:, :e], k2[:, :e])  # the exact prefix
        if layer <= 1:
            assert torch.equal(k1, k2) and torch.equal(v1, v2)
        else:
            assert torch.equal(k2[:, stale], k1[:, stale] * 0.5)
            assert torch.equal(v2[:, stale], v1[:, stale])


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf, True, 1e-5, 0.099, 10.5, 1e6])
def test_policy_rejects_a_bad_temperature(bad):
    with pytest.raises(InvalidPolicyError):
        unguarded_blend(reused_temperature=bad)


def test_the_cli_the_api_and_the_harness_expose_the_temperature():
    import argparse

    from blend.evals.methods import MethodError, parse_method
    from blend.options import add_policy_arguments, policy_from_args
    from blend.serve.intake import policy_for
    from blend.serve.schemas import KvblendOptions

    p = argparse.ArgumentParser()
    add_policy_arguments(p)
    assert policy_from_args(p.parse_args(["--reuse", "blend", "--reused-temperature", "1.1"])).reused_temperature == 1.1
    with pytest.raises(SystemExit):
        p.parse_args(["--reused-temperature", "0"])
    assert parse_method("blend@0.15:probe:temp=1.1").policy().reused_temperature == 1.1
    with pytest.raises(MethodError):
        parse_method("blend@0.15:temp=-1")
    opts = KvblendOptions(reuse="blend", reused_temperature=1.1)
    assert policy_for(opts, "").reused_temperature == 1.1
    with pytest.raises(ValueError):
        KvblendOptions(reused_temperature=0)
    for bad in ("1e-5", "11"):  # outside REUSED_TEMPERATURE_RANGE everywhere
        with pytest.raises(SystemExit):
            p.parse_args(["--reused-temperature", bad])
        with pytest.raises(ValueError):
            KvblendOptions(reused_temperature=float(bad))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("t", REUSED_TEMPERATURE_RANGE)
def test_the_temperatures_a_request_may_set_give_finite_logits_in_every_dtype(tiny_engine_factory, dtype, t):
    """1e-5 gave NaN logits in a float16 engine (K / T overflowed); the range's ends stay finite."""
    eng = tiny_engine_factory(dtype=dtype)
    prompt = eng.build_prompt("What is listed?", make_docs(3))
    eng.generate(prompt, unguarded_blend(ratio=0.25), max_new_tokens=1)  # stores the chunks
    ans = eng.generate(prompt, unguarded_blend(ratio=0.25, reused_temperature=t), max_new_tokens=1)
    assert torch.isfinite(ans.first_logits).all()


def test_the_report_of_a_blend_that_tempered_nothing_names_no_temperature(tiny_engine):
    """Full reuse (ratio 0) has no check layer, above which the temperature applies: its logits are those of
    T = 1, and its report said ':temp=1.05' all the same."""
    prompt = tiny_engine.build_prompt("Which?", make_docs(3))
    reuse = tiny_engine.generate(prompt, unguarded_blend(0.0), max_new_tokens=1)
    plain = tiny_engine.generate(prompt, unguarded_blend(0.0, reused_temperature=1.0), max_new_tokens=1)
    assert torch.equal(reuse.first_logits, plain.first_logits)  # nothing was tempered
    assert ":temp=" not in reuse.report.policy and reuse.report.policy == plain.report.policy
    blend = tiny_engine.generate(prompt, unguarded_blend(0.15), max_new_tokens=1)
    assert ":temp=1.05" in blend.report.policy  # a blend with a check layer tempers its reused rows
