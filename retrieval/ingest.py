"""Ingest: read files, chunk, embed, index, and precompute chunk KV.

Idempotent and resumable: a file whose bytes, tokenizer and chunking are
unchanged is skipped; a changed file replaces only its own chunks (chunk ids
still present are kept with their vectors and KV); an indexed file deleted from a
folder given again (or named again) leaves the index with its chunks; progress is committed
atomically every ``commit_every`` new chunks and when an exception stops the
run, so re-running after an interruption continues where it stopped and
never duplicates a chunk.

The engine is not imported here: KV is written through ``kv_writer`` (a batch
of chunk texts -> bytes of KV written) and deleted through ``kv_deleter``.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, TextIO

from blend import safeio
from blend.retrieval.catalog import Catalog
from blend.retrieval.index_files import ChunkRecord, ChunkRef, FileEntry, IndexMeta
from blend.retrieval.chunker import CHUNKER_VERSION, ChunkerConfig, chunk_text, tokenizer_fingerprint
from blend.retrieval.corpus import CorpusIssue, IssueKind, RetrievalError, expand_paths, read_file
from blend.retrieval.embedder import Embedder
from blend.retrieval.index import DEFAULT_APPROX_THRESHOLD, IndexKind
from blend.progress import Progress
from blend.terminal_text import shown

KVWriter = Callable[[list[str]], int]
KVDeleter = Callable[[str, str], bool]


@dataclass(frozen=True)
class IngestSummary:
    """What one ingest run did.

    Attributes:
        files_seen: files found under the given paths.
        files_ingested: files (re)chunked and indexed this run.
        files_unchanged: files skipped because nothing changed.
        files_failed: files with no usable document (see ``issues``).
        documents: documents read from ingested files.
        chunks_added: chunks new to the index.
        chunks_removed: chunks no file references any more.
        chunks_total: chunks in the index after the run.
        tokens_added: tokens of the added chunks.
        kv_bytes: bytes of KV written by ``kv_writer``.
        gc_collected: unreachable chunks whose KV was deleted.
        gc_pending: unreachable chunks whose KV still awaits deletion.
        seconds: wall time.
        files_removed: indexed files that no longer exist (under a folder given again, or named
            again), removed with their chunks.
        kv_checked: chunks already in the index whose KV this run made sure of again, because the
            engine's KV signature differs from the one the index recorded (or ``refresh_kv``).
        kv_unsaved: chunks whose KV did not reach the store (its writes failed: see the log); the index
            then does not record the engine's KV signature, so the next run writes them again.
        issues: problems found, each naming its file and line.
        removed_ids: ids of the removed chunks.
    """

    files_seen: int
    files_ingested: int
    files_unchanged: int
    files_failed: int
    documents: int
    chunks_added: int
    chunks_removed: int
    chunks_total: int
    tokens_added: int
    kv_bytes: int
    gc_collected: int
    gc_pending: int
    seconds: float
    issues: tuple[CorpusIssue, ...] = field(default_factory=tuple)
    removed_ids: tuple[str, ...] = field(default_factory=tuple)
    kv_checked: int = 0
    files_removed: int = 0
    kv_unsaved: int = 0

    def format(self) -> str:
        """A short human summary (issues are listed by the caller)."""
        tail = f"; KV of {self.gc_pending} removed chunks awaits collection" if self.gc_pending else ""
        if self.files_removed:
            tail += f"; {self.files_removed} deleted files removed"
        if self.kv_checked:
            tail += f"; KV of {self.kv_checked} indexed chunks checked for the current engine"
        if self.kv_unsaved:
            tail += f"; KV of {self.kv_unsaved} chunks NOT stored (the store's writes failed; run again)"
        return (
            f"{self.files_seen} files: {self.files_ingested} ingested, {self.files_unchanged} unchanged, "
            f"{self.files_failed} failed; {self.chunks_added} chunks added, {self.chunks_removed} removed, "
            f"{self.chunks_total} in index; {self.tokens_added} tokens; KV {_fmt_bytes(self.kv_bytes)}; "
            f"{self.seconds:.1f} s{tail}"
        )


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


def chunking_signature(tokenizer_fp: str, config: ChunkerConfig) -> str:
    """sha256 over everything that decides a file's chunks besides its bytes (the chunker's version too)."""
    return hashlib.sha256(f"{tokenizer_fp}\x00{config.fingerprint()}\x00v{CHUNKER_VERSION}".encode()).hexdigest()


def vanished_files(indexed: Iterable[str], paths: Iterable[str | os.PathLike[str]]) -> list[str]:
    """Indexed files that were deleted: each lies under one of ``paths`` (a folder that still exists,
    or is the very file named) and nothing exists at its path any more.

    A path argument that is missing altogether (an unmounted folder) removes nothing under it.

    Args:
        indexed: the manifest's paths (absolute, resolved when ingested).
        paths: this run's path arguments.

    Returns:
        The vanished paths, sorted.
    """
    roots = [Path(p).expanduser().resolve() for p in paths]
    dirs = [r for r in roots if r.is_dir()]
    named = {str(r) for r in roots if not os.path.lexists(r)}
    # no longer a file: deleted, replaced by a folder, or a link whose target is gone (a corpus link to a file
    # is read through, so its target going is the file going)
    return sorted(p for p in indexed if not os.path.isfile(p)
                  and (p in named or any(Path(p).is_relative_to(d) for d in dirs)))


class _Lock:
    """An exclusive, non-blocking lock on an index folder (one ingest at a time)."""

    def __init__(self, root: Path) -> None:
        try:
            root.mkdir(parents=True, exist_ok=True)
            self._fd = safeio.open_regular(root / ".lock", os.O_WRONLY | os.O_CREAT)
        except OSError as e:  # the index path is a file; a FIFO at .lock; no permission
            raise RetrievalError(f"{root / '.lock'}: cannot lock the index ({e})") from e
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            os.close(self._fd)
            raise RetrievalError(f"{root}: another ingest holds this index") from e

    def release(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)


def ingest(
    paths: Iterable[str | os.PathLike[str]],
    index_dir: str | os.PathLike[str],
    *,
    tokenizer: Any,
    embedder: Embedder,
    tokenizer_fp: str | None = None,
    config: ChunkerConfig = ChunkerConfig(),
    kv_writer: KVWriter | None = None,
    kv_deleter: KVDeleter | None = None,
    kv_signature: str | None = None,
    refresh_kv: bool = False,
    kind: IndexKind = IndexKind.AUTO,
    threshold: int = DEFAULT_APPROX_THRESHOLD,
    commit_every: int = 512,
    kv_batch: int = 16,
    progress: bool = True,
    stream: TextIO | None = None,
) -> IngestSummary:
    """Ingest files into an index folder (created if absent).

    Args:
        paths: files and/or directories (.txt, .md, .jsonl); indexed files deleted under them are removed.
        index_dir: the index folder.
        tokenizer: the model's tokenizer, used for chunking.
        embedder: the sentence embedder.
        tokenizer_fp: the tokenizer's fingerprint (default: computed from it).
        config: chunk sizes and overlap.
        kv_writer: batch of new chunk texts -> bytes of KV written (None: no KV).
        kv_deleter: (chunk id, text) -> True once that chunk's KV is deleted.
        kv_signature: what ``kv_writer`` keys chunk KV under (``engine_kv_signature``). When it
            differs from the one the index recorded (a new model revision, dtype, GEMM backend,
            torch, system prompt...), every indexed chunk goes through ``kv_writer`` again (it
            skips chunks whose KV is stored), so unchanged files do not leave their chunks without
            KV under the new keys. None: not checked.
        refresh_kv: pass every indexed chunk through ``kv_writer`` whatever the signature says
            (e.g. after the store was emptied).
        kind: index kind (AUTO: exact below ``threshold`` vectors, HNSW above).
        threshold: size at which AUTO becomes approximate.
        commit_every: commit after this many new chunks.
        kv_batch: chunk texts per ``kv_writer`` call.
        progress: draw a progress bar.
        stream: where the bar goes (default stderr).

    Returns:
        The run's :class:`IngestSummary`.
    """
    t0 = time.perf_counter()
    root = Path(index_dir).expanduser().resolve()
    if os.path.exists(root) and not os.path.isdir(root):
        raise RetrievalError(f"{root} is a file, not an index folder")
    if threshold < 0:
        raise RetrievalError(f"the approximate-index threshold must be >= 0 vectors, got {threshold}")
    paths = list(paths)  # read twice: expanded, then matched against the indexed files
    files, issues = expand_paths(paths, skip=[root])  # an index inside the corpus folder is not corpus
    if not files and not Catalog.exists(root):  # before the tokenizer is touched: the CLI checks this first
        raise RetrievalError(nothing_to_ingest(issues))
    fp = tokenizer_fp or tokenizer_fingerprint(tokenizer)
    signature = chunking_signature(fp, config)
    lock = _Lock(root)
    try:
        meta = IndexMeta(embedder.info.name, embedder.info.fingerprint, embedder.dim, kind.value, threshold)
        cat = Catalog.open(root, meta)
        stats = dict(ingested=0, unchanged=0, failed=0, docs=0, added=0, tokens=0, kv=0)
        removed_all: list[str] = []
        added_ids: set[str] = set()  # chunks whose KV this run wrote
        # a run killed before its commit left noted chunks' KV: this run's commit queues it for collection
        dirty, since_commit = not Catalog.exists(root) or cat.settings_changed or bool(cat.kv_intent), 0
        gone = vanished_files(cat.files, paths)
        if not files and not gone:  # (an index whose corpus was emptied still loses the files that went)
            raise RetrievalError(nothing_to_ingest(issues))
        for path in gone:  # deleted since it was indexed: its chunks go
            removed_all += cat.remove_file(path)
        dirty = dirty or bool(gone)
        bar = Progress(len(files), desc="ingest", unit="files", stream=stream if stream is not None else sys.stderr,
                       enabled=progress)
        try:
            for path in files:
                bar.update(0, note=os.path.basename(path))
                fr = read_file(path)
                issues.extend(fr.issues)
                if not fr.documents:
                    stats["failed"] += 1
                    if path in cat.files and _no_longer_holds(cat, path, fr):
                        removed_all += cat.remove_file(path)  # its old chunks are not what it holds: they go
                        dirty = True
                    bar.update(1)
                    continue
                if cat.is_current(path, fr.sha256, signature):
                    stats["unchanged"] += 1
                    bar.update(1)
                    continue
                refs: list[ChunkRef] = []
                fresh: dict[str, ChunkRecord] = {}
                for doc in fr.documents:
                    stats["docs"] += 1
                    for ch in chunk_text(doc.text, tokenizer, fp, config):
                        refs.append(ChunkRef(ch.chunk_id, doc.line, ch.start, ch.end))
                        if ch.chunk_id not in cat.records and ch.chunk_id not in fresh:
                            fresh[ch.chunk_id] = ChunkRecord(ch.chunk_id, -1, ch.text, ch.n_tokens)
                new = list(fresh.values())
                vecs = embedder.embed([r.text for r in new]) if new else None  # (M, D)
                if kv_writer is not None:
                    # before the KV, so it is never orphaned: the chunks whose KV this run writes (a writer that
                    # says which are stored already keeps another index's KV out of a killed run's collection)
                    missing = getattr(kv_writer, "missing", None)
                    todo = missing([r.text for r in new]) if (missing is not None and new) else [True] * len(new)
                    cat.note_kv_intent({r.chunk_id: r.text for r, m in zip(new, todo) if m})
                    stats["kv"] += _write_kv(kv_writer, [r.text for r in new], kv_batch)
                if new and (kv_writer is None or getattr(kv_writer, "unsaved", 0)) and cat.meta.kv_signature:
                    # chunks go in without their KV (--no-kv, or store writes that failed): the signature no
                    # longer says every chunk's KV is stored, so the next run with a writer checks them all.
                    # Cleared in the commit that adds them: an interrupt or a kill after that commit keeps it
                    cat.record_kv_signature("")
                entry = FileEntry(path, fr.sha256, signature, tuple(refs))
                removed_all += cat.replace_file(entry, [(r, vecs[i]) for i, r in enumerate(new)])
                stats["ingested"] += 1
                stats["added"] += len(new)
                added_ids.update(r.chunk_id for r in new)
                stats["tokens"] += sum(r.n_tokens for r in new)
                dirty = True
                since_commit += len(new)
                bar.update(1, note=f"{os.path.basename(path)} +{len(new)} chunks")
                if since_commit >= commit_every:
                    cat.commit()
                    dirty, since_commit = False, 0
        finally:
            if dirty and not cat.interrupted:  # everything finished so far is consistent: keep it, even on an
                cat.commit()  # interrupt (a change cut half-way is not: the last commit stays, the rerun redoes it)
            bar.close()
        checked = 0
        stale = kv_signature is not None and kv_signature != cat.meta.kv_signature
        if kv_writer is not None and (refresh_kv or stale):
            checked, written = _refresh_kv(cat, kv_writer, skip=added_ids, batch=kv_batch, progress=progress,
                                           stream=stream)
            stats["kv"] += written
            if kv_signature is not None and not getattr(kv_writer, "unsaved", 0):
                # recorded only once every chunk's KV is in the store: otherwise the next run tries again
                cat.record_kv_signature(kv_signature)
            cat.commit()
        collected = 0
        if kv_deleter is not None and cat.pending_gc:
            collected = cat.collect_garbage(kv_deleter)
            cat.commit()
            finish = getattr(kv_deleter, "finish", None)  # e.g. purge the deleted chunks from the donor logs
            if finish is not None:
                finish()
        return IngestSummary(
            files_seen=len(files),
            files_removed=len(gone),
            files_ingested=stats["ingested"],
            files_unchanged=stats["unchanged"],
            files_failed=stats["failed"],
            documents=stats["docs"],
            chunks_added=stats["added"],
            chunks_removed=len(removed_all),
            chunks_total=len(cat.records),
            tokens_added=stats["tokens"],
            kv_bytes=stats["kv"],
            gc_collected=collected,
            gc_pending=len(cat.pending_gc),
            seconds=time.perf_counter() - t0,
            issues=tuple(issues),
            removed_ids=tuple(removed_all),
            kv_checked=checked,
            kv_unsaved=int(getattr(kv_writer, "unsaved", 0)),
        )
    finally:
        lock.release()


def nothing_to_ingest(issues) -> str:
    """The error of a run with no corpus file to read (and, for an existing index, none that went)."""
    why = "; ".join(str(i) for i in issues) or "no paths given"
    return f"nothing to ingest (.txt, .md, .jsonl): {why}"


def _no_longer_holds(cat: Catalog, path: str, fr) -> bool:
    """Whether an indexed file that gave no document this run no longer holds what was indexed: emptied, or
    changed into bytes that cannot be read as text (another encoding, a binary, a JSONL of bad lines, too
    large, no longer a regular file). A file that could not be read (permissions, a passing error) keeps them."""
    if any(i.kind in (IssueKind.EMPTY, IssueKind.TOO_LARGE, IssueKind.NOT_REGULAR) for i in fr.issues):
        return True
    return bool(fr.sha256) and fr.sha256 != cat.files[path].sha256  # read ("" when it could not be)


def _refresh_kv(cat: Catalog, kv_writer: KVWriter, skip: set[str], batch: int, progress: bool,
                stream: TextIO | None) -> tuple[int, int]:
    """Pass every indexed chunk not in ``skip`` through ``kv_writer``; (chunks passed, bytes written)."""
    texts = [r.text for cid, r in sorted(cat.records.items()) if cid not in skip]
    if not texts:  # every chunk was written by this run (a new index): no bar of nothing
        return 0, 0
    bar = Progress(len(texts), desc="chunk KV", unit="chunks", stream=stream if stream is not None else sys.stderr,
                   enabled=progress)
    try:
        return len(texts), _write_kv(kv_writer, texts, batch, bar.update)
    finally:
        bar.close()


def _write_kv(kv_writer: KVWriter, texts: list[str], batch: int,
              on_batch: Callable[[int], object] | None = None) -> int:
    """Pass ``texts`` through ``kv_writer`` ``batch`` at a time; bytes written (``on_batch`` gets each count)."""
    written = 0
    for b in range(0, len(texts), batch):
        chunk = texts[b : b + batch]
        written += int(kv_writer(chunk))
        if on_batch is not None:
            on_batch(len(chunk))
    return written


def print_issues(issues: Iterable[CorpusIssue], stream: TextIO | None = None) -> None:
    """Print one ``warning: path:line: kind: message`` line per issue."""
    out = stream if stream is not None else sys.stderr
    for issue in issues:
        out.write(f"warning: {shown(str(issue))}\n")  # a file name may hold escape sequences
