"""Hot prefixes: the assembled, rotated KV of prompt prefixes that exact requests keep hitting.

An exact hit loads each stored segment into the request's cache (copying an
exact-prefix entry's K, kept after RoPE, and rotating the first document's
canonical K, kept before RoPE). For a prefix that comes back (the same
documents in the same order, a conversation's next turn), the engine keeps a
snapshot of the rows it loaded, K after RoPE, keyed by the prefix-chained key of
the prefix's last segment (which commits to every token before it, the salt and
the provenance): the next request attaches the snapshot to its cache instead of
loading anything (:meth:`blend.kvcache.KVCache.attach_prefix`), and its first
chunk attends to it in place. The snapshot is a read-only view of the rows the
load produced in that request's cache (:meth:`~blend.kvcache.KVCache.share`: no
copy; the budget counts the whole buffers it keeps alive), so the answer is
bit-identical.

An LRU with a byte budget, in process only (the store stays the shared,
persistent copy). A prefix is remembered when a request found every segment of
it stored (its second use), never on a cold request.

The segment cache keeps one (``SegmentCache.hot``); a request uses it through
:func:`attach_hot`, :func:`is_hot` and :func:`remember_hot`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Sequence

from blend.keys import StoreKey, key_hex
from blend.kvcache import KVCache, RotatedPrefix
from blend.prompt import Segment
from blend.report import ReuseClass, SegmentReport

if TYPE_CHECKING:  # the segment cache owns the hot prefixes; these only call its public methods
    from blend.segments import SegmentCache


class PrefixCache:
    """Rotated prefixes by prefix-chained key, least recently used out first.

    Args:
        budget_bytes: the most bytes of K and V held (0: keep nothing).
    """

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._data: OrderedDict[bytes, RotatedPrefix] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.kept = 0

    def get(self, key: StoreKey, length: int) -> RotatedPrefix | None:
        """The prefix stored under ``key`` if it has ``length`` rows (else None)."""
        with self._lock:
            got = self._data.get(bytes(key))
            if got is None or got.length != length:
                return None
            self._data.move_to_end(bytes(key))
            self.hits += 1
            return got

    def put(self, key: StoreKey, prefix: RotatedPrefix) -> None:
        """Remember ``prefix`` (dropping the least recently used ones past the budget)."""
        if prefix.nbytes > self.budget_bytes:
            return
        with self._lock:
            old = self._data.pop(bytes(key), None)
            if old is not None:
                self._bytes -= old.nbytes
            self._data[bytes(key)] = prefix
            self._bytes += prefix.nbytes
            self.kept += 1
            while self._bytes > self.budget_bytes:
                _, dropped = self._data.popitem(last=False)
                self._bytes -= dropped.nbytes

    def holds(self, key: StoreKey, length: int) -> bool:
        """Whether :meth:`get` would return a prefix (neither counted as a hit nor made recent)."""
        with self._lock:
            got = self._data.get(bytes(key))
            return got is not None and got.length == length

    @property
    def held_bytes(self) -> int:
        """Bytes of K and V the held prefixes keep alive (the whole buffers their views are of)."""
        with self._lock:
            return self._bytes

    def __contains__(self, key: StoreKey) -> bool:
        with self._lock:
            return bytes(key) in self._data


def _hot_keys(segments: SegmentCache, prefix: Sequence[Segment], question: Segment, salt: str
              ) -> tuple[list[Segment], list[StoreKey], int]:
    """The segments a hot prefix covers (``prefix`` and the question's earlier turns), their keys
    as the store holds them (the last one keys the hot prefix) and its rows."""
    segs = [*prefix, *question.parts()[:-1]]
    return segs, [k for _, k in segments.prefix_keys(segs, salt)], sum(len(s) for s in segs)


def attach_hot(segments: SegmentCache, cache: KVCache, prefix: Sequence[Segment], question: Segment, salt: str = ""
               ) -> tuple[SegmentReport, ...] | None:
    """Attach the hot prefix of ``prefix`` and the question's earlier turns to an empty cache.

    Args:
        segments: the engine's segment cache (its hot prefixes and keys).
        cache: the request's cache, empty.
        prefix: the segments before the question, in prompt order.
        question: the question segment (its earlier turns are part of the hot prefix).
        salt: the request's cache salt.

    Returns:
        EXACT report rows for the segments it covers (keys as the store holds them), or None
        when this prefix is not hot (nothing attached).
    """
    if not prefix or not segments.hot.budget_bytes:
        return None
    segs, keys, n = _hot_keys(segments, prefix, question, salt)
    hot = segments.hot.get(keys[-1], n)
    if hot is None:
        return None
    cache.attach_prefix(hot)
    rows, start = [], 0
    for seg, k in zip(segs, keys):
        rows.append(SegmentReport(seg.kind, ReuseClass.EXACT, len(seg), start, key_hex(k)))
        start += len(seg)
    return tuple(rows)


def is_hot(segments: SegmentCache, prefix: Sequence[Segment], question: Segment, salt: str = "") -> bool:
    """Whether :func:`attach_hot` would attach a prefix (nothing attached or counted here).

    Args:
        segments: the engine's segment cache.
        prefix: the segments before the question, in prompt order.
        question: the question segment.
        salt: the request's cache salt.

    Returns:
        True if the hot prefix is held.
    """
    if not prefix or not segments.hot.budget_bytes:
        return False
    _, keys, n = _hot_keys(segments, prefix, question, salt)
    return segments.hot.holds(keys[-1], n)


def remember_hot(segments: SegmentCache, cache: KVCache, prefix: Sequence[Segment], question: Segment,
                 rows: Sequence[SegmentReport], salt: str = "") -> None:
    """Keep the rows of ``prefix`` and the question's earlier turns as a hot prefix (views of
    ``cache``'s rows, which become read-only) when the request found every one of them stored
    (``rows``: its report rows, the question's last part last): their second use.

    Args:
        segments: the engine's segment cache (its hot prefixes and keys).
        cache: the request's cache, holding the prefix and the question.
        prefix: the segments before the question, in prompt order.
        question: the question segment.
        rows: the request's report rows, in prompt order.
        salt: the request's cache salt.
    """
    if not prefix or not segments.hot.budget_bytes or any(r.reuse_class is not ReuseClass.EXACT for r in rows[:-1]):
        return
    _, keys, n = _hot_keys(segments, prefix, question, salt)
    if keys[-1] not in segments.hot:
        segments.hot.put(keys[-1], cache.share(n))  # views of this request's rows: no copy
