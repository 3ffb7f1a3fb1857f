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
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from blend.keys import StoreKey
from blend.kvcache import RotatedPrefix


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

    def __contains__(self, key: StoreKey) -> bool:
        with self._lock:
            return bytes(key) in self._data
