"""The store interface every tier implements.

An entry is the KV of one segment for every layer: keys and values. A canonical
chunk's (and an approximate entry's) keys are BEFORE RoPE, so they can be
re-positioned; an exact-prefix entry's are after RoPE at the positions its key
fixes (:attr:`blend.keys.Namespace.k_after_rope`). The store holds bytes either
way; the caller's namespace says which form it reads. A lookup is checked against the provenance
the caller expects: an entry stored under the same key with a different
provenance (a collision or a tampered header) is ``REJECTED``, never used.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Iterator, Protocol, runtime_checkable

from blend.keys import Namespace, StoreKey
from blend.kv_entry import KVEntry

__all__ = ["KVEntry"]  # the entry type (blend.kv_entry: no torch import); tiers import it from here


class LookupStatus(Enum):
    HIT = "hit"
    MISS = "miss"
    REJECTED = "rejected"  # found but unusable: corrupt, wrong shape/dtype, provenance mismatch


@dataclass(frozen=True)
class Lookup:
    status: LookupStatus
    entry: KVEntry | None = None
    reason: str = ""
    tier: str = ""


class Presence(Enum):
    """Whether a store holds a key, as far as it can tell (:func:`presence`)."""

    PRESENT = "present"
    ABSENT = "absent"  # a definite answer: every tier was asked and holds nothing there
    UNKNOWN = "unknown"  # some tier could not be asked (a Redis outage, an unreadable folder)


@dataclass
class StoreStats:
    entries: int = 0
    bytes: int = 0
    hits: int = 0
    misses: int = 0
    rejected: int = 0
    puts: int = 0
    evictions: int = 0
    extra: dict[str, float] = field(default_factory=dict)


class KVStore(Protocol):
    """What the engine needs from any tier (or a chain of tiers)."""

    name: str

    def get(self, ns: Namespace, key: StoreKey, provenance: str) -> Lookup:
        """Look ``key`` up; a hit is returned only if its provenance equals ``provenance``."""
        ...

    def put(self, ns: Namespace, key: StoreKey, entry: KVEntry) -> None:
        """Store ``entry`` atomically (a reader never sees half an entry)."""
        ...

    def contains(self, ns: Namespace, key: StoreKey) -> bool: ...

    def delete(self, ns: Namespace, key: StoreKey) -> bool: ...

    def keys(self, ns: Namespace) -> Iterator[StoreKey]: ...

    def stats(self) -> StoreStats:
        """Counters and what the tier holds (entries, bytes: a scan of the disk folder or the Redis keys)."""
        ...

    def counters(self) -> StoreStats:
        """The counters of :meth:`stats` (lookups, puts, evictions) without the scan: entries and bytes
        are 0. Cheap enough for every metrics scrape."""
        ...


def counters_of(stats: StoreStats) -> StoreStats:
    """A copy of a tier's own counters (entries and bytes left 0), for :meth:`KVStore.counters`.

    Args:
        stats: the tier's live stats.

    Returns:
        A new :class:`StoreStats` with the lookup, put and eviction counters (``extra`` copied).
    """
    return StoreStats(hits=stats.hits, misses=stats.misses, rejected=stats.rejected, puts=stats.puts,
                      evictions=stats.evictions, extra=dict(stats.extra))


class EntryState(Enum):
    """What a tier's ``verify`` found under a key."""

    VALID = "valid"  # the whole entry decodes and passes its checks
    ABSENT = "absent"  # nothing stored there
    INVALID = "invalid"  # stored, and unusable (the verdict's reason says why)


@dataclass(frozen=True)
class Verdict:
    """A tier's ``verify`` of one key: its state, and why an invalid entry is unusable."""

    state: EntryState
    reason: str = ""

    @classmethod
    def of(cls, problem: str) -> "Verdict":
        """VALID for an empty problem (:func:`entry_problem`'s "nothing wrong"), else INVALID with it."""
        return cls(EntryState.INVALID, problem) if problem else VALID

    @property
    def invalid(self) -> bool:
        return self.state is EntryState.INVALID


VALID = Verdict(EntryState.VALID)
ABSENT = Verdict(EntryState.ABSENT)


@dataclass(frozen=True)
class EntryInfo:
    """What a tier knows about a stored entry without loading its tensors."""

    ns: Namespace
    key: StoreKey
    provenance: str
    shape: tuple[int, int, int, int]  # (L, Hkv, T, D)
    dtype: str  # "float32" | "float16" | "bfloat16"
    stored_bytes: int  # bytes the tier holds for it (tensors plus header)


