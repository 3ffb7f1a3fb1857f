"""Recycled KV buffers: per-layer K/V storage handed from a finished request's cache to the next one.

A request's :class:`~blend.kvcache.KVCache` needs two (Hkv, N, D) buffers per layer: ~140 MB for a
~3k-token prompt of SmolLM2 in float32. A fresh CPU allocation of that size is new pages from the
kernel unless the allocator can reuse what the last request freed, which depends on the sizes of
the requests before; a fresh page is faulted in (and zeroed) on first write. In a mixed stream of
requests on a 2-core KVM guest a ~6k-token request took ~21 thousand minor faults, a quarter of a
loaded exact hit's time (BENCHMARKS.md, "Recycled KV buffers"). A serving engine keeps its KV memory
(vLLM's and SGLang's KV pools are allocated once); this pool does the same for kvblend's per-request
caches, without changing what a cache is: a cache takes its buffers from the pool and gives them back
when it is dropped.

What makes a buffer safe to hand out again is that nothing still reads it. A cache's rows outlive it
where views were taken of them (a hot prefix shared with :meth:`KVCache.share
<blend.kvcache.KVCache.share>`, a caller's ``keep_cache``): a given-back buffer waits as *pending*
until its storage has no user but the pool (torch's storage use count), and only then becomes free.
Where that count cannot be read, nothing is recycled.

CUDA's caching allocator already recycles device memory, so the pool only serves CPU buffers; other
devices get ``torch.empty``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import NamedTuple

import torch

from blend.defaults import DEFAULT_KV_POOL_BYTES, KV_POOL_ROW_QUANTUM, KV_POOL_SLACK

_use_count = getattr(torch._C, "_storage_Use_Count", None)  # private, present since torch 2.1


def _storage_users(t: torch.Tensor) -> int | None:
    """How many references hold ``t``'s storage (tensors, views, storage objects), or None if unknown."""
    if _use_count is None:
        return None
    return int(_use_count(t.untyped_storage()._cdata))


_SOLE_USERS = _storage_users(torch.empty(1))  # a lone tensor, as counted while we ask (None: unknown)


@dataclass(frozen=True)
class PoolStats:
    """What a pool holds.

    Attributes:
        free_bytes: buffers ready to hand out.
        pending_bytes: given-back buffers something still reads (views of a dropped cache's rows).
        reused: buffers handed out again since the pool was made.
        allocated: buffers allocated fresh since the pool was made.
    """

    free_bytes: int
    pending_bytes: int
    reused: int
    allocated: int


class _Held(NamedTuple):
    """A buffer the pool holds, with what it serves (read once: tensor attributes are slow to ask)."""

    buf: torch.Tensor  # (Hkv, rows, D)
    kind: tuple[int, int, torch.dtype]  # (Hkv, D, dtype)
    rows: int
    nbytes: int


