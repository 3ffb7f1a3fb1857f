"""Which index folders share a store, so that one index's collection keeps the chunk KV another still uses.

Indexes over one store share the canonical KV of every chunk text they both hold: its key hashes the
text's tokens after the preamble, not the index. So before an ingest deletes the KV of chunks its index
dropped, it asks the store's registry which other indexes still reference them::

    ingest of A:  register A ──► ... ──► collect: for every other registered index B,
                                          B references text T  <=>  B's folder is an index here, T is in
                                          B's intent log (an ingest of B writing T's KV now, under any
                                          signature), or T is in B's committed chunk table and B's KV
                                          signature is A's or unknown ("": B's KV may be keyed as A's)
                                          -> T's KV stays and T stays pending in A: a later collection
                                             (A's, or B's once B drops T) deletes it when no index
                                             references T any more

The registry is a record log of the store's persistent tiers (``kv-indexes``: one JSON line
``{"root", "seen"}`` per ingest run; a disk tier's ``logs/`` folder, a Redis list), so every process
over the store reads it. A reference is read from the other index's own files when it is needed, never
kept as a count that could go stale: an index folder deleted without a collection (``rm -r``) pins
nothing from then on. An index whose files are there but cannot be read (damaged, a link or FIFO where a
file should be, oversized, unreadable) may reference anything: it keeps every text being collected until
it can be read again, or is deleted. Its registry line goes once it is also older than ``DEFAULT_REGISTRY_STALE_S``
(a folder on another machine is not visible here either: it pins nothing on this machine, and its line
stays that long for the machines that see it).

Limits: a memory-only store keeps no record log, so nothing is registered (indexes over one in-process
store collect each other's KV as before). An index registers on its next ingest, so one built before the
registry existed protects nothing until then. A chunk that another index's ingest is adding at the
very moment of the collection, whose KV it found stored (so it noted no intent), can still lose it
(that index's next query recomputes and stores it again).
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol, Sequence, runtime_checkable

from blend.defaults import DEFAULT_REGISTRY_STALE_S
from blend.donor_records import CompactableLog, RecordLog
from blend.retrieval.corpus import RetrievalError
from blend.retrieval.index_files import chunk_texts_held, read_live_generation, read_meta
from blend.retrieval.kv_intent import intended_texts

REGISTRY_LOG = "kv-indexes"  # the record log of the indexes over a store
# a path nothing can be at (any other failure to look at one may hide an index: its references are kept)
_GONE = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.ENAMETOOLONG})

log = logging.getLogger(__name__)


@runtime_checkable
class CheckedLog(Protocol):
    """A record log that tells an absent log from one it could not read (disk and Redis tiers)."""

    def read_records_checked(self, log: str) -> list[bytes] | None:
        """Every record of ``log`` (empty if there is none); None when it is there but was not read."""


@dataclass(frozen=True)
class Registration:
    """One index folder over the store, and when an ingest of it last registered."""

    root: str  # absolute, resolved
    seen: float  # unix time


@dataclass(frozen=True)
class IndexReferences:
    """What another index references: its recorded KV signature and the chunk texts asked about it holds."""

    signature: str  # "" when unknown (no committed generation, or its chunks went in without KV)
    texts: frozenset[str]  # held in its committed chunk table, under ``signature``
    # in its intent log: an ingest writing their KV now, under its engine's signature, which the committed
    # one need not be (a run under another system prompt records its signature only when it commits)
    intended: frozenset[str] = frozenset()


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
        line = _row(str(Path(root).expanduser().resolve()), self.clock())
        for tier in self.tiers:
            tier.append_record(REGISTRY_LOG, line)

    def registered(self) -> list[Registration]:
        """Every registered index (latest line per folder), dropping the stale lines of folders that are
        no index here from each tier's log.

        Returns:
            The registrations, by folder (those of the logs that could be read).
        """
        return self._read()[0]

    def _read(self) -> tuple[list[Registration], bool]:
        """(:meth:`registered`, whether every tier's log was read: False when one is there but could not
        be, e.g. a FIFO or link at its path, oversized, or its Redis server down)."""
        latest: dict[str, float] = {}
        complete = True
        for tier in self.tiers:
            lines = (tier.read_records_checked(REGISTRY_LOG) if isinstance(tier, CheckedLog)
                     else tier.read_records(REGISTRY_LOG))
            if lines is None:
                complete = False
                continue
            mine = _parse(lines)
            for root, seen in mine.items():
                latest[root] = max(seen, latest.get(root, seen))
            keep = {r: s for r, s in mine.items() if not self._retired(r, s)}
            rows = [_row(r, s) for r, s in sorted(keep.items())]
            if len(rows) < len(lines) and isinstance(tier, CompactableLog):  # duplicates or retired lines
                tier.rewrite_records(REGISTRY_LOG, lines, rows)  # (a concurrent append keeps the old log)
        return [Registration(r, s) for r, s in sorted(latest.items()) if not self._retired(r, s)], complete

    def _retired(self, root: str, seen: float) -> bool:
        """A folder not visible here (deleted, or on another machine) that no ingest registered for a while
        (one that cannot be looked at, e.g. behind a folder without search permission, is not retired)."""
        return seen < self.clock() - self.stale_s and _is_folder(root) is False

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
        registrations, complete = self._read()
        if not complete:  # an index registered only there may reference any of them
            log.warning("the index registry of the store could not be read; the chunk KV being collected stays")
            return set(texts)
        held: set[str] = set()
        for reg in registrations:
            if reg.root == own or not texts - held:
                continue
            state = _is_folder(reg.root)
            if state is None:  # there may be an index there: keep whatever it may reference
                log.warning("index %s: cannot be looked at; it keeps the chunk KV being collected", reg.root)
                refs = IndexReferences("", frozenset(texts), frozenset(texts))
            elif not state:
                continue
            else:
                refs = index_references(Path(reg.root), texts)
            held |= refs.intended
            if signature is None or refs.signature in ("", signature):
                held |= refs.texts
        return held


def index_references(root: Path, texts: set[str]) -> IndexReferences:
    """Which of ``texts`` the index at ``root`` references: its committed chunk table's and its intent log's,
    checked as :meth:`Catalog.open` checks them but read a line at a time, keeping only the texts asked about
    (memory is bounded by the longest of ``texts``, not by that index's files: see :mod:`line_reader
    <blend.retrieval.line_reader>`).

    Args:
        root: an index folder.
        texts: the texts asked about.

    Returns:
        Its signature, the texts of ``texts`` its chunk table holds and those its intent log notes; all of
        ``texts`` (both) with an unknown signature (and a warning) when its files are there but cannot be
        read (damaged, a link or FIFO, oversized, unreadable): what it references is then unknown, so its KV
        stays (fail safe).
    """
    try:
        intended = frozenset(intended_texts(root, texts))
    except RetrievalError as e:
        return _unknown(root, e, texts)
    current = _is_file(root / "CURRENT")
    if current is None:
        return _unknown(root, "CURRENT cannot be looked at", texts)
    if not current:
        return IndexReferences("", frozenset(), intended)

    def read(gen: Path) -> IndexReferences:
        signature = read_meta(gen / "meta.json").kv_signature
        held = chunk_texts_held(gen / "chunks.jsonl", texts)  # a line at a time: not the whole table
        return IndexReferences(signature, frozenset(held), intended)

    try:  # a commit of that index may remove the generation being read: the new one is read
        return read_live_generation(root, read)
    except RetrievalError as e:
        return _unknown(root, e, texts)


def _unknown(root: Path, why: object, texts: set[str]) -> IndexReferences:
    """What an index whose files cannot be read references: maybe any of ``texts``, under any signature."""
    log.warning("index %s: not read (%s); it keeps the chunk KV being collected", root, why)
    return IndexReferences("", frozenset(texts), frozenset(texts))


def _is_path(root: str) -> bool:
    """Whether ``root`` names a path of this file system (a lone surrogate that is no escaped byte does not)."""
    try:
        os.fsencode(root)
    except UnicodeEncodeError:
        return False
    return True


def _is_folder(root: str) -> bool | None:
    """Whether ``root`` is a folder (following links); None when that cannot be told (a permission error,
    an I/O error: an index may be there)."""
    try:
        return stat.S_ISDIR(os.stat(root).st_mode)
    except OSError as e:
        return False if e.errno in _GONE else None
    except ValueError:  # a NUL or a lone surrogate in it: no folder has that name
        return False


def _is_file(path: Path) -> bool | None:
    """Whether anything is at ``path`` (a link not followed); None when that cannot be told."""
    try:
        os.lstat(path)
        return True
    except OSError as e:
        return False if e.errno in _GONE else None
    except ValueError:
        return False


def _row(root: str, seen: float) -> bytes:
    """A registry line (ASCII: a folder name that is not UTF-8 is kept as its escaped surrogates)."""
    return json.dumps({"root": root, "seen": seen}).encode("ascii")


def _parse(lines: list[bytes]) -> dict[str, float]:
    """The latest ``seen`` per folder of a registry log's lines (a line that is not one is skipped)."""
    out: dict[str, float] = {}
    for line in lines:
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError; nesting too deep
            continue
        if not isinstance(row, dict):
            continue
        root, seen = row.get("root"), row.get("seen")
        if not (isinstance(root, str) and os.path.isabs(root) and _is_path(root)):
            continue
        if type(seen) not in (int, float):  # (not a bool)
            continue
        try:
            seen = float(seen)
        except OverflowError:  # a whole number past a float's range
            continue
        if math.isfinite(seen):
            out[root] = max(seen, out.get(root, seen))
    return out