@runtime_checkable
class InspectableStore(KVStore, Protocol):
    """Inspection used by ``kvblend store ls|verify|clear`` (every tier has it)."""

    def info(self, ns: Namespace, key: StoreKey) -> EntryInfo | None:
        """Header of a stored entry (None if absent); raises ``codec.EntryError`` if unreadable."""
        ...

    def verify(self, ns: Namespace, key: StoreKey) -> Verdict:
        """Decode the whole entry: VALID, ABSENT, or INVALID with the reason."""
        ...

    def clear(self, ns: Namespace | None = None) -> int:
        """Delete every entry (of ``ns``, or of all namespaces); returns how many."""
        ...

    def check_reachable(self) -> str:
        """'' if the tier can be read now and no call to it failed since the last check, else why not."""
        ...


def _kv_dtype_of(provenance: str) -> str | None:
    try:
        fields = json.loads(provenance)
    except (ValueError, TypeError, RecursionError):  # any string a stored header may carry
        return None
    return fields.get("kv_dtype") if isinstance(fields, dict) else None


def entry_problem(entry: KVEntry) -> str:
    """Why ``entry`` is malformed on its own ('' if it is not).

    The tensors must be (L, Hkv, T, D) of one dtype, and that dtype must be the
    ``kv_dtype`` its provenance claims: reduced-precision KV stored under a
    full-precision provenance would be served as full precision.

    Args:
        entry: the entry to check.

    Returns:
        A short reason, or "" for a well-formed entry.
    """
    if entry.k.shape != entry.v.shape or entry.k.dim() != 4:
        return f"bad shapes k={tuple(entry.k.shape)} v={tuple(entry.v.shape)}"
    if entry.k.dtype != entry.v.dtype:
        return f"dtype mismatch k={entry.k.dtype} v={entry.v.dtype}"
    kv_dtype = _kv_dtype_of(entry.provenance)
    have = str(entry.k.dtype).removeprefix("torch.")
    if kv_dtype is not None and kv_dtype != have:
        return f"tensors are {have}, provenance kv_dtype is {kv_dtype}"
    return ""


def check_put(entry: KVEntry) -> None:
    """Raise ``ValueError`` for an entry no tier may store (see :func:`entry_problem`).

    Args:
        entry: the entry about to be stored.

    Raises:
        ValueError: naming what is malformed.
    """
    why = entry_problem(entry)
    if why:
        raise ValueError(f"refusing to store a malformed KV entry: {why}")


def flush_writes(store: KVStore, timeout: float | None = None) -> bool:
    """Wait for a store's background writes, where it has any (a write-behind chain, or a wrapper of one).

    Args:
        store: any store; one without a ``flush`` method writes inline and has nothing to wait for.
        timeout: seconds; None waits as long as it takes.

    Returns:
        False if the timeout expired first.
    """
    flush = getattr(store, "flush", None)
    return True if flush is None else bool(flush(timeout))


def store_tiers(store: KVStore) -> list:
    """A store's tiers, first to last: a chain's (a tiered store, or a wrapper of one such as the server's
    FlightStore), else the store alone.

    Args:
        store: any store.

    Returns:
        The tiers; the last is the most persistent.
    """
    return list(getattr(store, "tiers", [store]))


def presence(store: KVStore, ns: Namespace, key: StoreKey) -> Presence:
    """Whether ``store`` holds ``key``, telling a definite absence from a tier that could not answer
    (``contains`` is False for both: a tier is a cache, so an outage reads as a miss).

    Args:
        store: any store; each of its tiers (:func:`store_tiers`) answers with its ``presence`` method
            where it has one (the disk and Redis tiers), else with ``contains`` (an in-process tier's
            answer is always definite).
        ns: the namespace.
        key: the key.

    Returns:
        PRESENT if any tier holds it; else UNKNOWN if any tier could not answer; else ABSENT.
    """
    unknown = False
    for tier in store_tiers(store):
        ask = getattr(tier, "presence", None)
        got = ask(ns, key) if ask is not None else (Presence.PRESENT if tier.contains(ns, key) else Presence.ABSENT)
        if got is Presence.PRESENT:
            return got
        unknown = unknown or got is Presence.UNKNOWN
    return Presence.UNKNOWN if unknown else Presence.ABSENT


def check_entry(entry: KVEntry, provenance: str) -> str:
    """Return why ``entry`` cannot serve ``provenance`` ('' if it can).

    Args:
        entry: an entry read from a tier.
        provenance: the canonical JSON of the provenance the reader needs.

    Returns:
        ``provenance mismatch``, what :func:`entry_problem` finds, or "".
    """
    if entry.provenance != provenance:
        return "provenance mismatch"
    return entry_problem(entry)
