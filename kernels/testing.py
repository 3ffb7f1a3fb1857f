"""Input builders and the TOL-based comparison shared by the kernel tests and the benchmark.

Layouts let every test feed the same values through non-contiguous views:

    CONTIGUOUS    (H, T, D) as allocated
    TOKEN_MAJOR   allocated (T, H, D), viewed (H, T, D)   (the layout of a (B, T, H, D) projection)
    DIM_STRIDED   allocated (H, D, T), viewed (H, T, D)   (head dim not unit-stride)

Far views (:func:`far_views`) put the same values where a kernel's element offsets pass 2**31, the
range of 32-bit arithmetic, without committing gigabytes: see there.
"""

from __future__ import annotations

import enum
import mmap
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .tolerances import TOL


class Layout(enum.Enum):
    CONTIGUOUS = "contiguous"
    TOKEN_MAJOR = "token_major"
    DIM_STRIDED = "dim_strided"


def randn3(h: int, t: int, d: int, dtype: torch.dtype, layout: Layout, gen: torch.Generator,
           device: str | torch.device = "cpu") -> torch.Tensor:
    """(h, t, d) standard-normal tensor in the given memory layout.

    Args:
        h: heads; t: rows; d: head dim.
        dtype: the tensor's dtype (drawn in float32, then cast).
        layout: its memory layout (token-major and dim-strided ones are transposed views).
        gen: the random generator (CPU).
        device: where the tensor lives.

    Returns:
        (h, t, d) in ``dtype`` on ``device``.
    """
    if layout is Layout.TOKEN_MAJOR:
        return torch.randn(t, h, d, generator=gen).to(device=device, dtype=dtype).transpose(0, 1)
    if layout is Layout.DIM_STRIDED:
        return torch.randn(h, d, t, generator=gen).to(device=device, dtype=dtype).transpose(1, 2)
    return torch.randn(h, t, d, generator=gen).to(device=device, dtype=dtype)


