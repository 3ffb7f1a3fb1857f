"""Orders a tier chain's writes and deletes of each key, with no lock held across a tier's I/O.

``TieredStore`` (``tiered.py``) writes a key into several tiers (a put; a promotion, which copies a
lower tier's hit upward) and deletes it from all of them, on several threads at once (requests, the
write-behind thread). Which of a write and a delete of one key lands last must be one answer for every
tier, and a lookup that read an entry before a delete finished must never copy it back. The old
chain held a lock per stripe of keys across every tier's delete (a Redis round trip, a disk
unlink): one slow call stalled every lookup and delete of 1/64 of all keys. Here a stripe's lock
(a condition) guards only counters, never I/O:

- ``seq``: the stripe's clock, ticked when a delete or clear of a key in it starts and when it ends.
- per key, while anything is in flight: ``in_io`` (writes between their admission and the end of
  their I/O), ``queued`` (background writes admitted, not started), ``deleting`` (deletes in flight)
  and ``deleted_at`` (the tick its latest delete started at: the tombstone queued writes check).
- per namespace: ``clearing`` and ``cleared_at``, the same for clears.

Admission (under the lock, then the I/O outside it)::

    put:        wait while its key is being deleted/cleared ── note seq, in_io+1 (queued+1) ── I/O ── in_io-1
    promotion:  seq still what the lookup noted at its start, key not being deleted? else skip ── as a put
    queued:     queued-1; a delete/clear started after the write's seq? drop it ── else in_io+1 ── I/O ── in_io-1
    delete:     seq+1, deleting+1, deleted_at=seq ── wait until in_io == 0 ── tiers' I/O ── deleting-1, seq+1

Why each promised outcome holds:

- A lookup that began before a delete finished never brings the entry back. It noted seq ``s`` at
  its start. (1) The delete started after ``s`` and before the promotion's admission: seq moved,
  skipped. (2) It started before ``s`` and is still in flight at admission: ``deleting``, skipped.
  (3) It started before ``s`` and ended before admission: its end ticked seq, skipped. (4) The
  promotion was admitted before the delete started: its inline copy is in ``in_io``, which the
  delete waits out before its tiers' I/O (so the delete removes the copy), and its queued copy (the
  persistent tiers between, written behind) carries ``s`` < ``deleted_at`` and is dropped when it
  starts, or is in ``in_io`` if it already started.
- A put and a delete of one key: the one admitted last wins, in every tier. A put admitted before
  the delete: its inline write finished before the delete's I/O (``in_io``), its queued write is
  dropped or finished first (as a promotion's): the key is in no tier afterwards. A put that
  arrives while the delete is in flight waits for it (that key only) and then lands in every tier.
- A clear is the same, over every key of its namespace (each stripe, in order): queued writes
  older than it are dropped, writes in I/O are waited out, puts of its namespace wait for it and
  lookups that began before it ended do not promote.
- No deadlock: a delete or clear waits only for writes already admitted to finish their I/O, and
  an admitted write waits for nothing here (a queued write starting is a check, not a wait; a put
  handing its queued part to a full queue waits for the writer thread, which takes no lock across
  a write and never waits here). A put waits only for deletes/clears, which wait only for admitted
  writes: no cycle. So the write-behind thread never blocks on a delete, and a delete never waits
  for the queue to drain (its key's older queued writes are dropped), only for its key's write in I/O.
- Cold equals warm is untouched: this orders copies of entries, never changes one.

The stripes are conservative: a delete of another key in the stripe that starts during a lookup
skips that lookup's promotion (it is served from the lower tier this once and the next lookup
promotes it); it never blocks it.
"""

from __future__ import annotations

import threading
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

from blend.keys import Namespace, StoreKey

STRIPES = 64  # stripes of keys (by first byte) sharing one lock, clock and tombstone table
_NEVER = -1  # a tick before every real one


@dataclass
class _KeyState:
    """What is in flight for one key (dropped when nothing is)."""

    in_io: int = 0
    queued: int = 0
    deleting: int = 0
    deleted_at: int = _NEVER

    def idle(self) -> bool:
        return not (self.in_io or self.queued or self.deleting)


@dataclass
class _Stripe:
    cond: threading.Condition = field(default_factory=threading.Condition)
    seq: int = 0
    keys: dict[tuple[Namespace, bytes], _KeyState] = field(default_factory=dict)
    clearing: Counter[Namespace | None] = field(default_factory=Counter)  # None: every namespace
    cleared_at: dict[Namespace | None, int] = field(default_factory=dict)

    def state(self, ns: Namespace, key: bytes) -> _KeyState:
        return self.keys.setdefault((ns, key), _KeyState())

    def release(self, ns: Namespace, key: bytes) -> None:
        """Forget the key once nothing is in flight for it (a later write's seq is past its tombstone)."""
        st = self.keys.get((ns, key))
        if st is not None and st.idle():
            del self.keys[(ns, key)]
        self.cond.notify_all()

    def blocked(self, ns: Namespace, key: bytes) -> bool:
        """Whether a delete of the key or a clear of its namespace is in flight."""
        st = self.keys.get((ns, key))
        return bool((st is not None and st.deleting) or self.clearing[ns] or self.clearing[None])

    def removed_since(self, ns: Namespace, key: bytes, seq: int) -> bool:
        """Whether a delete of the key or a clear of its namespace started after tick ``seq``."""
        st = self.keys.get((ns, key))
        latest = max(st.deleted_at if st is not None else _NEVER, self.cleared_at.get(ns, _NEVER),
                     self.cleared_at.get(None, _NEVER))
        return latest > seq


