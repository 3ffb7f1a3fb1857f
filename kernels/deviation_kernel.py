"""Triton kernel for ``kv_deviation``: per-token L2 norm of (fresh - cached) over heads and dims.

One program reduces BLOCK_S tokens over all H heads and D dims (fp32 sums of
squares), then writes their square roots: (H, S, D) x 2 -> (S,). Each head's and
token block's base offset is 64-bit (views of a buffer past 2**31 elements);
offsets inside a tile stay int32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_deviation
from .launch import next_pow2, on_device, require_int32_tiles, require_runnable


@triton.jit
def _kv_deviation_kernel(
    f_ptr, c_ptr, out_ptr,
    H, S, D,
    s_f_h, s_f_s, s_f_d, s_c_h, s_c_s, s_c_d,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    s0 = pid.to(tl.int64) * BLOCK_S  # the block's first token, for 64-bit base offsets
    tile = tl.arange(0, BLOCK_S)  # (BLOCK_S,)
    toks = pid * BLOCK_S + tile  # (BLOCK_S,) token indices, int32 (< S)
    tok_ok = toks < S
    f_blk = f_ptr + s0 * s_f_s
    c_blk = c_ptr + s0 * s_c_s
    acc = tl.zeros((BLOCK_S, BLOCK_D), dtype=tl.float32)
    for h in range(0, H):
        h64 = tl.cast(h, tl.int64)  # the loop counter is int32
        f_row = f_blk + h64 * s_f_h + tile[:, None] * s_f_s  # (BLOCK_S, 1)
        c_row = c_blk + h64 * s_c_h + tile[:, None] * s_c_s
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)  # (BLOCK_D,)
            m = tok_ok[:, None] & (cols < D)[None, :]
            f = tl.load(f_row + cols[None, :] * s_f_d, mask=m, other=0.0).to(tl.float32)
            c = tl.load(c_row + cols[None, :] * s_c_d, mask=m, other=0.0).to(tl.float32)
            diff = f - c
            acc += diff * diff
    tl.store(out_ptr + toks, tl.sqrt(tl.sum(acc, axis=1)), mask=tok_ok)


def kv_deviation_triton(fresh: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
    """Launcher of the Triton ``kv_deviation`` (contract: ``blend.kernels.kv_deviation``).

    Any strides are accepted; the two inputs may have different float dtypes.

    Args:
        fresh: (H, S, D) any float dtype, any strides.
        cached: (H, S, D) any float dtype, any strides.

    Returns:
        (S,) float32: ``sqrt(sum over h, d of (fresh - cached)**2)``, computed in fp32.

    Raises:
        ValueError: as :func:`check_deviation`; a launch the kernel cannot run (a CPU tensor without
            ``TRITON_INTERPRET=1``, another device) or a view whose tile offsets overflow int32.
    """
    check_deviation(fresh, cached)
    interp = require_runnable(_kv_deviation_kernel, fresh, "kv_deviation")
    h, s, d = fresh.shape
    out = torch.empty((s,), dtype=torch.float32, device=fresh.device)  # (S,)
    if s == 0:
        return out
    if h == 0 or d == 0:
        return out.zero_()
    block_s = 64 if interp else 32
    block_d = min(next_pow2(d), 128)
    require_int32_tiles("kv_deviation", "fresh", fresh, (1, block_s, d))
    require_int32_tiles("kv_deviation", "cached", cached, (1, block_s, d))
    with on_device(fresh):  # the tensors' GPU, not the current one
        _kv_deviation_kernel[(triton.cdiv(s, block_s),)](
            fresh, cached, out, h, s, d,
            *fresh.stride(), *cached.stride(),
            BLOCK_S=block_s, BLOCK_D=block_d, num_warps=4,
        )
    return out