def rotary_tables(positions: torch.Tensor, rot_dim: int, base: float = 10000.0,
                  attention_scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Default (HF Llama) RoPE tables: (T,) positions -> cos, sin (T, rot_dim) fp32.

    Args:
        positions: (T,) absolute positions.
        rot_dim: R, the rotary dim (even).
        base: RoPE's theta.
        attention_scaling: factor both tables are multiplied by.

    Returns:
        ``(cos, sin)``, (T, R) float32 each (computed in float64).
    """
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
    """Random rope_mix inputs; rows move to positions ``pos_offset + t`` (a re-positioned chunk).

    Args:
        hkv: KV heads; t: rows (T); d: head dim (D); rot_dim: R.
        fresh_idx: (S,) rows that get fresh K/V.
        dtype: the K/V tensors' dtype (the tables are float32).
        layout: the K/V tensors' memory layout (non-contiguous layouts make the tables non-contiguous too).
        seed: the random generator's seed.
        device: where the tensors live.
        pos_offset: the new position of row 0.

    Returns:
        The inputs: (Hkv, T, D) cached K/V, (T, R) tables, (S,) int64 indices, (Hkv, S, D) fresh K/V.
    """
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
    """Random attention inputs; queries sit at the positions of key rows ``q_rows``.

    Args:
        hkv: KV heads; group: query heads per KV head (Hq = hkv x group); t: key rows (T); d: head dim (D).
        q_rows: (S,) the key rows whose positions the queries take.
        dtype: q/k/v's dtype.
        layout: their memory layout.
        seed: the random generator's seed.
        device: where the tensors live.
        k_pos: (T,) int64 key positions; None: ``7 .. T + 6``.

    Returns:
        The inputs: (Hq, S, D) q, (S,) q_pos, (Hkv, T, D) k and v, (T,) k_pos, scale ``D ** -0.5``.
    """
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
    """``torch.testing.assert_close`` with ``TOL[dtype]`` (dtype defaults to ``expected.dtype``).

    Args:
        actual: the kernel's result.
        expected: the reference's.
        dtype: whose tolerance row applies; None: ``expected.dtype``.

    Raises:
        AssertionError: the two differ beyond the tolerance.
    """
    tol = TOL[dtype or expected.dtype]
    torch.testing.assert_close(actual, expected, atol=tol.atol, rtol=tol.rtol)


INT32_LIMIT = 2**31  # element offsets at or past this wrap in 32-bit arithmetic


def sparse_buffer(numel: int, dtype: torch.dtype, device: str | torch.device = "cpu") -> torch.Tensor:
    """A 1-D tensor of ``numel`` elements whose memory is committed only where it is written or read.

    On CPU it lies in an anonymous ``mmap`` of its own (4 KiB pages: torch's allocator may ask for
    2 MiB pages, which would make every touched row of a far view cost 2 MiB); elsewhere it is
    ``torch.empty`` (on a GPU the whole size is allocated).

    Args:
        numel: elements; dtype, device: the tensor's.

    Returns:
        (numel,) uninitialised (zeros on CPU) tensor.

    Raises:
        MemoryError, OSError: the address space cannot be reserved (strict overcommit, small machine).
    """
    if torch.device(device).type != "cpu":
        return torch.empty(numel, dtype=dtype, device=device)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return torch.frombuffer(mmap.mmap(-1, numel * itemsize), dtype=dtype)  # keeps the mapping alive


def far_views(xs: Sequence[torch.Tensor], row_dim: int, first_far: int) -> list[torch.Tensor]:
    """Copies of the (A, B, D) tensors ``xs`` as views of one sparse buffer in which index ``first_far``
    of dim ``row_dim`` and every later one lie at least 2**31 elements past the view's start: where a
    kernel that multiplies a 32-bit row index by the row stride wraps around.

    Each row (an index of ``row_dim``) holds the other dim's entries of every x side by side, the way a
    token row of a multi-layer, token-major KV cache (T, L, 2, Hkv, D) holds its layers' K and V::

        row_dim=1 (token-major), x of shape (H, T, D):   element [h, t, d] at base + i*H*D + t*stride + h*D + d
        row_dim=0 (head-major),  x of shape (H, S, D):   element [h, s, d] at base + i*S*D + h*stride + s*D + d

    The views start ``base`` (about 2**31) elements into the buffer, so a wrapped (negative) 32-bit
    offset still lands inside it: a kernel without 64-bit offsets reads or writes the wrong rows of
    this buffer (a wrong answer, not a crash or stray write). The buffer is ~2**32 elements virtual;
    only the pages of the rows touched are committed (on CPU).

    Args:
        xs: tensors of one shape, dtype and device; row_dim: 0 or 1; first_far: the first far row index.

    Returns:
        The views, in the order of ``xs``, holding their values.

    Raises:
        MemoryError, OSError: as :func:`sparse_buffer`.
    """
    x0 = xs[0]
    rows, other, d = x0.shape[row_dim], x0.shape[1 - row_dim], x0.shape[2]
    width = other * d  # one x's elements in one row
    stride = -(-INT32_LIMIT // first_far)  # first_far * stride >= 2**31 > (first_far - 1) * stride
    if len(xs) * width > stride or (first_far - 1) * stride >= INT32_LIMIT:
        raise ValueError(f"rows of {len(xs)} x {width} elements do not fit a {stride}-element row stride")
    base = 2 * INT32_LIMIT - first_far * stride  # row first_far wrapped to 32 bits lands at element 0
    buf = sparse_buffer(base + (rows - 1) * stride + len(xs) * width, x0.dtype, x0.device)
    strides = [0, 0, 1]
    strides[row_dim], strides[1 - row_dim] = stride, d
    views = []
    for i, x in enumerate(xs):
        view = buf.as_strided(tuple(x.shape), tuple(strides), base + i * width)
        view.copy_(x)
        views.append(view)
    return views
