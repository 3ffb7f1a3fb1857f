"""The emulated-dtype hint: bf16/fp16 on a CPU without native arithmetic warns, never refuses."""

from __future__ import annotations

import warnings

import pytest
import torch

from blend import cpu_features
from blend.cpu_features import (
    EmulatedDtypeWarning, cpu_flags, cpu_vendor, cpuinfo_field, native_on_cpu, warn_if_emulated,
)
from blend.engine import Engine

AVX2 = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx avx2 fma f16c\n\nprocessor\t: 1\n"
SAPPHIRE = "flags\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile avx512_fp16\n"


def test_flags_come_from_the_first_flags_line():
    assert cpu_flags(AVX2) == frozenset({"fpu", "sse2", "avx", "avx2", "fma", "f16c"})
    assert cpu_flags("model name: x\n") is None
    assert cpu_flags("") is None


def test_the_vendor_and_any_field_come_from_their_first_line():
    assert cpu_vendor("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\n") == "AuthenticAMD"
    assert cpu_vendor("vendor_id : GenuineIntel\nvendor_id : AuthenticAMD\n") == "GenuineIntel"
    assert cpu_vendor("processor : 0\nmodel name : something\n") == ""
    assert cpuinfo_field("model name", AVX2) == "AMD EPYC"
    assert cpuinfo_field("flags", "flags\n") is None  # a line without its colon is no field


@pytest.mark.parametrize(("text", "dtype", "native"), [
    (AVX2, torch.bfloat16, False), (AVX2, torch.float16, False), (AVX2, torch.float32, True),
    (SAPPHIRE, torch.bfloat16, True), (SAPPHIRE, torch.float16, True), ("", torch.bfloat16, None),
])
def test_native_on_cpu(text, dtype, native):
    assert native_on_cpu(dtype, cpu_flags(text)) is native


def test_warns_only_for_an_emulated_dtype_on_a_cpu():
    with pytest.warns(EmulatedDtypeWarning, match="bfloat16 on this CPU is emulated.*float32"):
        assert warn_if_emulated(torch.bfloat16, torch.device("cpu"), cpu_flags(AVX2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not warn_if_emulated(torch.bfloat16, torch.device("cpu"), cpu_flags(SAPPHIRE))
        assert not warn_if_emulated(torch.float32, torch.device("cpu"), cpu_flags(AVX2))
        assert not warn_if_emulated(torch.bfloat16, torch.device("cuda"), cpu_flags(AVX2))


def test_an_engine_in_bf16_on_an_emulating_cpu_warns_and_still_runs(monkeypatch):
    monkeypatch.setattr(cpu_features, "this_cpu_flags", lambda: cpu_flags(AVX2))
    with pytest.warns(EmulatedDtypeWarning):
        eng = Engine.load("tiny-llama", dtype="bfloat16")
    assert eng.runner.dtype == torch.bfloat16
    ans = eng.generate(eng.build_prompt("Which?", ["The harbor lies north."]), max_new_tokens=2,
                       stop_at_newline=False)  # still runs: a bf16 answer, not a refusal
    assert len(ans.token_ids) == 2 and bool(torch.isfinite(ans.first_logits).all())
    monkeypatch.setattr(cpu_features, "this_cpu_flags", lambda: cpu_flags(SAPPHIRE))
    with warnings.catch_warnings():
        warnings.simplefilter("error", EmulatedDtypeWarning)
        Engine.load("tiny-llama", dtype="bfloat16")
