"""The store interface every tier implements.

An entry is the KV of one segment for every layer: keys BEFORE RoPE (so they
can be re-positioned) and values. A lookup is checked against the provenance
the caller expects: an entry stored under the same key with a different
provenance (a collision or a tampered header) is ``REJECTED``, never used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Iterator, Protocol

import torch

from blend.keys import Namespace, StoreKey


@dataclass(frozen=True)
class KVEntry:
    """KV rows of one segment, all layers.

    Attributes:
        k: keys before RoPE, (L, Hkv, T, D).
        v: values, (L, Hkv, T, D).
        provenance: canonical JSON of the producing :class:`~blend.keys.Provenance`.
    """

    k: torch.Tensor  # (L, Hkv, T, D)
    v: torch.Tensor  # (L, Hkv, T, D)
    provenance: str

    @property
    def num_tokens(self) -> int:
        return int(self.k.shape[2])

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


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

    def stats(self) -> StoreStats: ...


def check_entry(entry: KVEntry, provenance: str) -> str:
    """Return why ``entry`` cannot serve ``provenance`` ('' if it can)."""
    if entry.provenance != provenance:
        return "provenance mismatch"
    if entry.k.shape != entry.v.shape or entry.k.dim() != 4:
        return f"bad shapes k={tuple(entry.k.shape)} v={tuple(entry.v.shape)}"
    if entry.k.dtype != entry.v.dtype:
        return f"dtype mismatch k={entry.k.dtype} v={entry.v.dtype}"
    return ""
