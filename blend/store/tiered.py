"""A chain of tiers behind the one store interface.

    get:  memory ──miss──► disk ──miss──► redis          (first valid hit wins)
            ▲  promote        ▲  promote     │ hit
            └─────────────────┴──────────────┘
    put:  the first tier at once; the others on a background writer (write-behind,
          ``blend.store.write_behind``), or all tiers inline, slowest first
          (write-through, ``write_behind=False``)

A ``REJECTED`` entry in one tier does not stop the search: a lower tier may
hold a valid copy, which is then promoted over the bad one. If no tier hits,
the lookup is ``REJECTED`` when some tier rejected (the engine reports the
segment as ``rejected`` and computes it) and ``MISS`` otherwise.

A delete never races a promotion back into a tier, and a put and a delete of one key
end the same way in every tier (the one that started last wins): ``key_order.py`` orders
them, with no lock held across a tier's I/O (a slow Redis delete stalls only that key)::

    lookup:  note seq ── miss memory ── hit disk ── admit: seq unchanged, key not being deleted? copy up
    delete:                       seq+1 ── wait for the key's copies in I/O ── disk, memory ── seq+1
    put:     (waits while its key is being deleted) ── memory ── queued: disk (dropped if a delete started since)

(a promotion that loses the race is skipped: the entry is served from the lower tier this once, and
the next lookup promotes it). The interleavings, one by one, are in ``key_order.py``'s docstring.
"""

from __future__ import annotations

import logging
import threading
from typing import Iterator, Sequence

from blend.defaults import DEFAULT_WRITE_BEHIND, DEFAULT_WRITE_BEHIND_PENDING
from blend.keys import Namespace, StoreKey
from blend.store.base import (
    ABSENT,
    VALID,
    EntryInfo,
    InspectableStore,
    KVEntry,
    Lookup,
    LookupStatus,
    StoreStats,
    Verdict,
    check_put,
    counters_of,
)
from blend.store.key_order import KeyOrder, WriteTicket
from blend.store.write_behind import BackgroundWriter, Write

log = logging.getLogger(__name__)