@dataclass(frozen=True)
class WriteTicket:
    """One admitted write of a key (a put or a promotion): its inline part is in flight until
    :meth:`KeyOrder.finish`; its queued part, if any, runs between :meth:`KeyOrder.start_queued` and
    another :meth:`KeyOrder.finish`."""

    ns: Namespace
    key: bytes
    stripe: int
    seq: int


class KeyOrder:
    """The per-stripe clocks and in-flight counts of one chain (see the module docstring)."""

    def __init__(self) -> None:
        self._stripes = [_Stripe() for _ in range(STRIPES)]

    @staticmethod
    def stripe_of(key: StoreKey | bytes) -> int:
        return key[0] % STRIPES if key else 0  # keys are sha256 digests: their bytes spread evenly

    def seen(self, key: StoreKey) -> int:
        """The key's stripe's clock, noted by a lookup before it reads any tier."""
        s = self._stripes[self.stripe_of(key)]
        with s.cond:
            return s.seq

    def admit_put(self, ns: Namespace, key: StoreKey, queued: bool) -> WriteTicket:
        """Admit a put: waits while a delete of ``key`` or a clear of ``ns`` is in flight (then lands after it).

        Args:
            ns: the namespace.
            key: the key.
            queued: whether part of the write goes to the background writer.

        Returns:
            The ticket to pass to :meth:`finish` after the inline I/O (and :meth:`start_queued`).
        """
        i, k = self.stripe_of(key), bytes(key)
        s = self._stripes[i]
        with s.cond:
            s.cond.wait_for(lambda: not s.blocked(ns, k))
            return self._register(s, i, ns, k, s.seq, queued)

    def admit_promotion(self, ns: Namespace, key: StoreKey, seen: int, queued: bool) -> WriteTicket | None:
        """Admit a promotion of what a lookup that noted ``seen`` read, or None (skip it): a delete or clear
        started or ended since, or one is in flight."""
        i, k = self.stripe_of(key), bytes(key)
        s = self._stripes[i]
        with s.cond:
            if s.seq != seen or s.blocked(ns, k):
                return None
            return self._register(s, i, ns, k, seen, queued)

    @staticmethod
    def _register(s: _Stripe, i: int, ns: Namespace, key: bytes, seq: int, queued: bool) -> WriteTicket:
        st = s.state(ns, key)
        st.in_io += 1
        st.queued += int(queued)
        return WriteTicket(ns, key, i, seq)

    def finish(self, t: WriteTicket) -> None:
        """The ticket's inline I/O (or its started queued part) is over, done or failed."""
        s = self._stripes[t.stripe]
        with s.cond:
            s.state(t.ns, t.key).in_io -= 1
            s.release(t.ns, t.key)

    def start_queued(self, t: WriteTicket) -> bool:
        """The queued part of ``t`` is about to run: True if it may (then :meth:`finish` it), False if a
        delete or clear started after it was admitted (it is dropped: it would bring the entry back)."""
        s = self._stripes[t.stripe]
        with s.cond:
            st = s.state(t.ns, t.key)
            st.queued -= 1
            if s.removed_since(t.ns, t.key, t.seq):
                s.release(t.ns, t.key)
                return False
            st.in_io += 1
            return True

    def cancel_queued(self, t: WriteTicket) -> None:
        """The queued part of ``t`` was never handed to the writer."""
        s = self._stripes[t.stripe]
        with s.cond:
            s.state(t.ns, t.key).queued -= 1
            s.release(t.ns, t.key)

    @contextmanager
    def deleting(self, ns: Namespace, key: StoreKey) -> Iterator[None]:
        """Hold for a delete's I/O: entered once the key's writes admitted before it finished their I/O
        (its queued ones are dropped); puts of the key wait until it exits."""
        k = bytes(key)
        s = self._stripes[self.stripe_of(key)]
        with s.cond:
            s.seq += 1
            st = s.state(ns, k)
            st.deleting += 1
            st.deleted_at = s.seq
            s.cond.wait_for(lambda: st.in_io == 0)
        try:
            yield
        finally:
            with s.cond:
                st.deleting -= 1
                s.seq += 1
                s.release(ns, k)

    @contextmanager
    def clearing(self, ns: Namespace | None) -> Iterator[None]:
        """As :meth:`deleting`, for every key of ``ns`` (None: of every namespace)."""
        for s in self._stripes:
            with s.cond:
                s.seq += 1
                s.clearing[ns] += 1
                s.cleared_at[ns] = s.seq
        try:
            for s in self._stripes:
                with s.cond:
                    s.cond.wait_for(lambda s=s: not any(st.in_io for (n, _), st in s.keys.items()
                                                        if ns is None or n == ns))
            yield
        finally:
            for s in self._stripes:
                with s.cond:
                    s.clearing[ns] -= 1
                    s.seq += 1
                    s.cond.notify_all()
