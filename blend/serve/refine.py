"""Idle-time refinement: document orders that blends keep seeing get their exact KV.

In RAG traffic the same retrieved documents come back in the same order for related
questions. A blend answers each of them approximately (re-positioned chunks, a few rows
recomputed); once the exact KV of that order is stored, the next one takes the exact
path (a ``take_exact`` blend takes the exact prefix it finds; a refining server's blends are
``take_exact`` unless a request declines): bit-identical to a full prefill, at an
exact hit's cost. So the server computes that exact KV on a prefill worker that has
nothing else to do::

    blend of order O, some document not exact ─► seen(O) += 1 ─► == refine_after ─► pending
    idle prefill worker ─► PrefixFill(O).step()   (at most one segment computed and stored)
                       ─► back to waiting requests first; the fill goes on at the next idle moment
    O complete         ─► the next blend of O: every document exact, bit for bit a full prefill

Waiting requests always come first: a worker checks for them before every step, so a
request that arrives during a step waits for at most one segment's compute (the longest
document). Orders are admitted on their ``refine_after``-th blend, so a one-off order costs
no compute and no store space; an order's exact entries take as much store space as its
chunks and are evicted like any other entry.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque

from blend.keys import StoreKey
from blend.policy import ReuseMode, ReusePolicy
from blend.prefix_fill import PrefixFill, order_segments
from blend.prompt import Prompt, SegmentKind
from blend.report import ReuseClass, ReuseReport
from blend.segments import SegmentCache


class RefineQueue:
    """Orders that blends saw, counted, and the fills of those seen often enough.

    Thread-safe: requests' threads report sightings, idle workers take fills.

    Args:
        segments: the engine's segment cache.
        after: an order is queued on its ``after``-th blend with some document not exact (>= 1).
        max_pending: fills waiting at most (the oldest is dropped beyond).
        max_tracked: orders whose sightings are counted (least recently seen forgotten first).
    """

    def __init__(self, segments: SegmentCache, after: int, max_pending: int, max_tracked: int) -> None:
        if after < 1 or max_pending < 1 or max_tracked < 1:
            raise ValueError("refine_after, max_pending and max_tracked must be >= 1")
        self._segments = segments
        self.after = after
        self.max_pending = max_pending
        self.max_tracked = max_tracked
        self._lock = threading.Lock()
        self._seen: OrderedDict[StoreKey, int] = OrderedDict()  # order -> blends that saw it (LRU)
        self._pending: deque[PrefixFill] = deque()
        self._running: set[StoreKey] = set()  # fills a worker holds now
        self.completed = 0  # orders filled
        self.segments_computed = 0
        self.dropped = 0  # fills dropped: queue full, or a step failed

    @staticmethod
    def wants(policy: ReusePolicy, report: ReuseReport) -> bool:
        """Whether a request's prefill left work for a fill: a blend (not refused) with some
        document not exact."""
        if policy.mode is not ReuseMode.BLEND or report.gate:
            return False
        docs = [s for s in report.segments if s.kind is SegmentKind.DOCUMENT]
        return bool(docs) and any(s.reuse_class is not ReuseClass.EXACT for s in docs)

    def saw(self, prompt: Prompt, policy: ReusePolicy, report: ReuseReport) -> bool:
        """Count a finished prefill's order.

        Returns:
            True when this sighting queued the order's fill.
        """
        if not self.wants(policy, report) or not prompt.documents:
            return False
        fill = PrefixFill(self._segments, order_segments(prompt), policy.cache_salt)
        key = fill.key
        with self._lock:
            n = self._seen.pop(key, 0) + 1
            self._seen[key] = n
            while len(self._seen) > self.max_tracked:
                self._seen.popitem(last=False)
            queued = key in self._running or any(f.key == key for f in self._pending)
            if n < self.after or queued:
                return False
            self._seen[key] = 0  # counted afresh: if its entries are evicted later, it is filled again
            self._pending.append(fill)
            while len(self._pending) > self.max_pending:
                self._pending.popleft()
                self.dropped += 1
            return True

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def take(self) -> PrefixFill | None:
        """The fill to advance next (a worker then holds it until :meth:`put_back`)."""
        with self._lock:
            if not self._pending:
                return None
            fill = self._pending.popleft()
            self._running.add(fill.key)
            return fill

    def put_back(self, fill: PrefixFill, computed: int, failed: bool = False) -> None:
        """Return a fill after a step: unfinished ones go first in line again.

        Args:
            fill: the fill a worker took.
            computed: segments the step computed.
            failed: the step raised (the fill is dropped).
        """
        with self._lock:
            self._running.discard(fill.key)
            self.segments_computed += computed
            if failed:
                self.dropped += 1
            elif fill.done:
                self.completed += 1
            else:
                self._pending.appendleft(fill)
