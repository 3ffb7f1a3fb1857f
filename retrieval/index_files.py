"""The files of one index generation: their records and strict readers.

    CURRENT        the live generation's name: gen-NNNNNN, a folder inside the index
    meta.json      IndexMeta
    chunks.jsonl   one ChunkRecord per line
    files.json     {"next_slot": int, "files": {path: {sha256, signature, chunks: [[id, line|null, start, end]]}}}
    gc.json        {chunk id: text}

Each reader opens only a regular file of at most ``MAX_INDEX_FILE_BYTES`` (never
a FIFO), checks every field's JSON type, and returns a value or raises
:class:`RetrievalError` naming the file; nothing else escapes. Agreement between
the files is checked by :meth:`Catalog.open`.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, TypeVar

from blend import safeio
from blend.prompt import is_unicode
from blend.retrieval.corpus import RetrievalError
from blend.retrieval.index import MAX_DIM, MAX_INDEX_FILE_BYTES, IndexKind
from blend.retrieval.line_reader import lines_of

FORMAT_VERSION = 1
OPEN_RETRIES = 3  # generations a reader moves on to when a commit removes the one it is reading
T = TypeVar("T")
GENERATION = re.compile(r"gen-[0-9]{6,18}")  # the only names CURRENT may hold (commits count up from gen-000001)
MAX_SLOT = 1 << 62  # chunk slots are faiss vector ids (int64): a manifest's next slot stays well inside them


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
class IndexMeta:
    """What an index was built with; reopening with another embedder is an error.

    Attributes:
        embedder: the sentence embedder's name.
        embedder_fingerprint: its weights' fingerprint.
        dim: vector width.
        kind: the faiss index kind (``IndexKind`` value).
        threshold: size at which an AUTO index becomes approximate.
        format_version: the index format.
        kv_signature: what the chunk KV that the last ingest made sure of was keyed under (the
            engine's provenance and preamble, see ``engine_kv_signature``); "" = not recorded (an
            index built with ``--no-kv`` or before this field existed). When the engine's differs,
            the next ingest precomputes the chunk KV of every indexed chunk again.
    """

    embedder: str
    embedder_fingerprint: str
    dim: int
    kind: str
    threshold: int
    format_version: int = FORMAT_VERSION
    kv_signature: str = ""


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


def read_generation(root: Path) -> Path:
    """The folder ``CURRENT`` names: a ``gen-NNNNNN`` directory inside ``root``.

    Args:
        root: the index folder.

    Returns:
        The generation's folder.

    Raises:
        RetrievalError: ``CURRENT`` missing or unreadable, not a generation name, or naming something
            that is not a folder inside ``root`` (a symbolic link leading out).
    """
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



def read_live_generation(root: Path, read: Callable[[Path], T]) -> T:
    """``read`` of the generation ``CURRENT`` names; when it fails because a commit removed that generation
    while it was read (``CURRENT`` names another by then), the new one is read, up to ``OPEN_RETRIES`` times.

    Args:
        root: an index folder.
        read: reads one generation folder; raises RetrievalError on what it cannot read.

    Returns:
        What ``read`` returned.

    Raises:
        RetrievalError: ``read``'s, where ``CURRENT`` still names the generation it failed on (or after the
            retries), or ``read_generation``'s.
    """
    for attempt in range(OPEN_RETRIES + 1):
        gen = None  # CURRENT may name a generation a commit removed before it was checked
        try:
            gen = read_generation(root)
            return read(gen)
        except RetrievalError:  # a commit removed this generation while it was read: read the new one
            if attempt == OPEN_RETRIES or read_generation(root) == gen:
                raise
    raise AssertionError("unreachable")

def _bad(path: Path, what: str) -> RetrievalError:
    return RetrievalError(f"{path}: {what}")


def _is_count(x: Any) -> bool:
    """A JSON whole number >= 0 (``True`` is not one)."""
    return type(x) is int and x >= 0


def _index_meta(d: Any, path: Path) -> IndexMeta:
    names = {f.name for f in fields(IndexMeta)}
    if isinstance(d, dict) and set(d) == names - {"kv_signature"}:  # an index written before the field
        d = {**d, "kv_signature": ""}
    if not isinstance(d, dict) or set(d) != names:
        raise _bad(path, f"index metadata must be an object with {sorted(names)}")
    for k in ("embedder", "embedder_fingerprint", "kind", "kv_signature"):
        if not isinstance(d[k], str):
            raise _bad(path, f"{k} must be a string")
    if not _is_count(d["dim"]) or not 0 < d["dim"] <= MAX_DIM:
        raise _bad(path, f"dim must be a whole number in 1..{MAX_DIM}, got {d['dim']!r:.40}")
    if not _is_count(d["threshold"]) or type(d["format_version"]) is not int:
        raise _bad(path, "threshold and format_version must be whole numbers")
    if d["kind"] not in {k.value for k in IndexKind}:
        raise _bad(path, f"unknown index kind {d['kind']!r:.40}")
    return IndexMeta(**d)


def read_chunk_table(path: Path) -> dict[str, ChunkRecord]:
    """``chunks.jsonl``: every chunk row of a generation, each checked (blank lines skipped).

    Args:
        path: the chunk table.

    Returns:
        Chunk id -> its :class:`ChunkRecord`.

    Raises:
        RetrievalError: naming the file (and the line): missing, not a regular file, unreadable, over
            ``MAX_INDEX_FILE_BYTES``, a line that is not a chunk row, or a chunk id that appears twice.
    """
    records: dict[str, ChunkRecord] = {}
    for lineno, raw in enumerate(_read(path).split(b"\n"), start=1):
        if not raw.strip():
            continue
        rec = _chunk_row(path, lineno, raw)
        if rec.chunk_id in records:
            raise _bad(path, f"line {lineno}: chunk {rec.chunk_id[:16]!r} appears twice")
        records[rec.chunk_id] = rec
    return records


def chunk_texts_held(path: Path, texts: set[str]) -> set[str]:
    """Which of ``texts`` a chunk table holds, read a line at a time (another index's table, which a
    collection asks about a few texts: memory is bounded by the longest of them, not by the table).

    Every line that could hold one of ``texts`` is checked as :func:`read_chunk_table` checks it; a line
    too long to hold any (:func:`~blend.retrieval.line_reader.row_bound`) is passed over unread, and a
    chunk id that appears twice is not looked for (both would keep a table's own catalog from opening;
    neither changes which texts it references).

    Args:
        path: the chunk table (``chunks.jsonl`` of a generation).
        texts: the texts asked about.

    Returns:
        Those of ``texts`` its rows hold.

    Raises:
        RetrievalError: missing, not a regular file, unreadable, over ``MAX_INDEX_FILE_BYTES``, or a line
            that could hold one of ``texts`` is not a chunk row.
    """
    held: set[str] = set()
    try:
        for lineno, raw in lines_of(path, MAX_INDEX_FILE_BYTES, texts):
            text = _chunk_row(path, lineno, raw).text
            if text in texts:
                held.add(text)
    except FileNotFoundError:
        raise RetrievalError(f"{path}: missing from the index") from None
    except OSError as e:  # safeio.UnsafeFileError too: a FIFO, a link, an oversized file
        raise RetrievalError(f"{path}: unreadable ({e})") from None
    return held


_ROW_FIELDS = frozenset(f.name for f in fields(ChunkRecord))


def _chunk_row(path: Path, lineno: int, raw: bytes) -> ChunkRecord:
    """One line of a chunk table, checked (RetrievalError naming the line otherwise)."""
    try:
        row = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise _bad(path, f"line {lineno}: corrupt chunk row ({type(e).__name__})") from None
    if (not isinstance(row, dict) or set(row) != _ROW_FIELDS or not isinstance(row["chunk_id"], str)
            or not isinstance(row["text"], str) or not _is_count(row["slot"]) or not _is_count(row["n_tokens"])):
        raise _bad(path, f"line {lineno}: corrupt chunk row (want {sorted(_ROW_FIELDS)} of the right types)")
    if not is_unicode(row["text"]) or not is_unicode(row["chunk_id"]):  # JSON escapes allow lone surrogates
        raise _bad(path, f"line {lineno}: a chunk's text or id is not valid Unicode (a lone surrogate)")
    return ChunkRecord(**row)


def _chunk_ref(c: Any) -> ChunkRef:
    if (not isinstance(c, list) or len(c) != 4 or not isinstance(c[0], str)
            or not (c[1] is None or _is_count(c[1])) or not _is_count(c[2]) or not _is_count(c[3])):
        raise ValueError(f"chunk ref {c!r:.60} is not [chunk id, line or null, start, end]")
    return ChunkRef(c[0], c[1], c[2], c[3])


def _manifest(d: Any, path: Path) -> tuple[dict[str, FileEntry], int]:
    """(files, next slot) of ``files.json``."""
    if not isinstance(d, dict) or set(d) != {"next_slot", "files"}:
        raise _bad(path, "the manifest must be an object with next_slot and files")
    if not _is_count(d["next_slot"]) or d["next_slot"] > MAX_SLOT or not isinstance(d["files"], dict):
        raise _bad(path, f"next_slot must be a whole number up to {MAX_SLOT} and files an object")
    out: dict[str, FileEntry] = {}
    for p, fe in d["files"].items():
        if (not isinstance(fe, dict) or set(fe) != {"sha256", "signature", "chunks"} or not isinstance(fe["sha256"], str)
                or not isinstance(fe["signature"], str) or not isinstance(fe["chunks"], list)):
            raise _bad(path, f"entry of {p[:80]!r} must be an object with sha256, signature and a list of chunks")
        try:
            refs = tuple(_chunk_ref(c) for c in fe["chunks"])
        except ValueError as e:
            raise _bad(path, f"entry of {p[:80]!r}: {e}") from None
        if not all(is_unicode(s) for s in (p, fe["sha256"], fe["signature"])):  # the next commit could not write it
            raise _bad(path, f"entry of {p[:80]!r}: a path or digest is not valid Unicode (a lone surrogate)")
        out[p] = FileEntry(p, fe["sha256"], fe["signature"], refs)
    return out, d["next_slot"]


def _gc_list(d: Any, path: Path) -> dict[str, str]:
    if not isinstance(d, dict) or not all(isinstance(v, str) for v in d.values()):
        raise _bad(path, "the pending-GC list must be an object of chunk id -> text")
    if not all(is_unicode(k) and is_unicode(v) for k, v in d.items()):  # the next commit could not write it
        raise _bad(path, "a chunk id or text is not valid Unicode (a lone surrogate)")
    return d


def read_meta(path: Path) -> IndexMeta:
    """``meta.json``: what the index was built with.

    Args:
        path: the generation's ``meta.json``.

    Returns:
        The index's settings.

    Raises:
        RetrievalError: naming the file, for anything but a well-typed IndexMeta.
    """
    return _index_meta(_json_file(path), path)


def read_manifest(path: Path) -> tuple[dict[str, FileEntry], int]:
    """``files.json``: (path -> FileEntry, the next free vector slot).

    Args:
        path: the generation's ``files.json``.

    Returns:
        Each ingested file's entry by its path, and the next free vector slot.

    Raises:
        RetrievalError: naming the file, for anything but a well-typed manifest.
    """
    return _manifest(_json_file(path), path)


def read_gc_list(path: Path) -> dict[str, str]:
    """``gc.json``: chunk id -> text of chunks whose KV awaits deletion.

    Args:
        path: the generation's ``gc.json``.

    Returns:
        Chunk id -> chunk text.

    Raises:
        RetrievalError: naming the file, for anything but an object of strings.
    """
    return _gc_list(_json_file(path), path)
