"""The per-request KV cache: one sequence, all layers, K after RoPE.

Contract: ``write(layer, start, k_rot, v)`` puts rows [start, start+S) of one
layer; ``advance(n)`` makes them visible once every layer has been written;
``view(layer, end)`` returns the first ``end`` rows. Positions are absolute
and stored beside the rows, so attention masks come from positions, not
from row order.

K before RoPE is never kept here: the store holds it (for re-positioning),
the cache holds what attention reads. :class:`KVEntry` is that stored form
of one segment (K before RoPE, V, all layers): what a computed segment
leaves behind and what a store returns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVEntry:
    """KV rows of one segment, all layers.

    Attributes:
        k: keys before RoPE, (L, Hkv, T, D).
        v: values, (L, Hkv, T, D).
        provenance: canonical JSON of the producing :class:`~blend.keys.Provenance`.
    """

    k: torch.Tensor  # (L, Hkv, T, D)
    v: torch.Tensor  # (L, Hkv, T, D)
    provenance: str = ""  # "" until the segment cache stamps it for the store

    @property
    def num_tokens(self) -> int:
        return int(self.k.shape[2])

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


class KVCache:
    """Preallocated K/V for one sequence.

    Args:
        num_layers, num_kv_heads, head_dim: model shape.
        capacity: maximum rows (prompt plus generated tokens).
        dtype, device: storage.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_kv_heads, capacity, head_dim)
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]  # (Hkv, N, D)
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]  # (Hkv, N, D)
        self.pos = torch.zeros(capacity, dtype=torch.long, device=device)  # (N,)
        self.length = 0
        self.capacity = capacity

    def write(self, layer: int, start: int, k_rot: torch.Tensor, v: torch.Tensor) -> None:
        """Write rows [start, start + S) of one layer. k_rot, v: (Hkv, S, D)."""
        end = start + k_rot.shape[1]
        if end > self.capacity:
            raise ValueError(f"KV cache overflow: {end} rows > capacity {self.capacity}")
        self.k[layer][:, start:end] = k_rot
        self.v[layer][:, start:end] = v

    def rows(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Writable views of rows [start, end) of one layer, (Hkv, end - start, D) each (for kernels
        that write in place; the rows become visible with :meth:`advance` like any write)."""
        if end > self.capacity:
            raise ValueError(f"KV cache overflow: {end} rows > capacity {self.capacity}")
        return self.k[layer][:, start:end], self.v[layer][:, start:end]

    def write_rows(self, layer: int, rows: torch.Tensor, k_rot: torch.Tensor, v: torch.Tensor) -> None:
        """Scatter rows at arbitrary indices. rows: (S,) int64; k_rot, v: (Hkv, S, D)."""
        self.k[layer][:, rows] = k_rot
        self.v[layer][:, rows] = v

    def set_positions(self, start: int, positions: torch.Tensor) -> None:
        """Absolute positions of rows [start, start + S)."""
        self.pos[start:start + positions.shape[0]] = positions

    def advance(self, n: int) -> None:
        """Make ``n`` more rows visible."""
        self.length += n

    def view(self, layer: int, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """First ``end`` rows (default: all visible) of one layer: (Hkv, T, D) each."""
        end = self.length if end is None else end
        return self.k[layer][:, :end], self.v[layer][:, :end]
