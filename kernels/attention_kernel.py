"""Triton kernel for ``sparse_query_attention``: tiled online-softmax attention of
a subset of queries over the whole K/V, causal by absolute position, GQA.

Grid: (query blocks of BLOCK_M, query heads). Each program keeps running max
``m``, normaliser ``l`` and accumulator ``acc`` in fp32 and walks the keys in
blocks of BLOCK_N; a key block whose smallest position is after every query
of the block is skipped (so causal work is skipped when positions are sorted,
and nothing is assumed when they are not).

    key j visible to query i  <=>  k_pos[j] <= q_pos[i]
    query head h  ->  kv head h // (Hq // Hkv)

Fully-masked rows: ``m`` stays -inf; exponentials are taken against a finite
stand-in (0), so they contribute exactly 0 and the row's output is 0, not NaN.

Offsets: each tile's base (head, first query row, first key row) is computed in int64, so q/K/V
views of a larger buffer (a token-major multi-layer KV cache: token stride L*2*Hkv*D) work past
2**31 elements; offsets inside a tile stay int32 (the launcher checks that they fit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_attention
from .launch import next_pow2, on_device, require_int32_tiles, require_runnable

_LOG2E = 1.4426950408889634
_POS_PAD = 2**62  # position given to padded key slots: after every real query


@triton.jit
def _sparse_attn_kernel(
    q_ptr, qpos_ptr, k_ptr, v_ptr, kpos_ptr, o_ptr,
    S, T, D, GROUP, qk_scale,
    s_q_h, s_q_s, s_q_d, s_k_h, s_k_t, s_k_d, s_v_h, s_v_t, s_v_d, s_o_h, s_o_s,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr, POS_PAD: tl.constexpr,
):
    pid_m = tl.program_id(0)
    hq = tl.program_id(1).to(tl.int64)
    hkv = hq // GROUP
    m0 = pid_m.to(tl.int64) * BLOCK_M  # the tile's first query row, for 64-bit base offsets
    tile_m = tl.arange(0, BLOCK_M)  # (BLOCK_M,) rows within a tile: int32 offsets
    tile_n = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    offs_m = pid_m * BLOCK_M + tile_m  # (BLOCK_M,) query indices, int32 (< S)
    offs_d = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    m_ok = offs_m < S
    d_ok = offs_d < D

    q_tile = q_ptr + hq * s_q_h + m0 * s_q_s
    q = tl.load(q_tile + tile_m[:, None] * s_q_s + offs_d[None, :] * s_q_d,
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_D)
    if DOT_FP32:
        q = q.to(tl.float32)
    q_pos = tl.load(qpos_ptr + offs_m, mask=m_ok, other=-POS_PAD)  # (BLOCK_M,)
    last_q = tl.max(q_pos, axis=0)

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    k_base = k_ptr + hkv * s_k_h
    v_base = v_ptr + hkv * s_v_h
    for n0 in range(0, T, BLOCK_N):
        offs_n = n0 + tile_n  # (BLOCK_N,)
        n_ok = offs_n < T
        k_pos = tl.load(kpos_ptr + offs_n, mask=n_ok, other=POS_PAD)  # (BLOCK_N,)
        if tl.min(k_pos, axis=0) <= last_q:
            kv_m = n_ok[:, None] & d_ok[None, :]
            n64 = tl.cast(n0, tl.int64)  # the loop counter is int32
            k = tl.load(k_base + n64 * s_k_t + tile_n[:, None] * s_k_t + offs_d[None, :] * s_k_d,
                        mask=kv_m, other=0.0)
            v = tl.load(v_base + n64 * s_v_t + tile_n[:, None] * s_v_t + offs_d[None, :] * s_v_d,
                        mask=kv_m, other=0.0)
            if DOT_FP32:
                qk = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")  # (BLOCK_M, BLOCK_N)
            else:
                qk = tl.dot(q, tl.trans(k))
            visible = (k_pos[None, :] <= q_pos[:, None]) & n_ok[None, :] & m_ok[:, None]
            qk = tl.where(visible, qk * qk_scale, float("-inf"))  # log2 domain
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # finite stand-in for empty rows
            p = tl.math.exp2(qk - m_ref[:, None])  # (BLOCK_M, BLOCK_N), 0 where masked
            alpha = tl.math.exp2(m_i - m_ref)  # (BLOCK_M,)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if DOT_FP32:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(o_ptr + hq * s_o_h + m0 * s_o_s + tile_m[:, None] * s_o_s + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


def _blocks(d: int, interp: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for head dim ``d`` (``interp``: the kernel is interpreted)."""
    if interp:  # few, fat program instances: each one costs ~0.5 ms in the interpreter
        return 16, 32, 4, 1
    if d <= 64:
        return 64, 64, 4, 3
    if d <= 128:
        return 64, 32, 4, 2
    return 32, 32, 4, 1


def sparse_query_attention_triton(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Launcher of the Triton ``sparse_query_attention`` (contract: ``blend.kernels.sparse_query_attention``).

    Any strides are accepted for q/k/v (passed to the kernel, no copies);
    position vectors are made contiguous. Head dims that are not powers of two
    are padded to BLOCK_D with masks (minimum 16, the smallest ``tl.dot`` tile).

    Args:
        q: (Hq, S, D) queries after RoPE, any strides.
        q_pos: (S,) int64 absolute positions of the queries.
        k: (Hkv, T, D) keys after RoPE, same dtype as ``q``; Hq % Hkv == 0.
        v: (Hkv, T, D) values, same dtype as ``q``.
        k_pos: (T,) int64 absolute positions of the keys.
        scale: softmax scale (usually ``D ** -0.5``).

    Returns:
        (Hq, S, D) in q's dtype; a query that sees no key gets zeros.

    Raises:
        ValueError: as :func:`check_attention`; a launch the kernel cannot run (a CPU tensor without
            ``TRITON_INTERPRET=1``, another device) or a view whose tile offsets overflow int32.
    """
    shp = check_attention(q, q_pos, k, v, k_pos, scale)
    interp = require_runnable(_sparse_attn_kernel, q, "attention")
    out = torch.empty((shp.q_heads, shp.queries, shp.head_dim), dtype=q.dtype, device=q.device)  # (Hq, S, D)
    if out.numel() == 0:
        return out
    if shp.keys == 0:
        return out.zero_()
    block_m, block_n, warps, stages = _blocks(shp.head_dim, interp)
    block_d = max(16, next_pow2(shp.head_dim))
    require_int32_tiles("attention", "q", q, (1, block_m, block_d))
    require_int32_tiles("attention", "k", k, (1, block_n, block_d))
    require_int32_tiles("attention", "v", v, (1, block_n, block_d))
    dot_fp32 = interp or q.dtype == torch.float32  # interpreter: no bf16/fp16 dot; fp32: no TF32
    grid = (triton.cdiv(shp.queries, block_m), shp.q_heads)
    with on_device(q):  # the tensors' GPU, not the current one
        _sparse_attn_kernel[grid](
            q, q_pos.contiguous(), k, v, k_pos.contiguous(), out,
            shp.queries, shp.keys, shp.head_dim, shp.q_heads // shp.kv_heads, float(scale) * _LOG2E,
            *q.stride(), *k.stride(), *v.stride(), out.stride(0), out.stride(1),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
            DOT_FP32=dot_fp32, POS_PAD=_POS_PAD,
            num_warps=warps, num_stages=stages,
        )
    return out
