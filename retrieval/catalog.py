"""A persisted retrieval index: vectors, chunk table, file manifest, pending GC.

Layout of an index folder::

    DIR/CURRENT            name of the live generation (replaced atomically)
    DIR/kv-intent.jsonl    chunks whose KV an ingest writes before the commit that adds them (appended;
                           removed by that commit; kv_intent.py)
    DIR/gen-000007/        meta.json, chunks.jsonl, files.json, gc.json,
                           ids.npy, vectors.npy, faiss.index, faiss.kind (kind and sha256 of faiss.index)

A commit writes a complete new generation into a temporary folder, renames
it, then swaps ``CURRENT`` (temp file + ``os.replace``): a reader or a
resumed ingest sees the old state or the new one, never a mix (a reader whose
generation a commit removed while it read reads the new one).

Chunks are shared between files (same text, same id); a chunk leaves the
index only when no file references it any more. Its id then moves to the
pending-GC list until :meth:`Catalog.collect_garbage` deletes its KV. A
chunk's KV is written before the commit that adds the chunk, so an ingest
notes it first (:meth:`Catalog.note_kv_intent`): a run killed in between
leaves KV no generation names, and the next commit queues every noted chunk
it does not hold for garbage collection.

Opening trusts none of these bytes: ``CURRENT`` must name a ``gen-NNNNNN``
folder inside the index (no link out of it), every file is read by the strict
readers of ``index_files.py`` (regular files under a cap, every field's type
checked) and the files must agree with each other. Anything else is one
:class:`RetrievalError` naming the file.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from blend import safeio
from blend.retrieval.corpus import RetrievalError
from blend.retrieval.index import ApproxParams, IndexKind, VectorIndex
from blend.retrieval.index_files import (  # the records are defined there, beside their readers
    FORMAT_VERSION,
    ChunkRecord,
    ChunkRef,
    FileEntry,
    IndexMeta,
    read_chunk_table,
    read_gc_list,
    read_generation,
    read_live_generation,
    read_manifest,
    read_meta,
)
from blend.retrieval.kv_intent import append_kv_intent, read_kv_intent, remove_kv_intent

__all__ = ["FORMAT_VERSION", "Catalog", "ChunkRecord", "ChunkRef", "FileEntry", "IndexMeta", "SearchHit"]


@dataclass(frozen=True)
class SearchHit:
    """A retrieved chunk with its score and first occurrence."""

    chunk_id: str
    score: float
    text: str
    source: str
    line: int | None
    start: int
    end: int


class Catalog:
    """An open index folder. Mutations are in memory until :meth:`commit`."""

    def __init__(self, root: Path, meta: IndexMeta) -> None:
        self.root = root
        self.meta = meta
        self.vectors = VectorIndex(meta.dim, IndexKind(meta.kind), ApproxParams(threshold=meta.threshold))
        self.records: dict[str, ChunkRecord] = {}
        self.files: dict[str, FileEntry] = {}
        self.pending_gc: dict[str, str] = {}  # chunk id -> text, unreachable, KV not yet deleted
        # a change to files, records and vectors that raised half-way (Ctrl-C, MemoryError): the state in
        # memory disagrees with itself and is never committed (the index keeps its last generation)
        self.interrupted = False
        self._next_slot = 0
        self._refs: dict[str, int] = {}
        self._where: dict[str, tuple[str, ChunkRef]] | None = None  # chunk id -> first occurrence
        self.settings_changed = False  # opened with another index kind or threshold than stored: commit to keep them
        self.kv_intent: dict[str, str] = {}  # chunk id -> text, noted since the last commit (read by open)

    # ---- open / commit -------------------------------------------------

    @staticmethod
    def exists(root: str | os.PathLike[str]) -> bool:
        """Whether ``root`` holds a committed index (anything at ``CURRENT``: :meth:`open` checks it)."""
        return os.path.lexists(Path(root) / "CURRENT")

    @classmethod
    def open(cls, root: str | os.PathLike[str], meta: IndexMeta | None = None) -> "Catalog":
        """Open an index folder, or create an empty one if ``meta`` is given.

        Args:
            root: the index folder.
            meta: required to create; if given for an existing index, its embedder must match.

        Returns:
            The catalog.

        Raises:
            RetrievalError: missing index (and no meta), corrupt files, or an embedder mismatch.
        """
        root = Path(root).expanduser().resolve()
        cat = cls._open_state(root, meta)
        cat.kv_intent = read_kv_intent(root)  # a killed run's: queued for collection, once, on the state opened
        cat._queue_intents()
        return cat

    @classmethod
    def _open_state(cls, root: Path, meta: IndexMeta | None) -> "Catalog":
        """The committed state of ``root`` (an empty one where none is committed yet; see :meth:`open`)."""
        if not cls.exists(root):
            if meta is None:
                raise RetrievalError(f"{root}: no index here (run `kvblend ingest PATH... --index {root}` first)")
            return cls(root, meta)
        return read_live_generation(root, lambda gen: cls._open_generation(root, gen, meta))

    @classmethod
    def _open_generation(cls, root: Path, gen: Path, meta: IndexMeta | None) -> "Catalog":
        """The catalog held by one generation folder (see :meth:`open`)."""
        stored = read_meta(gen / "meta.json")
        if stored.format_version != FORMAT_VERSION:
            raise RetrievalError(f"{root}: index format {stored.format_version}, expected {FORMAT_VERSION}")
        if meta is not None and (meta.embedder_fingerprint, meta.dim) != (stored.embedder_fingerprint, stored.dim):
            raise RetrievalError(f"{root}: index was built with another embedder ({stored.embedder}, dim {stored.dim})")
        changed = meta is not None and (meta.kind, meta.threshold) != (stored.kind, stored.threshold)
        if changed:  # ingest's --index-kind and --approx-threshold apply
            stored = IndexMeta(**{**asdict(stored), "kind": meta.kind, "threshold": meta.threshold})
        self = cls(root, stored)
        self.settings_changed = changed
        self.records = read_chunk_table(gen / "chunks.jsonl")
        files_path = gen / "files.json"
        self.files, self._next_slot = read_manifest(files_path)
        self.pending_gc = read_gc_list(gen / "gc.json")
        self.vectors = VectorIndex.load(gen, stored.dim, IndexKind(stored.kind), ApproxParams(threshold=stored.threshold))
        self._recount()
        slots = {r.slot for r in self.records.values()}
        if len(slots) != len(self.records):
            raise RetrievalError(f"{gen / 'chunks.jsonl'}: two chunks share a slot")
        if slots and self._next_slot <= max(slots):
            raise RetrievalError(f"{files_path}: next_slot {self._next_slot} would reuse slot {max(slots)}")
        if set(self.records) != set(self._refs):
            raise RetrievalError(f"{files_path}: the manifest references {len(self._refs)} chunks, "
                                 f"chunks.jsonl holds {len(self.records)} (they disagree)")
        if set(self.vectors.ids.tolist()) != slots or self.vectors.ntotal != len(self.records):
            raise RetrievalError(f"{gen / 'ids.npy'}: {self.vectors.ntotal} vector ids disagree with the "
                                 f"{len(self.records)} chunk slots of chunks.jsonl")
        return self

    def _recount(self) -> None:
        self._refs = {}
        for fe in self.files.values():
            for cid in {c.chunk_id for c in fe.chunks}:
                self._refs[cid] = self._refs.get(cid, 0) + 1

    def commit(self) -> None:
        """Write the whole state as a new generation and make it current, atomically.

        Raises:
            RetrievalError: a change was interrupted half-way (:attr:`interrupted`): nothing is written.
        """
        if self.interrupted:
            raise RetrievalError(f"{self.root}: a change was interrupted half-way; the index keeps its last commit")
        self.root.mkdir(parents=True, exist_ok=True)
        self._queue_intents()
        cur = self.root / "CURRENT"
        old = read_generation(self.root).name if self.exists(self.root) else ""
        n = int(old.split("-")[1]) + 1 if old else 1
        name = f"gen-{n:06d}"
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=self.root))
        (tmp / "meta.json").write_text(json.dumps(asdict(self.meta), sort_keys=True, indent=1))
        with open(tmp / "chunks.jsonl", "w", encoding="utf-8") as f:
            for rec in sorted(self.records.values(), key=lambda r: r.slot):
                f.write(json.dumps(asdict(rec), ensure_ascii=False) + "\n")
        files = {
            p: {"sha256": fe.sha256, "signature": fe.signature, "chunks": [[c.chunk_id, c.line, c.start, c.end] for c in fe.chunks]}
            for p, fe in sorted(self.files.items())
        }
        (tmp / "files.json").write_text(json.dumps({"next_slot": self._next_slot, "files": files}, ensure_ascii=False))
        (tmp / "gc.json").write_text(json.dumps(self.pending_gc, ensure_ascii=False))
        self.vectors.save(tmp)
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        safeio.fsync_dir(tmp)  # the generation's file names
        target = self.root / name
        if os.path.lexists(target):  # a killed commit's folder; or a file or link of nobody's making
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            else:
                target.unlink()
        os.replace(tmp, target)
        # CURRENT: a private temp file, fsynced, renamed, then the index folder fsynced (which also
        # makes the generation's rename above durable); the temp file is removed on failure
        safeio.atomic_write_text(cur, name)
        for p in self.root.iterdir():  # earlier generations and abandoned temp folders
            if p.name != name and (p.name.startswith("gen-") or p.name.startswith(".gen-")) and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
        remove_kv_intent(self.root)  # every noted chunk is held or queued now
        self.kv_intent = {}

    def _queue_intents(self) -> None:
        """Queue for garbage collection every noted chunk this state does not hold (its KV was written by
        a run that never committed it); one this run adds after all leaves the queue again."""
        for cid, text in self.kv_intent.items():
            if cid not in self.records:
                self.pending_gc.setdefault(cid, text)

    def note_kv_intent(self, chunks: dict[str, str]) -> None:
        """Note chunks whose KV is about to be written, before it is (appended to the intent log, not
        fsynced: it outlives a killed process, not a power loss). The next :meth:`commit` queues those it
        does not hold for garbage collection, so KV a killed ingest wrote is never orphaned.

        Args:
            chunks: chunk id -> text.
        """
        fresh = {cid: text for cid, text in chunks.items() if cid not in self.kv_intent}
        if not fresh:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        append_kv_intent(self.root, fresh)
        self.kv_intent.update(fresh)

    # ---- mutation ------------------------------------------------------

    def record_kv_signature(self, signature: str) -> None:
        """Record what the indexed chunks' KV is now keyed under (written by the next commit).

        Args:
            signature: the engine's ``engine_kv_signature`` ("" = unknown).
        """
        self.meta = replace(self.meta, kv_signature=signature)

    def is_current(self, path: str, sha256: str, signature: str) -> bool:
        """Whether ``path`` is in the manifest with this content and chunking."""
        fe = self.files.get(path)
        return fe is not None and fe.sha256 == sha256 and fe.signature == signature

    @contextlib.contextmanager
    def _change(self) -> Iterator[None]:
        """A change to files, records and vectors together: :attr:`interrupted` until it completes
        (an exception half-way leaves it set, and :meth:`commit` refuses the state)."""
        self.interrupted = True
        yield
        self.interrupted = False

    def replace_file(
        self, entry: FileEntry, new: Sequence[tuple[ChunkRecord, np.ndarray]]
    ) -> list[str]:
        """Make ``entry`` the manifest row for its path, adding and dropping chunks.

        Args:
            entry: the file's new manifest row (its chunk refs).
            new: records (slot ignored) and vectors (D,) for chunk ids not yet in the index.

        Returns:
            Ids of chunks no file references any more (removed from the index and
            queued for KV garbage collection).
        """
        with self._change():
            old = self.files.get(entry.path)
            old_ids = {c.chunk_id for c in old.chunks} if old else set()
            new_ids = {c.chunk_id for c in entry.chunks}
            add_ids: list[int] = []
            add_vecs: list[np.ndarray] = []
            given = {rec.chunk_id: (rec, vec) for rec, vec in new}
            for cid in sorted(new_ids - old_ids):
                self._refs[cid] = self._refs.get(cid, 0) + 1
                if cid in self.records:
                    self.pending_gc.pop(cid, None)
                    continue
                if cid not in given:
                    raise ValueError(f"no vector given for new chunk {cid}")
                rec, vec = given[cid]
                self.records[cid] = ChunkRecord(cid, self._next_slot, rec.text, rec.n_tokens)
                self.pending_gc.pop(cid, None)
                add_ids.append(self._next_slot)
                add_vecs.append(np.asarray(vec, dtype=np.float32).reshape(-1))  # (D,)
                self._next_slot += 1
            removed: list[str] = []
            for cid in sorted(old_ids - new_ids):
                self._refs[cid] -= 1
                if self._refs[cid] == 0:
                    del self._refs[cid]
                    removed.append(cid)
            self.files[entry.path] = entry
            self._where = None
            self._drop(removed)
            if add_ids:
                self.vectors.add(np.array(add_ids, dtype=np.int64), np.stack(add_vecs))  # (M,), (M, D)
            return removed

    def remove_file(self, path: str) -> list[str]:
        """Forget a file; returns the chunk ids that became unreachable."""
        with self._change():
            old = self.files.pop(path, None)
            self._where = None
            if old is None:
                return []
            removed: list[str] = []
            for cid in sorted({c.chunk_id for c in old.chunks}):
                self._refs[cid] -= 1
                if self._refs[cid] == 0:
                    del self._refs[cid]
                    removed.append(cid)
            self._drop(removed)
            return removed

    def _drop(self, removed: list[str]) -> None:
        if not removed:
            return
        slots = np.array([self.records[c].slot for c in removed], dtype=np.int64)  # (R,)
        for cid in removed:
            self.pending_gc[cid] = self.records.pop(cid).text
        self.vectors.remove(slots)

    def collect_garbage(self, delete_fn: Callable[[str, str], bool], held_elsewhere: frozenset[str] = frozenset()
                        ) -> int:
        """Delete the KV of unreachable chunks and forget them once deleted.

        Args:
            delete_fn: (chunk id, chunk text) -> True when its KV is gone (or was never stored).
            held_elsewhere: texts another index over the store still references: their KV is kept and they
                stay pending (a later collection deletes it once no index references them: the other index
                dropped them, or its folder was deleted).

        Returns:
            Number of chunks collected (call :meth:`commit` to persist).
        """
        # KV is keyed by the text, not the chunk id: an unreachable id whose text a live chunk still holds (ids
        # change when the tokenizer's fingerprint does) has nothing of its own to delete
        live = {rec.text for rec in self.records.values()}
        done = [cid for cid, text in sorted(self.pending_gc.items())
                if text not in held_elsewhere and (text in live or delete_fn(cid, text))]
        for cid in done:
            del self.pending_gc[cid]
        return len(done)

    # ---- queries -------------------------------------------------------

    def occurrence(self, chunk_id: str) -> tuple[str, ChunkRef]:
        """The first file (by path) and place a chunk occurs in."""
        if self._where is None:
            where: dict[str, tuple[str, ChunkRef]] = {}
            for path in sorted(self.files):
                for ref in self.files[path].chunks:
                    where.setdefault(ref.chunk_id, (path, ref))
            self._where = where
        return self._where[chunk_id]

    def search(self, queries: np.ndarray, k: int) -> list[list[SearchHit]]:
        """Top-k chunks per query, ordered by score descending then chunk id.

        Args:
            queries: (Q, D) float32 normalized embeddings.
            k: chunks per query.

        Returns:
            One list of hits per query.
        """
        by_slot = {r.slot: r for r in self.records.values()}
        out: list[list[SearchHit]] = []
        for scores, slots in self.vectors.search_candidates(queries, k):  # (C,), (C,) per query
            rows = [(float(s), by_slot[int(i)]) for s, i in zip(scores, slots) if int(i) in by_slot]
            rows.sort(key=lambda t: (-t[0], t[1].chunk_id))
            hits = []
            for s, rec in rows[:k]:
                path, ref = self.occurrence(rec.chunk_id)
                hits.append(SearchHit(rec.chunk_id, s, rec.text, path, ref.line, ref.start, ref.end))
            out.append(hits)
        return out

