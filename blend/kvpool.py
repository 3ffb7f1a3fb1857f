"""Recycled KV buffers: per-layer K/V storage handed from a finished request's cache to the next one.

A request's :class:`~blend.kvcache.KVCache` needs two (Hkv, N, D) buffers per layer: ~140 MB for a
~3k-token prompt of SmolLM2 in float32. A fresh CPU allocation of that size is new pages from the
kernel, and every page is faulted in (and zeroed) on first write: on a 2-core KVM guest that was
~13-22 thousand minor faults per request and most of the loaded, all-exact request's fixed overhead
beyond copying its rows (BENCHMARKS.md, "Recycled KV buffers"). A serving engine keeps its KV memory
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
from collections import OrderedDict
from dataclasses import dataclass

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


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


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
        self._free: OrderedDict[int, torch.Tensor] = OrderedDict()  # id -> (Hkv, C, D) base, oldest first
        self._pending: list[torch.Tensor] = []  # given back, possibly still viewed
        self._reused = 0
        self._allocated = 0

    @property
    def recycles(self) -> bool:
        """Whether buffers can be handed out again at all (a budget, and a readable use count)."""
        return self.budget_bytes > 0 and _SOLE_USERS is not None

    def take(self, num_kv_heads: int, capacity: int, head_dim: int, dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
        """A buffer for one layer's K or V.

        Args:
            num_kv_heads, capacity, head_dim: the rows wanted, (Hkv, capacity, D).
            dtype, device: storage.

        Returns:
            An uninitialised (Hkv, C, D) buffer with C >= capacity: the caller slices its rows (a pool
            rounds capacities up to :data:`~blend.defaults.KV_POOL_ROW_QUANTUM` so that prompts of
            similar length share buffers) and gives the buffer itself back (:meth:`give`; views do not
            name their base under inference mode).
        """
        device = torch.device(device)
        if device.type != "cpu" or not self.recycles:
            return torch.empty((num_kv_heads, capacity, head_dim), dtype=dtype, device=device)  # (Hkv, N, D)
        with self._lock:
            self._reclaim()
            best_key, best_rows = None, None
            for key, buf in self._free.items():
                rows = buf.shape[1]
                if (buf.shape[0] == num_kv_heads and buf.shape[2] == head_dim and buf.dtype == dtype
                        and buf.device == device and capacity <= rows <= capacity * KV_POOL_SLACK
                        + KV_POOL_ROW_QUANTUM and (best_rows is None or rows < best_rows)):
                    best_key, best_rows = key, rows
            if best_key is not None:
                self._reused += 1
                return self._free.pop(best_key)
            self._allocated += 1
        rows = -(-capacity // KV_POOL_ROW_QUANTUM) * KV_POOL_ROW_QUANTUM
        return torch.empty((num_kv_heads, rows, head_dim), dtype=dtype, device=device)  # (Hkv, C, D)

    def give(self, buffers: list[torch.Tensor]) -> None:
        """Give back a dropped cache's buffers, as :meth:`take` returned them. They are handed out again
        once nothing else reads them (views of their rows keep them pending).

        Args:
            buffers: (Hkv, C, D) tensors.
        """
        if not self.recycles:
            return
        with self._lock:
            self._pending.extend(b for b in buffers if b.device.type == "cpu")
            self._reclaim()

    def stats(self) -> PoolStats:
        """Bytes held free and pending, buffers reused and allocated."""
        with self._lock:
            self._reclaim()
            return PoolStats(sum(_nbytes(b) for b in self._free.values()),
                             sum(_nbytes(b) for b in self._pending), self._reused, self._allocated)

    def clear(self) -> None:
        """Drop every buffer the pool holds (views elsewhere keep theirs alive)."""
        with self._lock:
            self._free.clear()
            self._pending.clear()

    def _reclaim(self) -> None:
        """Move pending buffers nothing else reads to the free list, then keep it within the budget.
        Caller holds the lock."""
        still = []
        for base in self._pending:
            if _storage_users(base) == _SOLE_USERS:
                self._free[id(base)] = base
            else:
                still.append(base)
        self._pending = still
        total = sum(_nbytes(b) for b in self._free.values())
        while total > self.budget_bytes and self._free:
            _, old = self._free.popitem(last=False)
            total -= _nbytes(old)
