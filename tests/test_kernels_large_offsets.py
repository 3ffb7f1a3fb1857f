"""The Triton kernels on tensors whose element offsets pass 2**31 (interpreted).

A long-context, multi-layer KV buffer such as (T, L, 2, Hkv, D) = (128k, 32, 2, 8, 128) has a token
stride of 65,536 elements: a layer's K viewed as (Hkv, T, D) puts token 32,768 at offset 2**31, where
a 32-bit ``row * stride`` wraps to a negative offset. These tests place small inputs in such views
(``far_views``: rows from ``FIRST_FAR`` on lie 2**31+ elements past the view's start, inside a
sparse ~8 GiB mapping of which only the touched rows' pages are committed) and compare each kernel
with its torch reference on the same values, contiguous. The interpreter computes 32-bit integer
arithmetic as the GPU does (program ids, loop counters and strides under 2**31 are int32 numpy
values) and dereferences the addresses it computes, so a kernel without 64-bit base offsets reads
and writes the wrong rows here. Skipped where the address space cannot be reserved.
"""

import pytest
import torch

from blend.kernels import (ENV_VAR, kv_deviation, kv_deviation_ref, rope_mix, rope_mix_ref, sparse_query_attention,
                           sparse_query_attention_ref)
from blend.kernels.testing import (Layout, assert_close_tol, far_views, make_attention_inputs, make_rope_mix_inputs,
                                   randn3)

DTYPE = torch.float16  # 2 bytes an element: the smallest virtual size the kernels accept
FIRST_FAR = 256  # rows 256.. are far: row stride 2**23, the last block of rows of each kernel
ROWS = FIRST_FAR + 40  # past the interpreted block sizes (32 rows), not a multiple of them


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "triton")


def _far(xs, row_dim, first_far=FIRST_FAR):
    try:
        return far_views(xs, row_dim, first_far)
    except (MemoryError, OSError) as e:
        pytest.skip(f"cannot reserve ~8 GiB of address space for far views: {e}")


def test_attention_reads_keys_past_2_31_elements(triton_backend):
    # queries on the last rows see every key, the far ones included
    inp = make_attention_inputs(hkv=2, group=2, t=ROWS, d=64, q_rows=torch.arange(ROWS - 5, ROWS), dtype=DTYPE)
    expected = sparse_query_attention_ref(*inp.args())
    k, v = _far([inp.k, inp.v], row_dim=1)  # (Hkv, T, D) token-major, rows 256.. far
    assert k.stride(1) * (ROWS - 1) >= 2**31 and torch.equal(k, inp.k)
    actual = sparse_query_attention(inp.q, inp.q_pos, k, v, inp.k_pos, inp.scale)
    assert_close_tol(actual, expected)


def test_attention_reads_queries_past_2_31_elements(triton_backend):
    # (S, Hq, D) queries of a 128k-token prompt with 128 heads of 128 dims already hold 2**31 elements;
    # here the second block of queries (16.. interpreted) starts 2**31 elements in
    inp = make_attention_inputs(hkv=2, group=2, t=70, d=64, q_rows=torch.arange(50, 70), dtype=DTYPE)
    expected = sparse_query_attention_ref(*inp.args())
    q, = _far([inp.q], row_dim=1, first_far=16)
    actual = sparse_query_attention(q, inp.q_pos, inp.k, inp.v, inp.k_pos, inp.scale)
    assert_close_tol(actual, expected)


@pytest.mark.parametrize("out", ["new", "far"])
def test_rope_mix_reads_and_writes_rows_past_2_31_elements(triton_backend, out):
    fresh_idx = torch.tensor([ROWS - 1, 3, FIRST_FAR + 7, 100, FIRST_FAR])  # unsorted, near and far rows
    inp = make_rope_mix_inputs(hkv=2, t=ROWS, d=72, rot_dim=64, fresh_idx=fresh_idx, dtype=DTYPE)
    k_ref, v_ref = rope_mix_ref(*inp.args())
    zeros = torch.zeros_like(inp.cached_k)
    ck, cv, ok, ov = _far([inp.cached_k, inp.cached_v, zeros, zeros], row_dim=1)  # one token row holds all four
    k_out, v_out = rope_mix(ck, cv, inp.cos, inp.sin, inp.fresh_idx, inp.fresh_k, inp.fresh_v,
                            out=(ok, ov) if out == "far" else None)
    assert_close_tol(k_out, k_ref)
    assert torch.equal(v_out, v_ref)
    assert torch.equal(ck, inp.cached_k) and torch.equal(cv, inp.cached_v)  # nothing written over the inputs


@pytest.mark.parametrize("row_dim", [1, 0], ids=["token_major", "head_major"])
def test_deviation_reduces_rows_past_2_31_elements(triton_backend, row_dim):
    gen = torch.Generator().manual_seed(7)
    h, s, first_far = (2, ROWS, FIRST_FAR) if row_dim == 1 else (3, 50, 2)  # head-major: head 2 is far
    fresh = randn3(h, s, 64, DTYPE, Layout.CONTIGUOUS, gen)
    cached = randn3(h, s, 64, DTYPE, Layout.CONTIGUOUS, gen)
    expected = kv_deviation_ref(fresh, cached)
    f, c = _far([fresh, cached], row_dim=row_dim, first_far=first_far)
    assert_close_tol(kv_deviation(f, c), expected, torch.float32)


def test_a_view_whose_tile_offsets_pass_32_bits_is_refused(triton_backend):
    """Offsets inside a tile stay 32-bit: a row stride so large (here 2**29 elements) that one tile of
    rows spans 2**31 elements is refused with a clear error, not read at wrapped addresses."""
    inp = make_attention_inputs(hkv=1, group=1, t=8, d=16, q_rows=torch.arange(3, 8), dtype=DTYPE)
    q, = _far([inp.q], row_dim=1, first_far=4)  # queries 0..4 in one tile: 4 * 2**29 = 2**31
    with pytest.raises(ValueError, match="32-bit in-tile offsets"):
        sparse_query_attention(q, inp.q_pos, inp.k, inp.v, inp.k_pos, inp.scale)
