"""The per-request KV cache: one sequence, all layers, K after RoPE.

Contract: ``write(layer, start, k_rot, v)`` puts rows [start, start+S) of one
layer; ``advance(n)`` makes them visible once every layer has been written;
``view(layer, end)`` returns the first ``end`` rows. Positions are absolute
and stored beside the rows, so attention masks come from positions, not
from row order.

K before RoPE is never kept here: the store holds it (for re-positioning),
the cache holds what attention reads. :class:`~blend.kv_entry.KVEntry` is that stored form
of one segment (K, V, all layers): what a computed segment leaves behind and
what a store returns. Its K is before RoPE, except in an entry whose
``rotated`` flag says it is after RoPE at the positions it was computed at
(an EXACT entry, see :attr:`blend.keys.Namespace.k_after_rope`):
:meth:`KVCache.entry` takes that form from a cache's rows.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from blend.kv_entry import KVEntry
from blend.kvpool import KVBufferPool

__all__ = ["KVCache", "KVEntry", "RotatedPrefix"]  # KVEntry lives in blend.kv_entry (no torch import)


@dataclass(frozen=True)
class RotatedPrefix:
    """The K (after RoPE) and V of a prompt prefix at positions [0, length), all layers: a read-only
    snapshot that caches attach instead of loading the prefix's segments (see :class:`PrefixCache`).

    Attributes:
        k, v: per layer, (Hkv, length, D) each.
    """

    k: tuple[torch.Tensor, ...]  # L x (Hkv, P, D)
    v: tuple[torch.Tensor, ...]  # L x (Hkv, P, D)

    @property
    def length(self) -> int:
        return int(self.k[0].shape[1])

    @property
    def nbytes(self) -> int:
        """Bytes held: the storage behind the tensors (a prefix shared from a request's cache keeps
        that cache's whole buffers alive)."""
        return sum(t.untyped_storage().nbytes() for t in (*self.k, *self.v))


class KVCache:
    """Preallocated K/V for one sequence.

    A cache may start from an attached :class:`RotatedPrefix` (rows [0, P) held by the prefix, not
    copied): chunked-prefill attention right after it reads the prefix in place
    (:meth:`prefix_parts`), and anything that needs the rows contiguous (``view``, ``rows``
    below P, ``k`` / ``v``) copies the prefix in first (:meth:`materialize`), once.

    Args:
        num_layers, num_kv_heads, head_dim: model shape.
        capacity: maximum rows (prompt plus generated tokens).
        dtype, device: storage.
        pool: where the buffers come from and go back to when the cache is dropped (None: allocated
            for this cache alone).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device, pool: KVBufferPool | None = None) -> None:
        if pool is None:
            bufs = [torch.empty((num_kv_heads, capacity, head_dim), dtype=dtype, device=device)  # (Hkv, N, D)
                    for _ in range(2 * num_layers)]
        else:
            bufs = pool.take(2 * num_layers, num_kv_heads, capacity, head_dim, dtype, device)  # (Hkv, >= N, D)
            weakref.finalize(self, pool.give, bufs)  # back to the pool once this cache is dropped
        self._k = [b[:, :capacity] for b in bufs[:num_layers]]  # (Hkv, N, D)
        self._v = [b[:, :capacity] for b in bufs[num_layers:]]  # (Hkv, N, D)
        self.pos = torch.zeros(capacity, dtype=torch.long, device=device)  # (N,)
        self.length = 0
        self.capacity = capacity
        self._prefix: RotatedPrefix | None = None  # rows [0, P) until materialized
        self._shared_upto = 0  # rows [0, n) are views held by a PrefixCache: read-only

    @property
    def k(self) -> list[torch.Tensor]:
        """Per layer (Hkv, N, D), the prefix copied in."""
        self.materialize()
        return self._k

    @property
    def v(self) -> list[torch.Tensor]:
        """Per layer (Hkv, N, D), the prefix copied in."""
        self.materialize()
        return self._v

    @property
    def shape(self) -> tuple[int, int, int, torch.dtype, torch.device]:
        """(layers, KV heads, head dim, dtype, device), without copying an attached prefix in."""
        k = self._k[0]
        return len(self._k), int(k.shape[0]), int(k.shape[2]), k.dtype, k.device

    @property
    def prefix_length(self) -> int:
        """Rows held by an attached, not yet copied prefix (0: none)."""
        return 0 if self._prefix is None else self._prefix.length

    def attach_prefix(self, prefix: RotatedPrefix) -> None:
        """Start an empty cache from ``prefix`` (positions 0..P-1), without copying it."""
        if self.length:
            raise ValueError("a prefix can only be attached to an empty cache")
        if prefix.length > self.capacity:
            raise ValueError(f"KV cache overflow: {prefix.length} rows > capacity {self.capacity}")
        self._prefix = prefix
        self.pos[:prefix.length] = torch.arange(prefix.length, device=self.pos.device)
        self.length = prefix.length

    def prefix_parts(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The attached prefix's K and V of one layer, (Hkv, P, D) each, or None when there is none."""
        return None if self._prefix is None else (self._prefix.k[layer], self._prefix.v[layer])

    def own_rows(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [start, end) of one layer at or after an attached prefix, without copying it in."""
        if start < self.prefix_length:
            raise ValueError("own_rows starts inside the attached prefix")
        return self._k[layer][:, start:end], self._v[layer][:, start:end]

    def materialize(self) -> None:
        """Copy an attached prefix into the cache's own rows (no-op without one)."""
        pre, self._prefix = self._prefix, None
        if pre is None:
            return
        n = pre.length
        for layer in range(len(self._k)):
            self._k[layer][:, :n].copy_(pre.k[layer])
            self._v[layer][:, :n].copy_(pre.v[layer])

    def share(self, end: int) -> RotatedPrefix:
        """Rows [0, end) of every layer as a read-only prefix for a :class:`PrefixCache`, without a copy:
        from now on no write may touch them (decoding appends after them), so other caches may
        attach the views while this one lives on."""
        self.materialize()
        self._shared_upto = max(self._shared_upto, end)
        return RotatedPrefix(tuple(k[:, :end] for k in self._k), tuple(v[:, :end] for v in self._v))

    def _check_writable(self, start: int) -> None:
        if start < self._shared_upto:
            raise RuntimeError(f"rows below {self._shared_upto} are shared as a prefix: no write may touch them")

    def write(self, layer: int, start: int, k_rot: torch.Tensor, v: torch.Tensor) -> None:
        """Write rows [start, start + S) of one layer. k_rot, v: (Hkv, S, D)."""
        end = start + k_rot.shape[1]
        if end > self.capacity:
            raise ValueError(f"KV cache overflow: {end} rows > capacity {self.capacity}")
        self._check_writable(start)
        if start < self.prefix_length:
            self.materialize()
        self._k[layer][:, start:end] = k_rot
        self._v[layer][:, start:end] = v

    def rows(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Writable views of rows [start, end) of one layer, (Hkv, end - start, D) each (for kernels
        that write in place; the rows become visible with :meth:`advance` like any write)."""
        if end > self.capacity:
            raise ValueError(f"KV cache overflow: {end} rows > capacity {self.capacity}")
        self._check_writable(start)
        if start < self.prefix_length:
            self.materialize()
        return self._k[layer][:, start:end], self._v[layer][:, start:end]

    def write_rows(self, layer: int, rows: torch.Tensor, k_rot: torch.Tensor, v: torch.Tensor) -> None:
        """Scatter rows at arbitrary indices. rows: (S,) int64; k_rot, v: (Hkv, S, D)."""
        if self._shared_upto:
            self._check_writable(int(rows.min()))
        self.materialize()
        self._k[layer][:, rows] = k_rot
        self._v[layer][:, rows] = v

    def entry(self, start: int, end: int) -> KVEntry:
        """Rows [start, end) of every layer as a new entry (a copy), K after RoPE as the cache holds it.

        Returns:
            A ``rotated`` :class:`KVEntry`, (L, Hkv, end - start, D) each.
        """
        if start < self.prefix_length:  # rows after an attached prefix are read without copying it in
            self.materialize()
        k = torch.stack([k[:, start:end] for k in self._k])  # (L, Hkv, S, D)
        v = torch.stack([v[:, start:end] for v in self._v])  # (L, Hkv, S, D)
        return KVEntry(k, v, rotated=True)

    def set_positions(self, start: int, positions: torch.Tensor) -> None:
        """Absolute positions of rows [start, start + S)."""
        self.pos[start:start + positions.shape[0]] = positions

    def advance(self, n: int) -> None:
        """Make ``n`` more rows visible."""
        self.length += n

    def view(self, layer: int, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """First ``end`` rows (default: all visible) of one layer: (Hkv, T, D) each."""
        end = self.length if end is None else end
        self.materialize()
        return self._k[layer][:, :end], self._v[layer][:, :end]
