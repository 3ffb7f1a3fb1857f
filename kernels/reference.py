"""Torch references: the CPU path and the oracle of the Triton kernels.

Same signatures as the public functions. No Python loops over tokens or heads;
each is the fastest plain-torch formulation measured on CPU
(``python -m blend.evals.bench_kernels``). Sparse-query attention's CPU path is
``query_blocks`` (its reference here is the oracle, and the route of the calls
the blocks do not serve).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .checks import check_attention, check_deviation, check_rope_mix, check_rope_mix_out


def _rotate_into_fp32(out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """out[..., :R] = x*cos + rotate_half(x)*sin in fp32 (R = cos.shape[-1]); out[..., R:] = x[..., R:].

    rope_mix's reference: float32 math for any x dtype, each second term added by ``addcmul_``,
    so its last bits differ from the engine's own RoPE (:func:`blend.rope._rotate_into`, products in x's
    dtype then sums), which the blend's re-positioned keys use."""
    r = cos.shape[-1]
    half = r // 2
    xf = x[..., :r].float()  # (H, N, R), no copy when x is fp32
    rot = out[..., :r] if out.dtype == torch.float32 else torch.empty(xf.shape, dtype=torch.float32, device=x.device)
    torch.mul(xf[..., :half], cos[:, :half], out=rot[..., :half])
    rot[..., :half].addcmul_(xf[..., half:], sin[:, :half], value=-1.0)  # x1*c1 - x2*s1
    torch.mul(xf[..., half:], cos[:, half:], out=rot[..., half:])
    rot[..., half:].addcmul_(xf[..., :half], sin[:, half:])  # x2*c2 + x1*s2
    if rot.data_ptr() != out.data_ptr():
        out[..., :r] = rot
    if r < x.shape[-1]:
        out[..., r:] = x[..., r:]  # partial rotary: the rest passes through


def rope_mix_ref(
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
    """Torch reference of ``blend.kernels.rope_mix`` (same contract).

    Rotates every cached row straight into the output, then rotates the fresh
    rows at their rows' positions and scatters them over: one full pass over K
    instead of copy-then-rotate.

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
        ValueError: as :func:`check_rope_mix` and :func:`check_rope_mix_out`.
    """
    shp = check_rope_mix(cached_k, cached_v, cos, sin, fresh_idx, fresh_k, fresh_v, trusted_indices)
    check_rope_mix_out(out, cached_k, cached_v)
    cos = cos.float()  # (T, R)
    sin = sin.float()  # (T, R)
    k_out = out[0] if out is not None else torch.empty(cached_k.shape, dtype=cached_k.dtype,
                                                       device=cached_k.device)  # (Hkv, T, D)
    _rotate_into_fp32(k_out, cached_k, cos, sin)
    if shp.fresh > 0:
        k_fresh = torch.empty(fresh_k.shape, dtype=fresh_k.dtype, device=fresh_k.device)  # (Hkv, S, D)
        _rotate_into_fp32(k_fresh, fresh_k, cos[fresh_idx], sin[fresh_idx])
        k_out.index_copy_(1, fresh_idx, k_fresh)
    if out is not None:  # straight into the caller's rows (e.g. a KV cache), no temporary
        v_out = out[1]
        v_out.copy_(cached_v)
        if shp.fresh > 0:
            v_out.index_copy_(1, fresh_idx, fresh_v)
        return k_out, v_out
    v_out = cached_v.index_copy(1, fresh_idx, fresh_v)  # (Hkv, T, D)
    if not v_out.is_contiguous():
        v_out = v_out.contiguous()
    return k_out, v_out


def rope_rows_ref(k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of ``blend.kernels.rope_rows``: :func:`rope_mix_ref` with no fresh rows, bit for
    bit, without its argument checks.

    Args:
        k: (H, T, D) keys before RoPE.
        v: (H, T, D) values.
        cos: (T, R) rotary table.
        sin: (T, R) likewise.
        out: ``(k_out, v_out)``, (H, T, D) each, written instead of allocating; None: K into a new tensor.

    Returns:
        ``(k_rot, v)``: K after RoPE (new, or ``out[0]``) and V (``v`` itself, or ``out[1]`` holding a copy).
    """
    k_out = out[0] if out is not None else torch.empty(k.shape, dtype=k.dtype, device=k.device)  # (H, T, D)
    _rotate_into_fp32(k_out, k, cos.float(), sin.float())
    if out is None:
        return k_out, v
    out[1].copy_(v)
    return k_out, out[1]


def kv_deviation_ref(fresh: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
    """Torch reference of ``blend.kernels.kv_deviation`` (same contract).

    Args:
        fresh: (H, S, D) any float dtype.
        cached: (H, S, D) any float dtype.

    Returns:
        (S,) float32: ``sqrt(sum over h, d of (fresh - cached)**2)``, computed in fp32.

    Raises:
        ValueError: as :func:`check_deviation`.
    """
    check_deviation(fresh, cached)
    diff = fresh.float() - cached.float()  # (H, S, D)
    return torch.linalg.vector_norm(diff, dim=(0, 2))  # (S,)


def sparse_query_attention_ref(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Torch reference of ``blend.kernels.sparse_query_attention`` (same contract).

    SDPA with an explicit boolean (S, T) mask and native GQA; fp16/bf16 inputs
    are upcast so the oracle accumulates in fp32 on every backend.

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
        ValueError: as :func:`check_attention`.
    """
    shp = check_attention(q, q_pos, k, v, k_pos, scale)
    if shp.queries == 0 or shp.keys == 0:
        return torch.zeros_like(q, memory_format=torch.contiguous_format)
    visible = k_pos[None, :] <= q_pos[:, None]  # (S, T)
    qf, kf, vf = q.float(), k.float(), v.float()
    out = F.scaled_dot_product_attention(
        qf[None], kf[None], vf[None], attn_mask=visible, scale=float(scale),
        enable_gqa=shp.q_heads != shp.kv_heads,
    )[0]  # (Hq, S, D)
    seen = visible.any(dim=1)  # (S,)
    out = torch.where(seen[None, :, None], out, 0.0)  # rows with no visible key -> 0, never NaN
    return out.to(q.dtype)