class TieredStore:
    """Tiers ordered fastest first; hits in a lower tier are copied upward.

    Args:
        tiers: e.g. ``[MemoryStore(budget), DiskStore(root)]``.
        write_behind: write the tiers after the first on a background thread (:meth:`flush` waits
            for them); False writes every tier inline.
        max_pending: writes the background writer queues before a put waits for room.
    """

    def __init__(self, tiers: Sequence[InspectableStore], write_behind: bool = DEFAULT_WRITE_BEHIND,
                 max_pending: int = DEFAULT_WRITE_BEHIND_PENDING) -> None:
        if not tiers:
            raise ValueError("TieredStore needs at least one tier")
        self.tiers = list(tiers)
        self.name = "+".join(t.name for t in self.tiers)
        self._stats = StoreStats()
        self._lock = threading.Lock()
        self.writer = BackgroundWriter(self.name, max_pending) if write_behind and len(self.tiers) > 1 else None
        self._order = KeyOrder()  # which of a write and a delete of a key lands last (key_order.py)

    def _count(self, field: str) -> None:
        with self._lock:
            setattr(self._stats, field, getattr(self._stats, field) + 1)

    def get(self, ns: Namespace, key: StoreKey, provenance: str) -> Lookup:
        rejected: Lookup | None = None
        seen = self._order.seen(key)  # before any tier is read (see the module's diagram)
        for i, tier in enumerate(self.tiers):
            found = tier.get(ns, key, provenance)
            if found.status is LookupStatus.HIT:
                assert found.entry is not None
                if i:
                    self._promote(ns, key, found.entry, self.tiers[:i], seen)
                    with self._lock:
                        self._stats.extra["promotions"] = self._stats.extra.get("promotions", 0) + 1
                self._touch_below(ns, key, self.tiers[i + 1:])
                self._count("hits")
                return found
            if found.status is LookupStatus.REJECTED and rejected is None:
                rejected = found
        if rejected is not None:
            self._count("rejected")
            return rejected
        self._count("misses")
        return Lookup(LookupStatus.MISS, tier=self.name)

    def _promote(self, ns: Namespace, key: StoreKey, entry: KVEntry, upper: list[InspectableStore],
                 seen: int) -> None:
        """Copy a lower tier's hit into the tiers above it: the first at once; with write-behind, the
        persistent ones between in the background (a Redis hit's fsynced disk write stays off the
        request's time to first token). Skipped if a delete of the key's stripe started or ended since
        the lookup began (``seen``: its stripe's clock then): it may have deleted what the lookup read."""
        middle = upper[1:]
        queued = bool(middle) and self.writer is not None
        ticket = self._order.admit_promotion(ns, key, seen, queued)
        if ticket is None:
            return
        self._write(ticket, lambda: self._put_each(upper[:1] if queued else upper, ns, key, entry),
                    (lambda: self._put_each(middle, ns, key, entry)) if queued else None)

    def _write(self, ticket: WriteTicket, inline: Write, behind: Write | None) -> None:
        """Run an admitted write: ``inline`` now, then ``behind`` on the background writer (where the
        ticket says it is queued). Its I/O runs outside every lock; the ticket tells deletes when it is over."""
        try:
            inline()
        except BaseException:
            if behind is not None:
                self._order.cancel_queued(ticket)
            raise
        finally:
            self._order.finish(ticket)
        if behind is None:
            return
        assert self.writer is not None

        def queued() -> None:
            if not self._order.start_queued(ticket):
                return  # a delete (or clear) of the key started after this write: it would bring the entry back
            try:
                behind()
            finally:
                self._order.finish(ticket)

        try:
            self.writer.submit(queued)
        except BaseException:
            self._order.cancel_queued(ticket)
            raise

    def _touch_below(self, ns: Namespace, key: StoreKey, lower: list[InspectableStore]) -> None:
        """A hit counts as a use in the tiers below it that keep recency (the disk tier's LRU order):
        otherwise the entries a faster tier serves most are the first a lower tier's budget prunes.
        Inline and rate-limited by the tier (never through the write queue, where a lookup would wait
        behind other requests' writes)."""
        for tier in lower:
            touch = getattr(tier, "touch", None)
            if touch is not None:
                touch(ns, key)

    def _put_one(self, tier: InspectableStore, ns: Namespace, key: StoreKey, entry: KVEntry) -> None:
        try:
            tier.put(ns, key, entry)
        except OSError as e:  # tiers log their own failures; a cache write never fails a request
            log.warning("%s store: put failed: %s", tier.name, e)

    def _put_each(self, tiers: Sequence[InspectableStore], ns: Namespace, key: StoreKey, entry: KVEntry) -> None:
        for tier in tiers:
            self._put_one(tier, ns, key, entry)

    def put(self, ns: Namespace, key: StoreKey, entry: KVEntry) -> None:
        """Store ``entry`` in every tier.

        Write-behind: the first tier at once (this process finds it from now on), the others in
        the background, in put order (another process finds it there after :meth:`flush`).
        Write-through: every tier inline, slowest first (so the fast tier never holds an entry
        that a concurrent reader could not also find below it). Entries are never modified after
        a put, so the background writer may read them later.
        """
        check_put(entry)
        self._count("puts")
        behind = self.writer is not None
        ticket = self._order.admit_put(ns, key, queued=behind)  # waits while a delete of the key is in flight
        first = self.tiers[:1]
        if behind:
            self._write(ticket, lambda: self._put_each(first, ns, key, entry), lambda: self._put_below(ns, key, entry))
        else:
            self._write(ticket, lambda: self._put_each([*reversed(self.tiers[1:]), *first], ns, key, entry), None)

    def _put_below(self, ns: Namespace, key: StoreKey, entry: KVEntry) -> None:
        """Every tier after the first, slowest first."""
        self._put_each(list(reversed(self.tiers[1:])), ns, key, entry)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the background writes submitted so far (True at once without write-behind).

        Args:
            timeout: seconds; None waits as long as it takes.

        Returns:
            False if the timeout expired first.
        """
        return self.writer is None or self.writer.flush(timeout)

    def close(self) -> None:
        """Finish the pending writes and stop the writer thread (later puts write inline)."""
        if self.writer is not None:
            self.writer.close()

    def contains(self, ns: Namespace, key: StoreKey) -> bool:
        return any(t.contains(ns, key) for t in self.tiers)

    def delete(self, ns: Namespace, key: StoreKey) -> bool:
        """Remove the key from every tier, slowest first; a write of it admitted before (a put, a promotion)
        lands before the tiers' deletes or not at all. Waits for nothing but the key's own writes in I/O."""
        with self._order.deleting(ns, key):
            return any([t.delete(ns, key) for t in reversed(self.tiers)])  # list: delete from all

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

    def counters(self) -> StoreStats:
        """The chain's lookups (counted here, once per lookup) and its tiers' evictions, without a scan."""
        with self._lock:
            s = counters_of(self._stats)
        for t in self.tiers:
            s.evictions += t.counters().evictions
        return s

    def stats(self) -> StoreStats:
        """The chain's lookups; entries/bytes of the most complete (last) tier (writes still pending
        there are counted in ``extra["pending_writes"]``)."""
        with self._lock:
            s = StoreStats(**{**self._stats.__dict__, "extra": dict(self._stats.extra)})
        if self.writer is not None:
            s.extra["pending_writes"] = self.writer.pending()
            s.extra["background_write_failures"] = self.writer.failures
        for name, ts in self.tier_stats():
            s.extra[f"{name}.entries"] = ts.entries
            s.extra[f"{name}.bytes"] = ts.bytes
            s.extra[f"{name}.hits"] = ts.hits
            for what in ("put_errors", "outages", "refused_calls"):  # a tier's write failures: it logs and
                if ts.extra.get(what):  # swallows them, so the chain's writer never sees one fail
                    s.extra[f"{name}.{what}"] = ts.extra[what]
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

    def verify(self, ns: Namespace, key: StoreKey) -> Verdict:
        """VALID if every tier holding the entry holds a valid copy; INVALID naming each tier that does not."""
        problems = [f"{t.name}: {v.reason}" for t in self.tiers if (v := t.verify(ns, key)).invalid]
        if problems:
            return Verdict.of("; ".join(problems))
        return VALID if self.contains(ns, key) else ABSENT

    def check_reachable(self) -> str:
        """Every unreachable tier with its reason ('' if all are reachable)."""
        return "; ".join(f"{t.name}: {why}" for t in self.tiers if (why := t.check_reachable()))

    def clear(self, ns: Namespace | None = None) -> int:
        """As :meth:`delete`, for every key of ``ns`` (None: every namespace); returns the entries removed
        from the tier that held the most. Puts of the namespace wait while it runs."""
        with self._order.clearing(ns):
            return max([t.clear(ns) for t in reversed(self.tiers)])  # slowest first, as delete
