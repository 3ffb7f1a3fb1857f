"""Triton kernel for ``rope_mix``: mix recomputed rows into cached K/V and apply RoPE.

One program handles BLOCK_T rows of one KV head. The launcher turns
``fresh_idx`` into a per-row source map (``src[t] = i`` if row t takes
``fresh_k[:, i]``, else -1), so every output row is read from exactly one
place and written once: no separate gather/scatter passes, and the order of
``fresh_idx`` does not matter (no sort needed).

    row t:   src[t] = -1  ->  x = cached[h, t]          (reused row)
             src[t] =  i  ->  x = fresh[h, i]           (recomputed row)
    K dims:  [0, R/2) | [R/2, R) rotated at row t's new position | [R, D) passed through

Offsets: each tile's head and first row are 64-bit base offsets (views of a larger buffer, e.g.
``out`` as rows of a token-major multi-layer KV cache past 2**31 elements), fresh rows are
addressed through the int64 source map; offsets inside a tile stay int32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_rope_mix, check_rope_mix_out
from .launch import next_pow2, on_device, require_int32_tiles, require_runnable


@triton.jit
def _load_mixed(c_ptr, s_c_t, s_c_d, f_ptr, s_f_s, s_f_d, tile, src, is_cached, is_fresh, cols, col_ok):
    """(BLOCK_T, BLOCK_C) fp32 tile: cached rows from c_ptr (the tile's first row; ``tile`` the rows
    within it), fresh rows from f_ptr (the head's row 0; ``src`` int64 rows)."""
    c = tl.load(c_ptr + tile[:, None] * s_c_t + cols[None, :] * s_c_d,
                mask=is_cached[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    f = tl.load(f_ptr + src[:, None] * s_f_s + cols[None, :] * s_f_d,
                mask=is_fresh[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    return tl.where(is_fresh[:, None], f, c)


@triton.jit
def _rope_mix_kernel(
    ck_ptr, cv_ptr, cos_ptr, sin_ptr, src_ptr, fk_ptr, fv_ptr, ok_ptr, ov_ptr,
    T, D, HALF,
    s_ck_h, s_ck_t, s_ck_d, s_cv_h, s_cv_t, s_cv_d,
    s_cos_t, s_cos_r, s_sin_t, s_sin_r,
    s_fk_h, s_fk_s, s_fk_d, s_fv_h, s_fv_s, s_fv_d,
    s_o_h, s_o_t,
    BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
    BLOCK_D: tl.constexpr, HAS_PASS: tl.constexpr,
):
    pid_t = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    t0 = pid_t.to(tl.int64) * BLOCK_T  # the tile's first row, for 64-bit base offsets
    tile = tl.arange(0, BLOCK_T)  # (BLOCK_T,) rows within the tile: int32 offsets
    rows = pid_t * BLOCK_T + tile  # (BLOCK_T,) row indices, int32 (< T)
    row_ok = rows < T
    src = tl.load(src_ptr + rows, mask=row_ok, other=-1)  # (BLOCK_T,) int64 fresh row or -1
    is_fresh = row_ok & (src >= 0)
    is_cached = row_ok & (src < 0)
    src = tl.where(is_fresh, src, 0)

    ck = ck_ptr + h * s_ck_h + t0 * s_ck_t
    cv = cv_ptr + h * s_cv_h + t0 * s_cv_t
    fk = fk_ptr + h * s_fk_h
    fv = fv_ptr + h * s_fv_h
    ok = ok_ptr + h * s_o_h + t0 * s_o_t + tile[:, None] * s_o_t  # (BLOCK_T, 1) row starts
    ov = ov_ptr + h * s_o_h + t0 * s_o_t + tile[:, None] * s_o_t
    cos_t = cos_ptr + t0 * s_cos_t + tile[:, None] * s_cos_t  # (BLOCK_T, 1)
    sin_t = sin_ptr + t0 * s_sin_t + tile[:, None] * s_sin_t

    # K, rotated dims: x1 = x[:R/2], x2 = x[R/2:R]; out = (x1*c1 - x2*s1, x2*c2 + x1*s2)
    hc = tl.arange(0, BLOCK_HALF)  # (BLOCK_HALF,)
    h_ok = hc < HALF
    x1 = _load_mixed(ck, s_ck_t, s_ck_d, fk, s_fk_s, s_fk_d, tile, src, is_cached, is_fresh, hc, h_ok)
    x2 = _load_mixed(ck, s_ck_t, s_ck_d, fk, s_fk_s, s_fk_d, tile, src, is_cached, is_fresh, HALF + hc, h_ok)
    tm = row_ok[:, None] & h_ok[None, :]  # (BLOCK_T, BLOCK_HALF)
    c1 = tl.load(cos_t + hc[None, :] * s_cos_r, mask=tm, other=0.0).to(tl.float32)
    c2 = tl.load(cos_t + (HALF + hc)[None, :] * s_cos_r, mask=tm, other=0.0).to(tl.float32)
    s1 = tl.load(sin_t + hc[None, :] * s_sin_r, mask=tm, other=0.0).to(tl.float32)
    s2 = tl.load(sin_t + (HALF + hc)[None, :] * s_sin_r, mask=tm, other=0.0).to(tl.float32)
    out_ty = ok_ptr.dtype.element_ty
    tl.store(ok + hc[None, :], (x1 * c1 - x2 * s1).to(out_ty), mask=tm)
    tl.store(ok + (HALF + hc)[None, :], (x2 * c2 + x1 * s2).to(out_ty), mask=tm)

    # K, pass-through dims [R, D) (partial rotary)
    if HAS_PASS:
        pc = 2 * HALF + tl.arange(0, BLOCK_PASS)
        p_ok = pc < D
        xp = _load_mixed(ck, s_ck_t, s_ck_d, fk, s_fk_s, s_fk_d, tile, src, is_cached, is_fresh, pc, p_ok)
        tl.store(ok + pc[None, :], xp.to(out_ty), mask=row_ok[:, None] & p_ok[None, :])

    # V: mix only
    dc = tl.arange(0, BLOCK_D)
    d_ok = dc < D
    xv = _load_mixed(cv, s_cv_t, s_cv_d, fv, s_fv_s, s_fv_d, tile, src, is_cached, is_fresh, dc, d_ok)
    tl.store(ov + dc[None, :], xv.to(ov_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def rope_mix_triton(
    cached_k: torch.Tensor,
    cached_v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    fresh_idx: torch.Tensor,
    fresh_k: torch.Tensor,
    fresh_v: torch.Tensor,
    trusted_indices: bool = False,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher of the Triton ``rope_mix`` (contract: ``blend.kernels.rope_mix``).

    Any strides are accepted (passed to the kernel, no copies); ``fresh_idx``
    may be unsorted; duplicates raise ValueError.

    Args:
        cached_k: (Hkv, T, D) keys before RoPE.
        cached_v: (Hkv, T, D) values, same dtype as ``cached_k``.
        cos: (T, R) rotary table at each row's new absolute position; R even, R <= D.
        sin: (T, R) likewise.
        fresh_idx: (S,) int64 distinct row indices in [0, T), any order.
        fresh_k: (Hkv, S, D) recomputed keys before RoPE.
        fresh_v: (Hkv, S, D) recomputed values.
        trusted_indices: the caller guarantees ``fresh_idx`` is in range and duplicate-free (no check).
        out: ``(k_out, v_out)``, (Hkv, T, D) each, written instead of allocating; None: new tensors.

    Returns:
        ``(k_rot, v)``: (Hkv, T, D) keys after RoPE and (Hkv, T, D) values, new contiguous tensors in the
        inputs' dtype (or ``out``); the inputs are not modified.

    Raises:
        ValueError: as :func:`check_rope_mix` and :func:`check_rope_mix_out`; a launch the kernel cannot run
            (a CPU tensor without ``TRITON_INTERPRET=1``, another device) or a view whose tile offsets
            overflow int32.
    """
    shp = check_rope_mix(cached_k, cached_v, cos, sin, fresh_idx, fresh_k, fresh_v, trusted_indices)
    interp = require_runnable(_rope_mix_kernel, cached_k, "rope_mix")
    hkv, t, d, r = shp.heads, shp.rows, shp.head_dim, shp.rot_dim
    check_rope_mix_out(out, cached_k, cached_v)
    if out is None:
        out_k = torch.empty((hkv, t, d), dtype=cached_k.dtype, device=cached_k.device)  # (Hkv, T, D)
        out_v = torch.empty((hkv, t, d), dtype=cached_v.dtype, device=cached_v.device)  # (Hkv, T, D)
    else:  # the kernel writes through out's strides (e.g. rows of a KV cache)
        out_k, out_v = out
    if out_k.numel() == 0:
        return out_k, out_v
    src = torch.full((t,), -1, dtype=torch.int64, device=cached_k.device)  # (T,)
    src[fresh_idx] = torch.arange(shp.fresh, dtype=torch.int64, device=cached_k.device)
    block_t = 32 if interp else 16
    for name, x, tile in (("cached_k", cached_k, (1, block_t, d)), ("cached_v", cached_v, (1, block_t, d)),
                          ("fresh_k", fresh_k, (1, 1, d)), ("fresh_v", fresh_v, (1, 1, d)),
                          ("cos", cos, (block_t, r)), ("sin", sin, (block_t, r)),
                          ("k_out", out_k, (1, block_t, d)), ("v_out", out_v, (1, block_t, d))):
        require_int32_tiles("rope_mix", name, x, tile)
    has_pass = r < d
    grid = (triton.cdiv(t, block_t), hkv)
    with on_device(cached_k):  # the tensors' GPU, not the current one
        _rope_mix_kernel[grid](
            cached_k, cached_v, cos, sin, src, fresh_k, fresh_v, out_k, out_v,
            t, d, r // 2,
            *cached_k.stride(), *cached_v.stride(),
            *cos.stride(), *sin.stride(),
            *fresh_k.stride(), *fresh_v.stride(),
            out_k.stride(0), out_k.stride(1),
            BLOCK_T=block_t, BLOCK_HALF=next_pow2(r // 2), BLOCK_PASS=next_pow2(d - r) if has_pass else 1,
            BLOCK_D=next_pow2(d), HAS_PASS=has_pass,
            num_warps=4,
        )
    return out_k, out_v
