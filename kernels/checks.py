"""Argument checks shared by the torch references and the Triton launchers.

Both paths reject the same inputs with the same ``ValueError``, so switching
backend never changes which calls are legal. Index validation (range,
duplicates) reads one flag pair back from the device: one host sync per call,
which callers that build the indices themselves skip (``trusted_indices``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def nondecreasing(x: torch.Tensor) -> bool:
    """Whether 1-D positions are in order (the blend path's layout, which the fast CPU paths need).

    Args:
        x: (N,) positions.

    Returns:
        Whether each is >= the one before (True for fewer than two).
    """
    return x.numel() < 2 or bool((x[1:] >= x[:-1]).all())


def same_positions(made: torch.Tensor, given: torch.Tensor) -> bool:
    """Positions a plan was made from and a call's: the same tensor (a caller reusing its plan) costs
    nothing; other tensors are compared.

    Args:
        made: the positions a plan (or a mask) was made from; given: a call's.

    Returns:
        Whether they are the same positions.
    """
    return made is given or (made.shape == given.shape and bool(torch.equal(made, given)))


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def _same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    _require(len(set(devices.values())) == 1, f"all inputs must be on one device, got {devices}")


def _float(name: str, t: torch.Tensor) -> None:
    _require(t.dtype in FLOAT_DTYPES, f"{name} must be fp32/fp16/bf16, got {t.dtype}")


def _positions(name: str, t: torch.Tensor, n: int) -> None:
    _require(t.dtype == torch.int64, f"{name} must be int64, got {t.dtype}")
    _require(tuple(t.shape) == (n,), f"{name} must have shape ({n},), got {tuple(t.shape)}")


@dataclass(frozen=True)
class RopeMixShape:
    heads: int  # Hkv
    rows: int  # T
    head_dim: int  # D
    rot_dim: int  # R
    fresh: int  # S


def check_rope_mix(
    cached_k: torch.Tensor,
    cached_v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    fresh_idx: torch.Tensor,
    fresh_k: torch.Tensor,
    fresh_v: torch.Tensor,
    trusted_indices: bool = False,
) -> RopeMixShape:
    """Validate ``rope_mix`` arguments; returns the sizes. Raises ValueError.

    ``trusted_indices`` skips the range/duplicate check of ``fresh_idx`` (and its
    host sync): for callers that build the indices themselves (the engine).

    Args:
        cached_k: (Hkv, T, D) keys before RoPE, a float dtype.
        cached_v: (Hkv, T, D) values, same dtype as ``cached_k``.
        cos: (T, R) rotary table, R even, 0 < R <= D, a float dtype.
        sin: (T, R) likewise, same dtype as ``cos``.
        fresh_idx: (S,) int64 row indices.
        fresh_k: (Hkv, S, D) recomputed keys, same dtype as ``cached_k``.
        fresh_v: (Hkv, S, D) recomputed values, same dtype as ``cached_k``.
        trusted_indices: skip the range and duplicate check of ``fresh_idx``.

    Returns:
        The sizes: Hkv, T, D, R and S.

    Raises:
        ValueError: a shape, dtype or device mismatch, or (unless trusted) an index out of [0, T) or repeated.
    """
    _require(cached_k.dim() == 3, f"cached_k must be (Hkv, T, D), got {tuple(cached_k.shape)}")
    hkv, t, d = cached_k.shape
    _require(tuple(cached_v.shape) == (hkv, t, d), f"cached_v must be {(hkv, t, d)}, got {tuple(cached_v.shape)}")
    _require(cos.dim() == 2 and cos.shape[0] == t, f"cos must be (T={t}, R), got {tuple(cos.shape)}")
    _require(sin.shape == cos.shape, f"sin {tuple(sin.shape)} must match cos {tuple(cos.shape)}")
    r = cos.shape[1]
    _require(r % 2 == 0 and 0 < r <= d, f"rotary dim R={r} must be even and in (0, D={d}]")
    _require(fresh_idx.dim() == 1, f"fresh_idx must be (S,), got {tuple(fresh_idx.shape)}")
    s = fresh_idx.shape[0]
    _positions("fresh_idx", fresh_idx, s)
    _require(tuple(fresh_k.shape) == (hkv, s, d), f"fresh_k must be {(hkv, s, d)}, got {tuple(fresh_k.shape)}")
    _require(tuple(fresh_v.shape) == (hkv, s, d), f"fresh_v must be {(hkv, s, d)}, got {tuple(fresh_v.shape)}")
    _float("cached_k", cached_k)
    _float("cos", cos)
    _require(sin.dtype == cos.dtype, f"sin dtype {sin.dtype} != cos dtype {cos.dtype}")
    for name, x in (("cached_v", cached_v), ("fresh_k", fresh_k), ("fresh_v", fresh_v)):
        _require(x.dtype == cached_k.dtype, f"{name} dtype {x.dtype} != cached_k dtype {cached_k.dtype}")
    _same_device(cached_k=cached_k, cached_v=cached_v, cos=cos, sin=sin,
                 fresh_idx=fresh_idx, fresh_k=fresh_k, fresh_v=fresh_v)
    if s > 0 and not trusted_indices:
        srt = torch.sort(fresh_idx).values  # (S,)
        flags = torch.stack([(srt[0] < 0) | (srt[-1] >= t), (srt[1:] == srt[:-1]).any()]).tolist()
        _require(not flags[0], f"fresh_idx must lie in [0, {t})")
        _require(not flags[1], "fresh_idx must not contain duplicate rows")
    return RopeMixShape(heads=hkv, rows=t, head_dim=d, rot_dim=r, fresh=s)


def check_deviation(fresh: torch.Tensor, cached: torch.Tensor) -> None:
    """Validate ``kv_deviation`` arguments. Raises ValueError.

    Args:
        fresh: (H, S, D), a float dtype.
        cached: (H, S, D), a float dtype (may differ from ``fresh``'s), on ``fresh``'s device.

    Raises:
        ValueError: a shape or device mismatch, or a non-float input.
    """
    _require(fresh.dim() == 3, f"fresh must be (H, S, D), got {tuple(fresh.shape)}")
    _require(cached.shape == fresh.shape, f"cached {tuple(cached.shape)} must match fresh {tuple(fresh.shape)}")
    _float("fresh", fresh)
    _float("cached", cached)
    _same_device(fresh=fresh, cached=cached)


@dataclass(frozen=True)
class AttentionShape:
    q_heads: int  # Hq
    kv_heads: int  # Hkv
    queries: int  # S
    keys: int  # T
    head_dim: int  # D


def check_attention(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float,
) -> AttentionShape:
    """Validate ``sparse_query_attention`` arguments; returns the sizes. Raises ValueError.

    Args:
        q: (Hq, S, D) queries, a float dtype.
        q_pos: (S,) int64 positions of the queries.
        k: (Hkv, T, D) keys, same dtype as ``q``; Hq % Hkv == 0.
        v: (Hkv, T, D) values, same dtype as ``q``.
        k_pos: (T,) int64 positions of the keys.
        scale: softmax scale, a Python number (not a bool).

    Returns:
        The sizes: Hq, Hkv, S, T and D.

    Raises:
        ValueError: a shape, dtype, device or type mismatch.
    """
    _require(q.dim() == 3, f"q must be (Hq, S, D), got {tuple(q.shape)}")
    _require(k.dim() == 3, f"k must be (Hkv, T, D), got {tuple(k.shape)}")
    hq, s, d = q.shape
    hkv, t, dk = k.shape
    _require(dk == d, f"k head dim {dk} != q head dim {d}")
    _require(tuple(v.shape) == (hkv, t, d), f"v must be {(hkv, t, d)}, got {tuple(v.shape)}")
    _require(hkv > 0 and hq % hkv == 0, f"Hq={hq} must be a multiple of Hkv={hkv}")
    _positions("q_pos", q_pos, s)
    _positions("k_pos", k_pos, t)
    _float("q", q)
    for name, x in (("k", k), ("v", v)):
        _require(x.dtype == q.dtype, f"{name} dtype {x.dtype} != q dtype {q.dtype}")
    _require(isinstance(scale, (float, int)) and not isinstance(scale, bool),
             f"scale must be a Python float, got {type(scale).__name__}")
    _same_device(q=q, q_pos=q_pos, k=k, v=v, k_pos=k_pos)
    return AttentionShape(q_heads=hq, kv_heads=hkv, queries=s, keys=t, head_dim=d)


def check_rope_mix_out(out: tuple[torch.Tensor, torch.Tensor] | None, cached_k: torch.Tensor,
                       cached_v: torch.Tensor) -> None:
    """Validate ``rope_mix``'s ``out`` (two (Hkv, T, D) tensors, e.g. views of a KV cache). Raises ValueError.

    Args:
        out: ``(k_out, v_out)``, or None (nothing to check).
        cached_k: (Hkv, T, D) the keys ``k_out`` must match in shape, dtype and device.
        cached_v: (Hkv, T, D) the values ``v_out`` must match.

    Raises:
        ValueError: not a pair, another shape, dtype or device, not contiguous along D, or the two with
            different strides.
    """
    if out is None:
        return
    if not (isinstance(out, tuple) and len(out) == 2):
        raise ValueError("rope_mix out must be a (k_out, v_out) pair")
    k_out, v_out = out
    for name, o, ref in (("k_out", k_out, cached_k), ("v_out", v_out, cached_v)):
        if tuple(o.shape) != tuple(ref.shape):
            raise ValueError(f"rope_mix {name} shape {tuple(o.shape)} != {tuple(ref.shape)}")
        if o.dtype != ref.dtype or o.device != ref.device:
            raise ValueError(f"rope_mix {name} must be {ref.dtype} on {ref.device}, got {o.dtype} on {o.device}")
        if o.numel() and o.stride(-1) != 1:
            raise ValueError(f"rope_mix {name} must be contiguous along head_dim")
    if k_out.stride() != v_out.stride():
        raise ValueError("rope_mix k_out and v_out must share strides")
