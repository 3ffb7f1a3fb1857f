"""In-process tier: an LRU over entries with a byte budget."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Iterator

from blend.keys import Namespace, StoreKey, key_hex
from blend.store.base import (
    ABSENT,
    EntryInfo,
    KVEntry,
    Lookup,
    LookupStatus,
    StoreStats,
    Verdict,
    check_entry,
    check_put,
    counters_of,
    entry_problem,
)

log = logging.getLogger(__name__)


class MemoryStore:
    """LRU store; evicts least-recently-used entries beyond ``budget_bytes``.

    Args:
        budget_bytes: upper bound on the bytes of stored tensors (None: unbounded).
    """

    name = "memory"

    def __init__(self, budget_bytes: int | None = None) -> None:
        self.budget_bytes = budget_bytes
        self._data: OrderedDict[tuple[Namespace, bytes], KVEntry] = OrderedDict()
        self._bytes = 0
        self._stats = StoreStats()
        self._lock = threading.Lock()

    def get(self, ns: Namespace, key: StoreKey, provenance: str) -> Lookup:
        with self._lock:
            entry = self._data.get((ns, bytes(key)))
            if entry is None:
                self._stats.misses += 1
                return Lookup(LookupStatus.MISS, tier=self.name)
            why = check_entry(entry, provenance)
            if why:
                self._stats.rejected += 1
                log.warning("memory store: rejected %s/%s: %s", ns.value, key_hex(key)[:16], why)
                return Lookup(LookupStatus.REJECTED, reason=why, tier=self.name)
            self._data.move_to_end((ns, bytes(key)))
            self._stats.hits += 1
            return Lookup(LookupStatus.HIT, entry=entry, tier=self.name)

    def put(self, ns: Namespace, key: StoreKey, entry: KVEntry) -> None:
        check_put(entry)
        with self._lock:
            old = self._data.pop((ns, bytes(key)), None)
            if old is not None:
                self._bytes -= old.nbytes
            if self.budget_bytes is not None and entry.nbytes > self.budget_bytes:
                return  # larger than the whole budget: never cached
            self._data[(ns, bytes(key))] = entry
            self._bytes += entry.nbytes
            self._stats.puts += 1
            while self.budget_bytes is not None and self._bytes > self.budget_bytes:
                _, evicted = self._data.popitem(last=False)
                self._bytes -= evicted.nbytes
                self._stats.evictions += 1

    def contains(self, ns: Namespace, key: StoreKey) -> bool:
        with self._lock:
            return (ns, bytes(key)) in self._data

    def delete(self, ns: Namespace, key: StoreKey) -> bool:
        with self._lock:
            old = self._data.pop((ns, bytes(key)), None)
            if old is not None:
                self._bytes -= old.nbytes
            return old is not None

    def keys(self, ns: Namespace) -> Iterator[StoreKey]:
        with self._lock:
            snapshot = [StoreKey(k) for (n, k) in self._data if n == ns]
        return iter(snapshot)

    def counters(self) -> StoreStats:
        with self._lock:
            return counters_of(self._stats)

    def stats(self) -> StoreStats:
        with self._lock:
            s = StoreStats(**{**self._stats.__dict__, "extra": dict(self._stats.extra)})
            s.entries = len(self._data)
            s.bytes = self._bytes
            return s

    def info(self, ns: Namespace, key: StoreKey) -> EntryInfo | None:
        with self._lock:
            entry = self._data.get((ns, bytes(key)))
        if entry is None:
            return None
        shape = tuple(int(s) for s in entry.k.shape)
        dtype = str(entry.k.dtype).removeprefix("torch.")
        return EntryInfo(ns, key, entry.provenance, shape, dtype, entry.nbytes)  # type: ignore[arg-type]

    def verify(self, ns: Namespace, key: StoreKey) -> Verdict:
        with self._lock:
            entry = self._data.get((ns, bytes(key)))
        return ABSENT if entry is None else Verdict.of(entry_problem(entry))

    def check_reachable(self) -> str:
        return ""  # in-process: always

    def clear(self, ns: Namespace | None = None) -> int:
        with self._lock:
            doomed = [k for k in self._data if ns is None or k[0] == ns]
            for k in doomed:
                self._bytes -= self._data.pop(k).nbytes
            return len(doomed)
