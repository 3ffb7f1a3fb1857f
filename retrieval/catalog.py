"""A persisted retrieval index: vectors, chunk table, file manifest, pending GC.

Layout of an index folder::

    DIR/CURRENT            name of the live generation (replaced atomically)
    DIR/gen-000007/        meta.json, chunks.jsonl, files.json, gc.json,
                           ids.npy, vectors.npy, faiss.index, faiss.kind

A commit writes a complete new generation into a temporary folder, renames
it, then swaps ``CURRENT`` (temp file + ``os.replace``): a reader or a
resumed ingest sees the old state or the new one, never a mix.

Chunks are shared between files (same text, same id); a chunk leaves the
index only when no file references it any more. Its id then moves to the
pending-GC list until :meth:`Catalog.collect_garbage` deletes its KV.

Opening trusts none of these bytes: ``CURRENT`` must name a ``gen-NNNNNN``
folder inside the index (no link out of it), every file must be a regular
file under ``MAX_INDEX_FILE_BYTES`` (never a FIFO), and every field is checked
for its type and for agreement with the other files. Anything else is one
:class:`RetrievalError` naming the file.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from blend import safeio
from blend.retrieval.corpus import RetrievalError
from blend.retrieval.index import MAX_DIM, MAX_INDEX_FILE_BYTES, ApproxParams, IndexKind, VectorIndex

FORMAT_VERSION = 1
GENERATION = re.compile(r"gen-[0-9]{6,9}")  # the only names CURRENT may hold


@dataclass(frozen=True)
class ChunkRef:
    """Where a chunk occurs in a file: JSONL line (or None) and character span."""

    chunk_id: str
    line: int | None
    start: int
    end: int


@dataclass(frozen=True)
class FileEntry:
    """One ingested file in the manifest.

    Attributes:
        path: absolute path.
        sha256: hex digest of the file's bytes when ingested.
        signature: fingerprint of everything that shapes its chunks (tokenizer, chunker).
        chunks: occurrences of its chunks, in file order.
    """

    path: str
    sha256: str
    signature: str
    chunks: tuple[ChunkRef, ...]


@dataclass(frozen=True)
class ChunkRecord:
    """A row of the chunk table.

    Attributes:
        chunk_id: sha256 hex of (tokenizer fingerprint, text).
        slot: the int64 id of its vector in faiss.
        text: the chunk text.
        n_tokens: tokens of the text under the chunking tokenizer.
    """

    chunk_id: str
    slot: int
    text: str
    n_tokens: int


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


@dataclass(frozen=True)
class IndexMeta:
    """What an index was built with; reopening with something else is an error."""

    embedder: str
    embedder_fingerprint: str
    dim: int
    kind: str
    threshold: int
    format_version: int = FORMAT_VERSION


class Catalog:
    """An open index folder. Mutations are in memory until :meth:`commit`."""

    def __init__(self, root: Path, meta: IndexMeta) -> None:
        self.root = root
        self.meta = meta
        self.vectors = VectorIndex(meta.dim, IndexKind(meta.kind), ApproxParams(threshold=meta.threshold))
        self.records: dict[str, ChunkRecord] = {}
        self.files: dict[str, FileEntry] = {}
        self.pending_gc: dict[str, str] = {}  # chunk id -> text, unreachable, KV not yet deleted
        self._next_slot = 0
        self._refs: dict[str, int] = {}
        self._where: dict[str, tuple[str, ChunkRef]] | None = None  # chunk id -> first occurrence

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
        if not cls.exists(root):
            if meta is None:
                raise RetrievalError(f"{root}: no index here (run `kvblend ingest PATH... --index {root}` first)")
            return cls(root, meta)
        gen = _generation(root)
        stored = _index_meta(_json_file(gen / "meta.json"), gen / "meta.json")
        if stored.format_version != FORMAT_VERSION:
            raise RetrievalError(f"{root}: index format {stored.format_version}, expected {FORMAT_VERSION}")
        if meta is not None and (meta.embedder_fingerprint, meta.dim) != (stored.embedder_fingerprint, stored.dim):
            raise RetrievalError(f"{root}: index was built with another embedder ({stored.embedder}, dim {stored.dim})")
        if meta is not None and meta.kind != stored.kind:
            stored = IndexMeta(**{**asdict(stored), "kind": meta.kind, "threshold": meta.threshold})
        self = cls(root, stored)
        self.records = _chunk_table(gen / "chunks.jsonl")
        files_path = gen / "files.json"
        self.files, self._next_slot = _manifest(_json_file(files_path), files_path)
        self.pending_gc = _gc_list(_json_file(gen / "gc.json"), gen / "gc.json")
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
        """Write the whole state as a new generation and make it current, atomically."""
        self.root.mkdir(parents=True, exist_ok=True)
        cur = self.root / "CURRENT"
        old = _generation(self.root).name if self.exists(self.root) else ""
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
        target = self.root / name
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
        cur_tmp = self.root / f".CURRENT.{os.getpid()}"
        cur_tmp.write_text(name)
        os.replace(cur_tmp, cur)
        for p in self.root.iterdir():  # earlier generations and abandoned temp folders
            if p.name != name and (p.name.startswith("gen-") or p.name.startswith(".gen-")) and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)

    # ---- mutation ------------------------------------------------------

    def is_current(self, path: str, sha256: str, signature: str) -> bool:
        """Whether ``path`` is in the manifest with this content and chunking."""
        fe = self.files.get(path)
        return fe is not None and fe.sha256 == sha256 and fe.signature == signature

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

    def collect_garbage(self, delete_fn: Callable[[str, str], bool]) -> int:
        """Delete the KV of unreachable chunks and forget them once deleted.

        Args:
            delete_fn: (chunk id, chunk text) -> True when its KV is gone (or was never stored).

        Returns:
            Number of chunks collected (call :meth:`commit` to persist).
        """
        done = [cid for cid, text in sorted(self.pending_gc.items()) if delete_fn(cid, text)]
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


# ---- reading an index folder: every byte checked, every error names its file ----------------


def _read(path: Path) -> bytes:
    """A regular file of at most MAX_INDEX_FILE_BYTES, as bytes."""
    try:
        return safeio.read_regular(path, MAX_INDEX_FILE_BYTES)
    except FileNotFoundError:
        raise RetrievalError(f"{path}: missing from the index") from None
    except OSError as e:  # safeio.UnsafeFileError too: a FIFO, a link, an oversized file
        raise RetrievalError(f"{path}: unreadable ({e})") from None


def _json_file(path: Path) -> Any:
    try:
        return json.loads(_read(path))
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise RetrievalError(f"{path}: not valid JSON ({type(e).__name__}: {str(e)[:80]})") from None


def _generation(root: Path) -> Path:
    """The folder ``CURRENT`` names: a ``gen-NNNNNN`` directory inside ``root``."""
    cur = root / "CURRENT"
    raw = _read(cur)
    try:
        name = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        name = ""
    if not GENERATION.fullmatch(name):
        raise RetrievalError(f"{cur}: {raw[:40]!r} is not a generation name (gen-NNNNNN)")
    gen = root / name
    if os.path.realpath(gen) != os.path.join(os.path.realpath(root), name):
        raise RetrievalError(f"{cur}: {name} leads outside the index (a symbolic link)")
    if not gen.is_dir():
        raise RetrievalError(f"{cur}: names {name}, which is not a folder of the index")
    return gen


def _bad(path: Path, what: str) -> RetrievalError:
    return RetrievalError(f"{path}: {what}")


def _is_count(x: Any) -> bool:
    """A JSON whole number >= 0 (``True`` is not one)."""
    return type(x) is int and x >= 0


def _index_meta(d: Any, path: Path) -> IndexMeta:
    names = {f.name for f in fields(IndexMeta)}
    if not isinstance(d, dict) or set(d) != names:
        raise _bad(path, f"index metadata must be an object with {sorted(names)}")
    for k in ("embedder", "embedder_fingerprint", "kind"):
        if not isinstance(d[k], str):
            raise _bad(path, f"{k} must be a string")
    if not _is_count(d["dim"]) or not 0 < d["dim"] <= MAX_DIM:
        raise _bad(path, f"dim must be a whole number in 1..{MAX_DIM}, got {d['dim']!r:.40}")
    if not _is_count(d["threshold"]) or type(d["format_version"]) is not int:
        raise _bad(path, "threshold and format_version must be whole numbers")
    if d["kind"] not in {k.value for k in IndexKind}:
        raise _bad(path, f"unknown index kind {d['kind']!r:.40}")
    return IndexMeta(**d)


def _chunk_table(path: Path) -> dict[str, ChunkRecord]:
    names = {f.name for f in fields(ChunkRecord)}
    records: dict[str, ChunkRecord] = {}
    for lineno, raw in enumerate(_read(path).split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise _bad(path, f"line {lineno}: corrupt chunk row ({type(e).__name__})") from None
        if (not isinstance(row, dict) or set(row) != names or not isinstance(row["chunk_id"], str)
                or not isinstance(row["text"], str) or not _is_count(row["slot"]) or not _is_count(row["n_tokens"])):
            raise _bad(path, f"line {lineno}: corrupt chunk row (want {sorted(names)} of the right types)")
        if row["chunk_id"] in records:
            raise _bad(path, f"line {lineno}: chunk {row['chunk_id'][:16]!r} appears twice")
        records[row["chunk_id"]] = ChunkRecord(**row)
    return records


def _chunk_ref(c: Any) -> ChunkRef:
    if (not isinstance(c, list) or len(c) != 4 or not isinstance(c[0], str)
            or not (c[1] is None or _is_count(c[1])) or not _is_count(c[2]) or not _is_count(c[3])):
        raise ValueError(f"chunk ref {c!r:.60} is not [chunk id, line or null, start, end]")
    return ChunkRef(c[0], c[1], c[2], c[3])


def _manifest(d: Any, path: Path) -> tuple[dict[str, FileEntry], int]:
    """(files, next slot) of ``files.json``."""
    if not isinstance(d, dict) or set(d) != {"next_slot", "files"}:
        raise _bad(path, "the manifest must be an object with next_slot and files")
    if not _is_count(d["next_slot"]) or not isinstance(d["files"], dict):
        raise _bad(path, "next_slot must be a whole number and files an object")
    out: dict[str, FileEntry] = {}
    for p, fe in d["files"].items():
        if (not isinstance(fe, dict) or set(fe) != {"sha256", "signature", "chunks"} or not isinstance(fe["sha256"], str)
                or not isinstance(fe["signature"], str) or not isinstance(fe["chunks"], list)):
            raise _bad(path, f"entry of {p[:80]!r} must be an object with sha256, signature and a list of chunks")
        try:
            refs = tuple(_chunk_ref(c) for c in fe["chunks"])
        except ValueError as e:
            raise _bad(path, f"entry of {p[:80]!r}: {e}") from None
        out[p] = FileEntry(p, fe["sha256"], fe["signature"], refs)
    return out, d["next_slot"]


def _gc_list(d: Any, path: Path) -> dict[str, str]:
    if not isinstance(d, dict) or not all(isinstance(v, str) for v in d.values()):
        raise _bad(path, "the pending-GC list must be an object of chunk id -> text")
    return d
