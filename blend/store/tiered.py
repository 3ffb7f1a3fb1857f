"""A chain of tiers behind the one store interface.

    get:  memory ──miss──► disk ──miss──► redis          (first valid hit wins)
            ▲  promote        ▲  promote     │ hit
            └─────────────────┴──────────────┘
    put:  every tier (write-through)

A ``REJECTED`` entry in one tier does not stop the search: a lower tier may
hold a valid copy, which is then promoted over the bad one. If no tier hits,
the lookup is ``REJECTED`` when some tier rejected (the engine reports the
segment as ``rejected`` and computes it) and ``MISS`` otherwise.
"""

from __future__ import annotations

import logging
import threading
from typing import Iterator, Sequence

from blend.keys import Namespace, StoreKey
from blend.store.base import EntryInfo, InspectableStore, KVEntry, Lookup, LookupStatus, StoreStats, check_put

log = logging.getLogger(__name__)


class TieredStore:
    """Tiers ordered fastest first; hits in a lower tier are copied upward.

    Args:
        tiers: e.g. ``[MemoryStore(budget), DiskStore(root)]``.
    """

    def __init__(self, tiers: Sequence[InspectableStore]) -> None:
        if not tiers:
            raise ValueError("TieredStore needs at least one tier")
        self.tiers = list(tiers)
        self.name = "+".join(t.name for t in self.tiers)
        self._stats = StoreStats()
        self._lock = threading.Lock()

    def _count(self, field: str) -> None:
        with self._lock:
            setattr(self._stats, field, getattr(self._stats, field) + 1)

    def get(self, ns: Namespace, key: StoreKey, provenance: str) -> Lookup:
        rejected: Lookup | None = None
        for i, tier in enumerate(self.tiers):
            found = tier.get(ns, key, provenance)
            if found.status is LookupStatus.HIT:
                assert found.entry is not None
                for upper in self.tiers[:i]:
                    self._put_one(upper, ns, key, found.entry)
                if i:
                    with self._lock:
                        self._stats.extra["promotions"] = self._stats.extra.get("promotions", 0) + 1
                self._count("hits")
                return found
            if found.status is LookupStatus.REJECTED and rejected is None:
                rejected = found
        if rejected is not None:
            self._count("rejected")
            return rejected
        self._count("misses")
        return Lookup(LookupStatus.MISS, tier=self.name)

    def _put_one(self, tier: InspectableStore, ns: Namespace, key: StoreKey, entry: KVEntry) -> None:
        try:
            tier.put(ns, key, entry)
        except OSError as e:  # tiers log their own failures; a cache write never fails a request
            log.warning("%s store: put failed: %s", tier.name, e)

    def put(self, ns: Namespace, key: StoreKey, entry: KVEntry) -> None:
        """Write-through to every tier, slowest first (so the fast tier never holds
        an entry that a concurrent reader could not also find below it)."""
        check_put(entry)
        for tier in reversed(self.tiers):
            self._put_one(tier, ns, key, entry)
        self._count("puts")

    def contains(self, ns: Namespace, key: StoreKey) -> bool:
        return any(t.contains(ns, key) for t in self.tiers)

    def delete(self, ns: Namespace, key: StoreKey) -> bool:
        return any([t.delete(ns, key) for t in self.tiers])  # list: delete from all

    def keys(self, ns: Namespace) -> Iterator[StoreKey]:
        seen: set[bytes] = set()
        for t in self.tiers:
            for k in t.keys(ns):
                if bytes(k) not in seen:
                    seen.add(bytes(k))
                    yield k

    def tier_stats(self) -> list[tuple[str, StoreStats]]:
        """Each tier's own statistics, fastest first."""
        return [(t.name, t.stats()) for t in self.tiers]

    def stats(self) -> StoreStats:
        """The chain's lookups; entries/bytes of the most complete (last) tier."""
        with self._lock:
            s = StoreStats(**{**self._stats.__dict__, "extra": dict(self._stats.extra)})
        for name, ts in self.tier_stats():
            s.extra[f"{name}.entries"] = ts.entries
            s.extra[f"{name}.bytes"] = ts.bytes
            s.extra[f"{name}.hits"] = ts.hits
            s.evictions += ts.evictions
        last = self.tiers[-1].name
        s.entries, s.bytes = int(s.extra[f"{last}.entries"]), int(s.extra[f"{last}.bytes"])
        return s

    def info(self, ns: Namespace, key: StoreKey) -> EntryInfo | None:
        for t in self.tiers:
            got = t.info(ns, key)
            if got is not None:
                return got
        return None

    def verify(self, ns: Namespace, key: StoreKey) -> str:
        """'' if every tier holding the entry holds a valid copy."""
        problems = [f"{t.name}: {why}" for t in self.tiers if (why := t.verify(ns, key)) not in ("", "absent")]
        if problems:
            return "; ".join(problems)
        return "" if self.contains(ns, key) else "absent"

    def check_reachable(self) -> str:
        """Every unreachable tier with its reason ('' if all are reachable)."""
        return "; ".join(f"{t.name}: {why}" for t in self.tiers if (why := t.check_reachable()))

    def clear(self, ns: Namespace | None = None) -> int:
        return max(t.clear(ns) for t in self.tiers)
