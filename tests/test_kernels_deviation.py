"""kv_deviation: Triton kernel (interpreted) vs torch reference.

Three phases per case: reference, kernel, compare with TOL[float32] (the output is fp32).
"""

import pytest
import torch

from blend.kernels import ENV_VAR, kv_deviation, kv_deviation_ref
from blend.kernels.testing import Layout, assert_close_tol, randn3

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "triton")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("h", [1, 3])
@pytest.mark.parametrize("d", [64, 128, 40, 200])
@pytest.mark.parametrize("s", [0, 1, 77])
def test_deviation_kernel_matches_reference(triton_backend, dtype, h, d, s):
    gen = torch.Generator().manual_seed(3)
    fresh = randn3(h, s, d, dtype, Layout.CONTIGUOUS, gen)
    cached = randn3(h, s, d, dtype, Layout.CONTIGUOUS, gen)
    # reference
    expected = kv_deviation_ref(fresh, cached)
    # kernel
    actual = kv_deviation(fresh, cached)
    # compare: both reduce exact fp32 upcasts, so fp32 tolerance applies for every input dtype
    assert actual.shape == (s,) and actual.dtype == torch.float32
    assert_close_tol(actual, expected, torch.float32)


@pytest.mark.parametrize("layout", [Layout.TOKEN_MAJOR, Layout.DIM_STRIDED], ids=lambda l: l.value)
def test_deviation_kernel_non_contiguous_mixed_dtypes(triton_backend, layout):
    gen = torch.Generator().manual_seed(4)
    fresh = randn3(3, 50, 72, torch.float32, layout, gen)
    cached = randn3(3, 50, 72, torch.bfloat16, layout, gen)
    assert not fresh.is_contiguous()
    expected = kv_deviation_ref(fresh.contiguous(), cached.contiguous())
    actual = kv_deviation(fresh, cached)
    assert_close_tol(actual, expected, torch.float32)


def test_deviation_kernel_identical_inputs_give_zero(triton_backend):
    x = torch.randn(3, 20, 64, dtype=torch.bfloat16)
    assert torch.equal(kv_deviation(x, x.clone()), torch.zeros(20))
