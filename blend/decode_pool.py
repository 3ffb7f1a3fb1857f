"""Decoding sequences' KV caches as slots of one pooled allocation.

A batched decode step reads every active sequence's cache once per layer. With each cache its own
tensors, attention is one call per sequence and layer, and on a CPU that loop reads the caches at
~10 GB/s on one thread; with the caches as slots of one ``(S, Hkv, T, D)`` tensor per layer, one
``bmm`` pair per layer reads all of them ~25% faster on one thread and ~33% faster on two
(``python -m blend.evals.bench_decode_attention``).

So a server's decode loop moves a sequence's cache into a free slot when the sequence starts
decoding (one copy of its rows: a few ms, once per request) and gives the slot back when it
ends. A slot is an ordinary :class:`~blend.kvcache.KVCache` over views of the pool, so every
path that takes a cache works on it unchanged, bit for bit; :mod:`blend.batch_decode` notices
when the caches of a step share a pool and runs its attention (and K/V writes) as one call per
layer over the slots' range, padded to the longest sequence and masked by length and position.

Memory: ``slots x capacity`` rows per layer, allocated once and only touched where sequences
write (untouched pages of a large allocation cost no memory). Rows a step reads past a slot's own
length are masked out of the softmax; they are zeroed the first time a step reaches them
(``reads_upto``), so what they multiply is finite (0 x NaN would poison a row).

One owner: the decode loop adopts and releases slots (a lock keeps the free list consistent
with a request retired from another thread).
"""

from __future__ import annotations

import heapq
import threading

import torch

from blend.kvcache import KVCache


ZERO_AHEAD = 128  # rows zeroed past what a step reads (each layer's K and V is one op per slot)


class PoolSlotCache(KVCache):
    """A :class:`KVCache` whose rows live in slot ``slot`` of ``pool`` (built by :meth:`DecodePool.adopt`)."""

    def __init__(self, pool: "DecodePool", slot: int, capacity: int) -> None:  # noqa: D107 - no super(): views
        self.pool, self.slot = pool, slot
        self._k = [k[slot] for k in pool.k]  # (Hkv, Tp, D) views
        self._v = [v[slot] for v in pool.v]  # (Hkv, Tp, D) views
        self._prefix = None
        self._shared_upto = 0
        self.pos = pool.pos[slot]  # (Tp,) view
        self.length = 0
        self.capacity = capacity


class DecodePool:
    """Slots for decoding sequences' caches.

    Args:
        num_layers, num_kv_heads, head_dim: model shape.
        slots: sequences the pool holds at once (the server's ``max_concurrency``).
        capacity: rows per slot; a cache with a larger capacity stays where it is.
        dtype, device: storage (the engine's cache dtype and device).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, slots: int, capacity: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        if slots < 1 or capacity < 1:
            raise ValueError(f"a decode pool needs slots >= 1 and capacity >= 1, got {slots} and {capacity}")
        shape = (slots, num_kv_heads, capacity, head_dim)
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]  # (S, Hkv, Tp, D)
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]  # (S, Hkv, Tp, D)
        self.pos = torch.zeros(slots, capacity, dtype=torch.long, device=device)  # (S, Tp)
        self.slots, self.capacity = slots, capacity
        self.reads_upto = [0] * slots  # rows [0, n) of each slot hold finite numbers
        self.adopted = 0  # caches moved into a slot so far
        self._free = list(range(slots))  # a heap: the lowest free slot first keeps busy slots together
        self._lock = threading.Lock()

    @property
    def free_slots(self) -> int:
        """Slots not in use."""
        return len(self._free)

    def adopt(self, cache: KVCache) -> KVCache:
        """Move a cache into a free slot (its visible rows and positions are copied).

        Args:
            cache: a sequence's cache (its own tensors).

        Returns:
            A :class:`PoolSlotCache` with the same rows, length and capacity, or ``cache`` itself
            when no slot is free, it does not fit, or it is of another shape, dtype or device.
        """
        layers, heads, dim, dtype, device = cache.shape
        if (isinstance(cache, PoolSlotCache) or cache.capacity > self.capacity or layers != len(self.k)
                or heads != self.k[0].shape[1] or dim != self.k[0].shape[3]
                or dtype != self.k[0].dtype or device != self.k[0].device):
            return cache
        with self._lock:
            if not self._free:
                return cache
            slot = heapq.heappop(self._free)
            self.adopted += 1
        out = PoolSlotCache(self, slot, cache.capacity)
        n, p = cache.length, cache.prefix_length
        try:
            for layer in range(len(self.k)):
                parts = cache.prefix_parts(layer)
                if parts is None:
                    out.write(layer, 0, *cache.view(layer, n))
                else:  # an attached prefix is copied from where it is held, once
                    out.write(layer, 0, *parts)
                    out.write(layer, p, *cache.own_rows(layer, p, n))
            out.set_positions(0, cache.pos[:n])
            out.advance(n)
        except BaseException:
            self.release(out)  # the slot goes back (rows written so far are finite copies): no leak
            raise
        self.reads_upto[slot] = max(self.reads_upto[slot], n)
        return out

    def release(self, cache: KVCache | None) -> None:
        """Give a slot back (anything else: nothing to do). Its rows stay finite for the next owner."""
        if not isinstance(cache, PoolSlotCache) or cache.pool is not self:
            return
        with self._lock:
            if cache.slot not in self._free:
                heapq.heappush(self._free, cache.slot)

    def ensure_readable(self, slots: list[int], rows: int, written: list[int]) -> None:
        """Make rows [0, rows) of these slots finite (zero those never written), before a step reads them.

        Args:
            slots: slot indices a step reads.
            rows: how many rows of each it reads.
            written: each slot's cache length: its rows below it hold the sequence's KV and are never
                zeroed (a step that was not pooled, e.g. one sequence decoding alone, wrote them without
                moving ``reads_upto``; zeroing from there wiped the tokens it had generated).
        """
        for s, n in zip(slots, written):
            lo = max(self.reads_upto[s], n)
            if lo < rows:  # a chunk ahead, so a growing batch zeroes once per ZERO_AHEAD steps, not every step
                hi = min(self.capacity, rows + ZERO_AHEAD)
                for k, v in zip(self.k, self.v):
                    k[s, :, lo:hi].zero_()
                    v[s, :, lo:hi].zero_()
                self.reads_upto[s] = hi
