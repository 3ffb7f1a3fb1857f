"""Input builders and the TOL-based comparison shared by the kernel tests and the benchmark.

Layouts let every test feed the same values through non-contiguous views:

    CONTIGUOUS    (H, T, D) as allocated
    TOKEN_MAJOR   allocated (T, H, D), viewed (H, T, D)   (the layout of a (B, T, H, D) projection)
    DIM_STRIDED   allocated (H, D, T), viewed (H, T, D)   (head dim not unit-stride)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from .tolerances import TOL


class Layout(enum.Enum):
    CONTIGUOUS = "contiguous"
    TOKEN_MAJOR = "token_major"
    DIM_STRIDED = "dim_strided"


def randn3(h: int, t: int, d: int, dtype: torch.dtype, layout: Layout, gen: torch.Generator,
           device: str | torch.device = "cpu") -> torch.Tensor:
    """(h, t, d) standard-normal tensor in the given memory layout."""
    if layout is Layout.TOKEN_MAJOR:
        return torch.randn(t, h, d, generator=gen).to(device=device, dtype=dtype).transpose(0, 1)
    if layout is Layout.DIM_STRIDED:
        return torch.randn(h, d, t, generator=gen).to(device=device, dtype=dtype).transpose(1, 2)
    return torch.randn(h, t, d, generator=gen).to(device=device, dtype=dtype)


def rotary_tables(positions: torch.Tensor, rot_dim: int, base: float = 10000.0,
                  attention_scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Default (HF Llama) RoPE tables: (T,) positions -> cos, sin (T, rot_dim) fp32."""
    inv_freq = 1.0 / base ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)  # (R/2,)
    freqs = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # (T, R/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (T, R)
    return (emb.cos() * attention_scaling).float(), (emb.sin() * attention_scaling).float()


@dataclass(frozen=True)
class RopeMixInputs:
    cached_k: torch.Tensor  # (Hkv, T, D)
    cached_v: torch.Tensor  # (Hkv, T, D)
    cos: torch.Tensor  # (T, R)
    sin: torch.Tensor  # (T, R)
    fresh_idx: torch.Tensor  # (S,)
    fresh_k: torch.Tensor  # (Hkv, S, D)
    fresh_v: torch.Tensor  # (Hkv, S, D)

    def args(self) -> tuple[torch.Tensor, ...]:
        return (self.cached_k, self.cached_v, self.cos, self.sin, self.fresh_idx, self.fresh_k, self.fresh_v)


def make_rope_mix_inputs(hkv: int, t: int, d: int, rot_dim: int, fresh_idx: torch.Tensor,
                         dtype: torch.dtype, layout: Layout = Layout.CONTIGUOUS, seed: int = 0,
                         device: str | torch.device = "cpu", pos_offset: int = 100) -> RopeMixInputs:
    """Random rope_mix inputs; rows move to positions ``pos_offset + t`` (a re-positioned chunk)."""
    gen = torch.Generator().manual_seed(seed)
    s = fresh_idx.numel()
    cos, sin = rotary_tables(torch.arange(t) + pos_offset, rot_dim)
    if layout is not Layout.CONTIGUOUS:  # non-contiguous tables too
        cos, sin = cos.t().contiguous().t(), sin.t().contiguous().t()
    return RopeMixInputs(
        cached_k=randn3(hkv, t, d, dtype, layout, gen, device),
        cached_v=randn3(hkv, t, d, dtype, layout, gen, device),
        cos=cos.to(device), sin=sin.to(device),
        fresh_idx=fresh_idx.to(device=device, dtype=torch.int64),
        fresh_k=randn3(hkv, s, d, dtype, layout, gen, device),
        fresh_v=randn3(hkv, s, d, dtype, layout, gen, device),
    )


@dataclass(frozen=True)
class AttentionInputs:
    q: torch.Tensor  # (Hq, S, D)
    q_pos: torch.Tensor  # (S,)
    k: torch.Tensor  # (Hkv, T, D)
    v: torch.Tensor  # (Hkv, T, D)
    k_pos: torch.Tensor  # (T,)
    scale: float

    def args(self) -> tuple:
        return (self.q, self.q_pos, self.k, self.v, self.k_pos, self.scale)


def make_attention_inputs(hkv: int, group: int, t: int, d: int, q_rows: torch.Tensor, dtype: torch.dtype,
                          layout: Layout = Layout.CONTIGUOUS, seed: int = 0,
                          device: str | torch.device = "cpu", k_pos: torch.Tensor | None = None) -> AttentionInputs:
    """Random attention inputs; queries sit at the positions of key rows ``q_rows``."""
    gen = torch.Generator().manual_seed(seed)
    k_pos = (torch.arange(t) + 7) if k_pos is None else k_pos  # (T,) absolute positions
    q_rows = q_rows.to(torch.int64)
    return AttentionInputs(
        q=randn3(hkv * group, q_rows.numel(), d, dtype, layout, gen, device),
        q_pos=k_pos[q_rows].to(device),
        k=randn3(hkv, t, d, dtype, layout, gen, device),
        v=randn3(hkv, t, d, dtype, layout, gen, device),
        k_pos=k_pos.to(device),
        scale=d ** -0.5,
    )


def assert_close_tol(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    """``torch.testing.assert_close`` with ``TOL[dtype]`` (dtype defaults to ``expected.dtype``)."""
    tol = TOL[dtype or expected.dtype]
    torch.testing.assert_close(actual, expected, atol=tol.atol, rtol=tol.rtol)
