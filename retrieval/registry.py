"""Which index folders share a store, so that one index's collection keeps the chunk KV another still uses.

Indexes over one store share the canonical KV of every chunk text they both hold: its key hashes the
text's tokens after the preamble, not the index. So before an ingest deletes the KV of chunks its index
dropped, it asks the store's registry which other indexes still reference them::

    ingest of A:  register A ──► ... ──► collect: for every other registered index B,
                                          B references text T  <=>  B's folder is an index here, T is in
                                          B's committed chunk table or B's intent log (an ingest of B
                                          writing T's KV now), and B's KV signature is A's or unknown
                                          ("": B's KV may be keyed as A's)
                                          -> T's KV stays and T stays pending in A: a later collection
                                             (A's, or B's once B drops T) deletes it when no index
                                             references T any more

The registry is a record log of the store's persistent tiers (``kv-indexes``: one JSON line
``{"root", "seen"}`` per ingest run; a disk tier's ``logs/`` folder, a Redis list), so every process
over the store reads it. A reference is read from the other index's own files when it is needed, never
kept as a count that could go stale: an index folder deleted without a collection (``rm -r``) pins
nothing from then on. Its registry line goes once it is also older than ``DEFAULT_REGISTRY_STALE_S``
(a folder on another machine is not visible here either: it pins nothing on this machine, and its line
stays that long for the machines that see it).

Limits: a memory-only store keeps no record log, so nothing is registered (indexes over one in-process
store collect each other's KV as before). An index registers on its next ingest, so one built before the
registry existed protects nothing until then. A chunk that another index's ingest is adding at the
very moment of the collection, whose KV it found stored (so it noted no intent), can still lose it
(that index's next query recomputes and stores it again).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from blend.defaults import DEFAULT_REGISTRY_STALE_S
from blend.donor_records import CompactableLog, RecordLog
from blend.retrieval.catalog import OPEN_RETRIES, Catalog
from blend.retrieval.kv_intent import read_kv_intent
from blend.retrieval.corpus import RetrievalError
from blend.retrieval.index_files import read_chunk_table, read_generation, read_meta

REGISTRY_LOG = "kv-indexes"  # the record log of the indexes over a store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Registration:
    """One index folder over the store, and when an ingest of it last registered."""

    root: str  # absolute, resolved
    seen: float  # unix time


@dataclass(frozen=True)
class IndexReferences:
    """What another index references: its recorded KV signature and the chunk texts asked about it holds."""

    signature: str  # "" when unknown (no committed generation, or its chunks went in without KV)
    texts: frozenset[str]


class IndexRegistry:
    """The registry of index folders in a store's record-log tiers.

    Args:
        tiers: the store's tiers (those without record logs are skipped).
        stale_s: a line whose folder is no index here and that is older than this is dropped.
        clock: the time source (tests).
    """

    def __init__(self, tiers: Sequence[object], stale_s: float = DEFAULT_REGISTRY_STALE_S,
                 clock: Callable[[], float] = time.time) -> None:
        self.tiers = [t for t in tiers if isinstance(t, RecordLog)]
        self.stale_s, self.clock = stale_s, clock

    def register(self, root: str | os.PathLike[str]) -> None:
        """Record that ``root`` is an index over this store (an ingest does, each run).

        Args:
            root: the index folder.
        """
        line = json.dumps({"root": str(Path(root).expanduser().resolve()), "seen": self.clock()},
                          ensure_ascii=False).encode("utf-8")
        for tier in self.tiers:
            tier.append_record(REGISTRY_LOG, line)

    def registered(self) -> list[Registration]:
        """Every registered index (latest line per folder), dropping the stale lines of folders that are
        no index here from each tier's log.

        Returns:
            The registrations, by folder.
        """
        latest: dict[str, float] = {}
        for tier in self.tiers:
            lines = tier.read_records(REGISTRY_LOG)
            mine = _parse(lines)
            for root, seen in mine.items():
                latest[root] = max(seen, latest.get(root, seen))
            keep = {r: s for r, s in mine.items() if not self._retired(r, s)}
            rows = [json.dumps({"root": r, "seen": s}, ensure_ascii=False).encode("utf-8")
                    for r, s in sorted(keep.items())]
            if len(rows) < len(lines) and isinstance(tier, CompactableLog):  # duplicates or retired lines
                tier.rewrite_records(REGISTRY_LOG, lines, rows)  # (a concurrent append keeps the old log)
        return [Registration(r, s) for r, s in sorted(latest.items()) if not self._retired(r, s)]

    def _retired(self, root: str, seen: float) -> bool:
        """A folder not visible here (deleted, or on another machine) that no ingest registered for a while."""
        return seen < self.clock() - self.stale_s and not os.path.isdir(root)

    def held_elsewhere(self, root: str | os.PathLike[str], signature: str | None, texts: set[str]) -> set[str]:
        """Which of ``texts`` another registered index still references under this engine's keys.

        Args:
            root: the collecting index (its own references are its catalog's business).
            signature: the collecting engine's KV signature (None: any index's references count).
            texts: the chunk texts about to lose their KV.

        Returns:
            The texts whose KV must stay.
        """
        own = str(Path(root).expanduser().resolve())
        held: set[str] = set()
        for reg in self.registered():
            if reg.root == own or not texts - held or not os.path.isdir(reg.root):
                continue
            refs = index_references(Path(reg.root), texts)
            if signature is None or refs.signature in ("", signature):
                held |= refs.texts
        return held


def index_references(root: Path, texts: set[str]) -> IndexReferences:
    """Which of ``texts`` the index at ``root`` references: its committed chunk table's and its intent log's
    (read as :meth:`Catalog.open` reads them, without its vectors).

    Args:
        root: an index folder.
        texts: the texts asked about.

    Returns:
        Its signature and the texts of ``texts`` it holds (none, with a warning, when its files are damaged).
    """
    held = set(read_kv_intent(root).values()) & texts
    if not Catalog.exists(root):
        return IndexReferences("", frozenset(held))
    for attempt in range(OPEN_RETRIES + 1):
        gen = None  # a commit of that index may remove the generation being read: read the new one
        try:
            gen = read_generation(root)
            signature = read_meta(gen / "meta.json").kv_signature
            held |= {r.text for r in read_chunk_table(gen / "chunks.jsonl").values()} & texts
            return IndexReferences(signature, frozenset(held))
        except RetrievalError as e:
            if attempt == OPEN_RETRIES or _generation(root) == gen:
                log.warning("index %s: not read (%s); it keeps no chunk KV from collection", root, e)
                return IndexReferences("", frozenset(held))
    raise AssertionError("unreachable")


def _generation(root: Path) -> Path | None:
    try:
        return read_generation(root)
    except RetrievalError:
        return None


def _parse(lines: list[bytes]) -> dict[str, float]:
    """The latest ``seen`` per folder of a registry log's lines (a line that is not one is skipped)."""
    out: dict[str, float] = {}
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if not isinstance(row, dict):
            continue
        root, seen = row.get("root"), row.get("seen")
        if (isinstance(root, str) and os.path.isabs(root) and isinstance(seen, (int, float))
                and not isinstance(seen, bool) and math.isfinite(seen)):
            out[root] = max(float(seen), out.get(root, float(seen)))
    return out
