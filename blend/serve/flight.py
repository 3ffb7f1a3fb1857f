"""Single-flight for chunk misses shared by in-flight requests.

Two requests that miss the same chunk at the same time would both compute
it. Before its prefill, a request *claims* the store keys it will look up
and nobody holds; keys another in-flight request already claimed it waits
for. A claim ends when its key is put (the computation landed: waiters wake
and hit) or when its owner's prefill ends (failed, or reused something
else: waiters then compute for themselves)::

    request A:  claim {p, d1, d2} ─ prefill: miss d1 → compute → put d1 ─┐ ... release
    request B:  claim {p, d1, d3} → waits on p, d1 ─────────────────────┴► prefill: hit p, d1

A request waits only on claims made before its own, so waits never form a
cycle; a wait is bounded by ``timeout``. The keys come from
:func:`request_keys`, which mirrors how the engine keys a prompt: if the two
ever disagree, the cost is a duplicate computation, never a wrong answer
(the store's provenance checks decide what is served).
"""

from __future__ import annotations

import threading
from typing import Iterator, Sequence

from blend.keys import Namespace, StoreKey
from blend.policy import ReuseMode, ReusePolicy
from blend.prompt import Prompt
from blend.store.base import KVEntry, KVStore, Lookup, StoreStats, Verdict, flush_writes, store_tiers

FlightKey = tuple[Namespace, bytes]


def request_keys(engine, prompt: Prompt, policy: ReusePolicy) -> list[FlightKey]:
    """The store keys a prefill of ``prompt`` under ``policy`` looks up (and stores on a miss),
    derived by the engine's own segment cache.

    Args:
        engine: the server's engine (its segment cache derives the keys).
        prompt: the request's prompt.
        policy: the request's policy (its mode, prefix limit and cache salt).

    Returns:
        (namespace, key bytes) pairs: none without reuse or for a lone question; under exact reuse the
        prefix's segments (a conversation's earlier turns too); under a blend the preamble's exact key and
        each document's canonical key.
    """
    segments, salt = engine.segments, policy.cache_salt
    if policy.mode is ReuseMode.NONE or len(prompt.segments) < 2:  # one segment: the question, never stored
        return []
    if policy.mode is ReuseMode.EXACT:
        cacheable = prompt.segments[:-1]
        if policy.prefix_limit is not None:
            cacheable = cacheable[: policy.prefix_limit]
        if len(cacheable) == len(prompt.segments) - 1:  # a conversation's earlier turns are looked up too
            cacheable = [*cacheable, *prompt.question.parts()[:-1]]
        return [(ns, bytes(k)) for ns, k in segments.prefix_keys(cacheable, salt)]
    pre = prompt.preamble.token_ids
    keys = [(Namespace.EXACT, bytes(segments.exact_keys([prompt.preamble], salt)[0]))]
    keys += [(Namespace.CANONICAL, bytes(segments.canonical_key(pre, d.token_ids, salt))) for d in prompt.documents]
    return keys


class FlightStore:
    """A store wrapper that tracks which in-flight request computes which key.

    Args:
        inner: the engine's real store (any tier or chain).
    """

    def __init__(self, inner: KVStore) -> None:
        self.inner = inner
        self.name = inner.name
        self._cond = threading.Condition()
        self._owner: dict[FlightKey, int] = {}
        self.waited = 0  # requests that waited for another's computation

    @property
    def tiers(self) -> list:
        """The inner chain's tiers (donor logs attach to the persistent ones)."""
        return store_tiers(self.inner)

    # ---- claims -----------------------------------------------------------------------

    def claim(self, owner: int, keys: Sequence[FlightKey]) -> list[FlightKey]:
        """Claim the missing keys nobody holds; return those held by other owners."""
        missing = [k for k in dict.fromkeys(keys) if not self.inner.contains(k[0], StoreKey(k[1]))]
        busy = []
        with self._cond:
            for k in missing:
                holder = self._owner.setdefault(k, owner)
                if holder != owner:
                    busy.append(k)
        return busy

    def wait(self, keys: Sequence[FlightKey], timeout: float, stop: threading.Event | None = None) -> bool:
        """Block until none of ``keys`` is claimed (put or released), or ``stop`` is set (its request was
        cancelled: :meth:`wake` rouses the wait); False on timeout or when stopped."""
        if not keys:
            return True
        with self._cond:
            self.waited += 1
            free = self._cond.wait_for(lambda: all(k not in self._owner for k in keys)
                                       or (stop is not None and stop.is_set()), timeout)
            return free and not (stop is not None and stop.is_set())

    def wake(self) -> None:
        """Rouse every wait to look at its ``stop`` again (a request was cancelled)."""
        with self._cond:
            self._cond.notify_all()

    def release(self, owner: int) -> None:
        """Drop every claim ``owner`` still holds (its prefill ended)."""
        with self._cond:
            mine = [k for k, o in self._owner.items() if o == owner]
            for k in mine:
                del self._owner[k]
            if mine:
                self._cond.notify_all()

    def claimed(self) -> int:
        with self._cond:
            return len(self._owner)

    # ---- KVStore ----------------------------------------------------------------------

    def get(self, ns: Namespace, key: StoreKey, provenance: str) -> Lookup:
        return self.inner.get(ns, key, provenance)

    def put(self, ns: Namespace, key: StoreKey, entry: KVEntry) -> None:
        try:
            self.inner.put(ns, key, entry)
        finally:
            with self._cond:
                if self._owner.pop((ns, bytes(key)), None) is not None:
                    self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the inner store's background writes (see ``blend.store.write_behind``)."""
        return flush_writes(self.inner, timeout)

    def contains(self, ns: Namespace, key: StoreKey) -> bool:
        return self.inner.contains(ns, key)

    def delete(self, ns: Namespace, key: StoreKey) -> bool:
        return self.inner.delete(ns, key)

    def keys(self, ns: Namespace) -> Iterator[StoreKey]:
        return self.inner.keys(ns)

    def stats(self) -> StoreStats:
        return self.inner.stats()

    def counters(self) -> StoreStats:
        return self.inner.counters()

    def info(self, ns: Namespace, key: StoreKey):
        return self.inner.info(ns, key)

    def verify(self, ns: Namespace, key: StoreKey) -> Verdict:
        return self.inner.verify(ns, key)

    def clear(self, ns: Namespace | None = None) -> int:
        return self.inner.clear(ns)
