"""The values the segment cache answers with (:mod:`blend.segments`): a lookup's outcome, what an exact
append did, a document's KV for a blend, a lookup in flight, and where a prompt prefix's segments are
stored."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Sequence

import torch

from blend.keys import Namespace, StoreKey
from blend.kvcache import KVEntry
from blend.prompt import Segment, SegmentKind
from blend.report import ReuseClass
from blend.store.base import Lookup


@dataclass(frozen=True)
class Found:
    """A lookup's outcome.

    Attributes:
        entry: the usable entry on a hit, else None.
        rejected: why a found entry is unusable ("" on a hit or a plain miss).
        seconds: time spent waiting for the store.
    """

    entry: KVEntry | None
    rejected: str
    seconds: float


@dataclass(frozen=True)
class Appended:
    """What :meth:`~blend.segments.SegmentCache.append_exact` did with one prefix segment."""

    reuse_class: ReuseClass  # EXACT (loaded), COMPUTED (miss) or REJECTED (found unusable, computed)
    note: str
    lookup_s: float


@dataclass(frozen=True)
class ChunkKV:
    """One document's KV for a blended request.

    Attributes:
        kv: K and V, all layers: K before RoPE (a canonical chunk, re-positioned by the blend), or after
            it for a document found in the exact run (``kv.rotated``: loaded where it was computed).
        reuse_class: how it was obtained (EXACT/BLENDED for its own entry, SEMANTIC,
            COMPUTED on a miss, REJECTED when a found entry was unusable).
        key: hex canonical key.
        note: why (rejection reason, donor, ...).
        forced: (F,) int64 offsets inside the document that must be recomputed
            whatever the selector says (tokens the KV does not belong to:
            semantic reuse's edits); None when the KV is the document's own.
    """

    kv: KVEntry
    reuse_class: ReuseClass
    key: str
    note: str = ""
    forced: torch.Tensor | None = None

    @property
    def own_kv(self) -> bool:
        return self.forced is None


@dataclass(frozen=True)
class PendingChunk:
    """A document's canonical key and, with overlapped loading, its lookup in flight."""

    key: StoreKey
    future: Future[Lookup] | None


def prefix_namespaces(segments: Sequence[Segment]) -> list[Namespace]:
    """Where each segment of a prompt's prefix is stored (:meth:`~blend.segments.SegmentCache.prefix_keys`, without
    keys): the first document right after the preamble under CANONICAL, every other segment under
    EXACT. A schedule without the store computes each segment in its namespace's form too, so turning
    the store off changes no bit (with a lower storage dtype the two forms round differently).

    Args:
        segments: the prefix's segments, in prompt order.

    Returns:
        One namespace per segment, in the same order.
    """
    out = [Namespace.EXACT] * len(segments)
    if len(segments) > 1 and segments[0].kind is SegmentKind.PREAMBLE and segments[1].kind is SegmentKind.DOCUMENT:
        out[1] = Namespace.CANONICAL
    return out
