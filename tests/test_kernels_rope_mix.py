"""rope_mix: Triton kernel (interpreted) vs torch reference.

Three phases per case: reference, kernel, compare with TOL[dtype].
"""

import pytest
import torch

from blend.kernels import ENV_VAR, rope_mix, rope_mix_ref
from blend.kernels.testing import Layout, assert_close_tol, make_rope_mix_inputs

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (D, R): full rotary at 64/128, an odd head dim, partial rotary with pass-through dims
DIMS = [(64, 64), (128, 128), (40, 40), (72, 32)]
T = 45  # not a multiple of the kernel's BLOCK_T


def _fresh(kind: str, t: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    if kind == "empty":
        return torch.empty(0, dtype=torch.int64)
    if kind == "all":
        return torch.randperm(t, generator=gen)  # every row, shuffled
    return torch.randperm(t, generator=gen)[: t // 3]  # unsorted subset


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "triton")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d,r", DIMS)
@pytest.mark.parametrize("fresh", ["empty", "all", "unsorted"])
def test_rope_mix_kernel_matches_reference(triton_backend, dtype, d, r, fresh):
    inp = make_rope_mix_inputs(hkv=2, t=T, d=d, rot_dim=r, fresh_idx=_fresh(fresh, T), dtype=dtype)
    before = [x.clone() for x in inp.args()]
    # reference
    k_ref, v_ref = rope_mix_ref(*inp.args())
    # kernel
    k_out, v_out = rope_mix(*inp.args())
    # compare
    assert k_out.shape == v_out.shape == (2, T, d)
    assert k_out.dtype == v_out.dtype == dtype
    assert_close_tol(k_out, k_ref)
    torch.testing.assert_close(v_out, v_ref, atol=0, rtol=0)  # V is a pure copy/scatter
    for x, x0 in zip(inp.args(), before):
        assert torch.equal(x, x0), "inputs must not be modified"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", [Layout.TOKEN_MAJOR, Layout.DIM_STRIDED], ids=lambda l: l.value)
def test_rope_mix_kernel_non_contiguous(triton_backend, dtype, layout):
    inp = make_rope_mix_inputs(hkv=3, t=T, d=40, rot_dim=32, fresh_idx=_fresh("unsorted", T),
                               dtype=dtype, layout=layout)
    assert not inp.cached_k.is_contiguous() and not inp.fresh_k.is_contiguous() and not inp.cos.is_contiguous()
    contiguous = [x.contiguous() for x in inp.args()]
    k_ref, v_ref = rope_mix_ref(*contiguous)
    k_out, v_out = rope_mix(*inp.args())
    assert_close_tol(k_out, k_ref)
    assert torch.equal(v_out, v_ref)


def test_rope_mix_kernel_bf16_key_fp32_tables_long_positions(triton_backend):
    """fp32 tables at large positions with bf16 K: rotation in fp32, one rounding at the store."""
    t = 33
    inp = make_rope_mix_inputs(hkv=1, t=t, d=64, rot_dim=64, fresh_idx=torch.tensor([32, 0, 5]),
                               dtype=torch.bfloat16, pos_offset=15000)
    k_out, _ = rope_mix(*inp.args())
    k_ref, _ = rope_mix_ref(*inp.args())
    assert_close_tol(k_out, k_ref)
    # the rotation really happened at the new positions: norms preserved, values changed
    pre = inp.cached_k.index_copy(1, inp.fresh_idx, inp.fresh_k).float()
    torch.testing.assert_close(k_out.float().norm(dim=-1), pre.norm(dim=-1), atol=0.05, rtol=0.02)
    assert not torch.allclose(k_out.float(), pre, atol=0.1)


@pytest.mark.parametrize("idx,match", [
    (torch.tensor([3, 1, 3]), "duplicate"),
    (torch.tensor([0, T]), r"\[0, 45\)"),
    (torch.tensor([-1]), r"\[0, 45\)"),
])
def test_rope_mix_kernel_rejects_bad_indices(triton_backend, idx, match):
    inp = make_rope_mix_inputs(hkv=1, t=T, d=64, rot_dim=64, fresh_idx=idx, dtype=torch.float32)
    with pytest.raises(ValueError, match=match):
        rope_mix(*inp.args())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_mix_kernel_tables_with_distinct_halves(triton_backend, dtype):
    """Tables whose two halves differ (not the HF cat(freqs, freqs) layout) are honoured as given."""
    gen = torch.Generator().manual_seed(9)
    inp = make_rope_mix_inputs(hkv=2, t=T, d=72, rot_dim=48, fresh_idx=_fresh("unsorted", T), dtype=dtype)
    cos = torch.rand(T, 48, generator=gen) * 2 - 1  # (T, R)
    sin = torch.rand(T, 48, generator=gen) * 2 - 1  # (T, R)
    args = (inp.cached_k, inp.cached_v, cos, sin, inp.fresh_idx, inp.fresh_k, inp.fresh_v)
    k_ref, _ = rope_mix_ref(*args)
    k_out, _ = rope_mix(*args)
    assert_close_tol(k_out, k_ref)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_trusted_indices_skip_the_check_and_agree(monkeypatch, backend):
    """The engine's own (valid) indices skip the range/duplicate check and its host sync; same result."""
    from blend.kernels import ENV_VAR
    import blend.kernels.checks as C

    monkeypatch.setenv(ENV_VAR, backend)
    inp = make_rope_mix_inputs(hkv=2, t=T, d=64, rot_dim=64, fresh_idx=_fresh("unsorted", T), dtype=torch.float32)
    checked = rope_mix(*inp.args())
    sorts = []
    real_sort = torch.sort
    monkeypatch.setattr(C.torch, "sort", lambda *a, **k: sorts.append(1) or real_sort(*a, **k))
    trusted = rope_mix(*inp.args(), trusted_indices=True)
    assert sorts == []
    assert torch.equal(trusted[0], checked[0]) and torch.equal(trusted[1], checked[1])
    # unchecked by design: a duplicate passes the check (the caller vouched for the indices)
    C.check_rope_mix(*make_rope_mix_inputs(hkv=1, t=T, d=64, rot_dim=64, fresh_idx=torch.tensor([3, 1, 3]),
                                           dtype=torch.float32).args(), trusted_indices=True)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fresh", ["empty", "unsorted"])
def test_rope_mix_writes_into_given_rows_of_a_cache(monkeypatch, backend, dtype, fresh):
    """``out``: the same numbers written straight into (strided) rows of a bigger cache, nothing else touched."""
    monkeypatch.setenv(ENV_VAR, backend)
    inp = make_rope_mix_inputs(hkv=2, t=T, d=72, rot_dim=32, fresh_idx=_fresh(fresh, T), dtype=dtype)
    k_ref, v_ref = rope_mix(*inp.args())
    cache_k = torch.full((2, T + 20, 72), 7.0, dtype=dtype)  # (Hkv, N, D) like a KVCache layer
    cache_v = torch.full((2, T + 20, 72), 7.0, dtype=dtype)
    out = (cache_k[:, 10:10 + T], cache_v[:, 10:10 + T])
    got = rope_mix(*inp.args(), out=out)
    assert got[0].data_ptr() == out[0].data_ptr()
    assert torch.equal(cache_k[:, 10:10 + T], k_ref) and torch.equal(cache_v[:, 10:10 + T], v_ref)
    assert bool((cache_k[:, :10] == 7).all() and (cache_k[:, 10 + T:] == 7).all() and (cache_v[:, :10] == 7).all())


def test_rope_mix_out_is_checked():
    inp = make_rope_mix_inputs(hkv=2, t=T, d=64, rot_dim=64, fresh_idx=_fresh("empty", T), dtype=torch.float32)
    k, v = torch.empty(2, T, 64), torch.empty(2, T, 64)
    with pytest.raises(ValueError, match="shape"):
        rope_mix(*inp.args(), out=(k[:, :-1], v))
    with pytest.raises(ValueError, match="dtype|float"):
        rope_mix(*inp.args(), out=(k.bfloat16(), v))
    with pytest.raises(ValueError, match="strides"):
        rope_mix(*inp.args(), out=(k, torch.empty(2, T + 1, 64)[:, :T]))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rope_rows_is_rope_mix_without_fresh_rows(monkeypatch, backend, dtype):
    """The engine's unchecked fast path gives rope_mix's bits, returned or written into strided cache rows
    spanning several layers (layers x heads flattened into one dim)."""
    from blend.kernels import rope_rows

    monkeypatch.setenv(ENV_VAR, backend)
    inp = make_rope_mix_inputs(hkv=6, t=T, d=72, rot_dim=32, fresh_idx=_fresh("empty", T), dtype=dtype)
    k_ref, v_ref = rope_mix(*inp.args())
    k, v = rope_rows(inp.cached_k, inp.cached_v, inp.cos, inp.sin)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    cache_k = torch.full((3, 2, T + 20, 72), 7.0, dtype=dtype)  # (L, Hkv, N, D) like a KVCache's layers
    cache_v = torch.full((3, 2, T + 20, 72), 7.0, dtype=dtype)
    out = (cache_k[:, :, 10:10 + T].view(6, T, 72), cache_v[:, :, 10:10 + T].view(6, T, 72))
    rope_rows(inp.cached_k, inp.cached_v, inp.cos, inp.sin, out=out)
    assert torch.equal(cache_k[:, :, 10:10 + T].reshape(6, T, 72), k_ref)
    assert torch.equal(cache_v[:, :, 10:10 + T].reshape(6, T, 72), v_ref)
    assert bool((cache_k[:, :, :10] == 7).all() and (cache_k[:, :, 10 + T:] == 7).all())