class KVBufferPool:
    """Per-layer K/V buffers recycled between requests' caches (CPU only; thread-safe).

    Args:
        budget_bytes: the most bytes of free buffers kept for the next request; the least recently
            given back go first. 0 turns recycling off (every cache allocates, as without a pool).
    """

    def __init__(self, budget_bytes: int = DEFAULT_KV_POOL_BYTES) -> None:
        if budget_bytes < 0:
            raise ValueError(f"a KV pool's budget is a byte count >= 0, not {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._lock = threading.Lock()
        self._free: OrderedDict[int, _Held] = OrderedDict()  # id(buf) -> held, least recently given back first
        self._by_kind: dict[tuple, dict[int, _Held]] = {}  # (Hkv, D, dtype) -> id(buf) -> held: the same buffers
        self._free_bytes = 0
        self._given: deque[_Held] = deque()  # given back, not yet looked at (appended without the lock)
        self._pending: list[_Held] = []  # given back, possibly still viewed
        self._reused = 0
        self._allocated = 0

    @property
    def recycles(self) -> bool:
        """Whether buffers can be handed out again at all (a budget, and a readable use count)."""
        return self.budget_bytes > 0 and _SOLE_USERS is not None

    def take(self, count: int, num_kv_heads: int, capacity: int, head_dim: int, dtype: torch.dtype,
             device: torch.device) -> list[torch.Tensor]:
        """Buffers for a cache's layers (K and V each).

        Args:
            count: how many buffers.
            num_kv_heads, capacity, head_dim: the rows each must hold, (Hkv, capacity, D).
            dtype, device: storage.

        Returns:
            ``count`` uninitialised (Hkv, C, D) buffers with C >= capacity: the caller slices their rows
            (a pool rounds capacities up to :data:`~blend.defaults.KV_POOL_ROW_QUANTUM` so that prompts
            of similar length share buffers) and gives the buffers themselves back (:meth:`give`; views
            do not name their base under inference mode). Free buffers come first, the best-fitting
            ones (the most recently given back among equals); the rest are allocated. All ``count`` buffers
            have the same row count C (a layer's K and V share strides, as kernels that write both expect),
            and are normal tensors, never inference tensors, whatever mode the caller runs in: a buffer
            outlives the request that allocated it, and a cache made outside inference mode writes its rows
            in place (decoding).
        """
        device = torch.device(device)
        if device.type != "cpu" or not self.recycles:
            return [torch.empty((num_kv_heads, capacity, head_dim), dtype=dtype, device=device)  # (Hkv, N, D)
                    for _ in range(count)]
        kind = (num_kv_heads, head_dim, dtype)
        limit = capacity * KV_POOL_SLACK + KV_POOL_ROW_QUANTUM
        rows = -(-capacity // KV_POOL_ROW_QUANTUM) * KV_POOL_ROW_QUANTUM
        with self._lock:
            self._reclaim()
            # free buffers by row count, each class newest first (their pages are likelier still cached)
            classes: dict[int, list[_Held]] = {}
            for h in reversed(self._by_kind.get(kind, {}).values()):
                if capacity <= h.rows <= limit:
                    classes.setdefault(h.rows, []).append(h)
            if classes:
                # one row count for every buffer: the best fit that has them all, else the class with the most
                # (the smaller among equals); the rest are allocated at that row count
                whole = [r for r, hs in classes.items() if len(hs) >= count]
                rows = min(whole) if whole else min(classes, key=lambda r: (-len(classes[r]), r))
            fits = classes.get(rows, [])[:count]
            for h in fits:
                self._drop_free(h)
            self._reused += len(fits)
            self._allocated += count - len(fits)
        with torch.inference_mode(False):  # a normal tensor: recycled into caches made in either mode
            fresh = [torch.empty((num_kv_heads, rows, head_dim), dtype=dtype, device=device)  # (Hkv, C, D)
                     for _ in range(count - len(fits))]
        return [h.buf for h in fits] + fresh

    def give(self, buffers: list[torch.Tensor]) -> None:
        """Give back a dropped cache's buffers, as :meth:`take` returned them. They are handed out again
        once nothing else reads them (views of their rows keep them pending).

        Args:
            buffers: (Hkv, C, D) tensors.
        """
        if not self.recycles:
            return
        self._given.extend(_Held(b, (b.shape[0], b.shape[2], b.dtype), b.shape[1], b.numel() * b.element_size())
                           for b in buffers if b.device.type == "cpu")
        # a finalizer may run this on any thread, in the middle of a take() of its own thread (a garbage
        # collection there): never wait for the lock; whoever holds it reclaims before it hands out
        if self._lock.acquire(blocking=False):
            try:
                self._reclaim()
            finally:
                self._lock.release()

    def stats(self) -> PoolStats:
        """Bytes held free and pending, buffers reused and allocated."""
        with self._lock:
            self._reclaim()
            return PoolStats(self._free_bytes, sum(h.nbytes for h in self._pending), self._reused, self._allocated)

    def clear(self) -> None:
        """Drop every buffer the pool holds (views elsewhere keep theirs alive)."""
        with self._lock:
            self._free.clear()
            self._by_kind.clear()
            self._free_bytes = 0
            self._pending.clear()
            self._given.clear()

    def _drop_free(self, h: _Held) -> None:
        """Take ``h`` off the free lists. Caller holds the lock."""
        del self._free[id(h.buf)]
        del self._by_kind[h.kind][id(h.buf)]
        self._free_bytes -= h.nbytes

    def _reclaim(self) -> None:
        """Move pending buffers nothing else reads to the free lists, then keep them within the budget.
        Caller holds the lock."""
        while self._given:
            self._pending.append(self._given.popleft())
        still = []
        for h in self._pending:
            if _storage_users(h.buf) == _SOLE_USERS:
                self._free[id(h.buf)] = h
                self._by_kind.setdefault(h.kind, {})[id(h.buf)] = h
                self._free_bytes += h.nbytes
            else:
                still.append(h)
        self._pending = still
        while self._free_bytes > self.budget_bytes and self._free:
            self._drop_free(next(iter(self._free.values())))
