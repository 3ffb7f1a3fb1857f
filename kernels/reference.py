"""Torch references: the CPU path and the oracle of the Triton kernels.

Same signatures as the public functions. No Python loops over tokens or heads;
each is the fastest plain-torch formulation measured on CPU
(``python -m blend.evals.bench_kernels``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .checks import check_attention, check_deviation, check_rope_mix


def rope_mix_ref(
    cached_k: torch.Tensor,
    cached_v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    fresh_idx: torch.Tensor,
    fresh_k: torch.Tensor,
    fresh_v: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of ``blend.kernels.rope_mix`` (same contract)."""
    shp = check_rope_mix(cached_k, cached_v, cos, sin, fresh_idx, fresh_k, fresh_v)
    half, r = shp.rot_dim // 2, shp.rot_dim
    k = cached_k.index_copy(1, fresh_idx, fresh_k)  # (Hkv, T, D) pre-RoPE, fresh rows in
    v = cached_v.index_copy(1, fresh_idx, fresh_v)  # (Hkv, T, D)
    if not v.is_contiguous():
        v = v.contiguous()
    cos = cos.float()  # (T, R)
    sin = sin.float()  # (T, R)
    x1 = k[..., :half].float()  # (Hkv, T, R/2)
    x2 = k[..., half:r].float()  # (Hkv, T, R/2)
    out = torch.empty(k.shape, dtype=k.dtype, device=k.device)  # (Hkv, T, D)
    out[..., :half] = x1 * cos[:, :half] - x2 * sin[:, :half]
    out[..., half:r] = x2 * cos[:, half:] + x1 * sin[:, half:]
    if r < shp.head_dim:
        out[..., r:] = k[..., r:]  # partial rotary: the rest passes through
    return out, v


def kv_deviation_ref(fresh: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
    """Torch reference of ``blend.kernels.kv_deviation`` (same contract)."""
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
