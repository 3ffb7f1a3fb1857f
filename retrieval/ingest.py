"""Ingest: read files, chunk, embed, index, and precompute chunk KV.

Idempotent and resumable: a file whose bytes, tokenizer and chunking are
unchanged is skipped; a changed file replaces only its own chunks (chunk ids
still present are kept with their vectors and KV); an indexed file deleted from a
folder given again (or named again) leaves the index with its chunks; progress is committed
atomically every ``commit_every`` new chunks
(:class:`~blend.retrieval.ingest_options.IngestOptions`) and when an exception
stops the run, so re-running after an interruption continues where it stopped
and never duplicates a chunk.

The engine is not imported here: KV is written and deleted through a
:class:`~blend.retrieval.ingest_options.KVSync` (a writer: a batch of chunk texts
-> bytes of KV written; a deleter: (chunk id, text) -> deleted).
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
from blend.retrieval.ingest_options import IngestOptions, IngestSummary, KVSync, KVWriter
from blend.terminal_text import shown


def chunking_signature(tokenizer_fp: str, config: ChunkerConfig) -> str:
    """sha256 over everything that decides a file's chunks besides its bytes (the chunker's version too).

    Args:
        tokenizer_fp: the chunking tokenizer's fingerprint.
        config: the chunker's settings.

    Returns:
        The digest, 64 lowercase hex digits.
    """
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
    # a named path that no longer is a file: gone, or a link whose target went; matched under the name
    # expand_paths indexed it by (its folder resolved, the link itself not followed) as well as resolved
    named = {str(r) for r in roots if not os.path.lexists(r)}
    named |= {str(q.absolute().parent.resolve() / q.name)
              for q in (Path(p).expanduser() for p in paths) if not q.exists()}
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


@dataclass
class _Tally:
    """What a run did so far (the summary's counts)."""

    ingested: int = 0
    unchanged: int = 0
    failed: int = 0
    documents: int = 0
    added: int = 0
    tokens: int = 0
    kv_bytes: int = 0
    removed: list[str] = field(default_factory=list)  # ids of the chunks that left the index
    added_ids: set[str] = field(default_factory=set)  # chunks whose KV this run wrote


def ingest(
    paths: Iterable[str | os.PathLike[str]],
    index_dir: str | os.PathLike[str],
    *,
    tokenizer: Any,
    embedder: Embedder,
    tokenizer_fp: str | None = None,
    kv: KVSync = KVSync(),
    options: IngestOptions = IngestOptions(),
) -> IngestSummary:
    """Ingest files into an index folder (created if absent).

    Args:
        paths: files and/or directories (.txt, .md, .jsonl); indexed files deleted under them are removed.
        index_dir: the index folder.
        tokenizer: the model's tokenizer, used for chunking.
        embedder: the sentence embedder.
        tokenizer_fp: the tokenizer's fingerprint (default: computed from it).
        kv: how chunk KV is written, deleted and checked (default: none of it).
        options: chunking, index kind, commits and progress.

    Returns:
        The run's :class:`IngestSummary`.

    Raises:
        RetrievalError: the index path is a file, the threshold is negative, nothing to ingest, or another
            ingest holds the index.
    """
    t0 = time.perf_counter()
    root = Path(index_dir).expanduser().resolve()
    if os.path.exists(root) and not os.path.isdir(root):
        raise RetrievalError(f"{root} is a file, not an index folder")
    if options.threshold < 0:
        raise RetrievalError(f"the approximate-index threshold must be >= 0 vectors, got {options.threshold}")
    paths = list(paths)  # read twice: expanded, then matched against the indexed files
    files, issues = expand_paths(paths, skip=[root])  # an index inside the corpus folder is not corpus
    if not files and not Catalog.exists(root):  # before the tokenizer is touched: the CLI checks this first
        raise RetrievalError(nothing_to_ingest(issues))
    fp = tokenizer_fp or tokenizer_fingerprint(tokenizer)
    lock = _Lock(root)
    try:
        meta = IndexMeta(embedder.info.name, embedder.info.fingerprint, embedder.dim, options.kind.value,
                         options.threshold)
        if kv.references is not None:  # before any KV is written: another index's collection sees this one
            kv.references.register(root)
        run = _Run(Catalog.open(root, meta), tokenizer, fp, embedder, kv, options, issues)
        # a run killed before its commit left noted chunks' KV: this run's commit queues it for collection
        run.dirty = not Catalog.exists(root) or run.cat.settings_changed or bool(run.cat.kv_intent)
        gone = vanished_files(run.cat.files, paths)
        if not files and not gone:  # (an index whose corpus was emptied still loses the files that went)
            raise RetrievalError(nothing_to_ingest(issues))
        for path in gone:  # deleted since it was indexed: its chunks go
            run.tally.removed += run.cat.remove_file(path)
        run.dirty = run.dirty or bool(gone)
        run.files(files)
        checked = run.sync_kv()
        collected = run.collect()
        t, cat = run.tally, run.cat
        return IngestSummary(
            files_seen=len(files), files_removed=len(gone), files_ingested=t.ingested, files_unchanged=t.unchanged,
            files_failed=t.failed, documents=t.documents, chunks_added=t.added, chunks_removed=len(t.removed),
            chunks_total=len(cat.records), tokens_added=t.tokens, kv_bytes=t.kv_bytes, gc_collected=collected,
            gc_pending=len(cat.pending_gc), seconds=time.perf_counter() - t0, issues=tuple(issues),
            removed_ids=tuple(t.removed), kv_checked=checked, kv_unsaved=kv.unsaved,
        )
    finally:
        lock.release()


class _Run:
    """One ingest run over an open catalog: its files, then the KV check, then the collection.

    Args:
        cat: the index's catalog (the run holds its lock).
        tokenizer, fp: the model's tokenizer and its fingerprint.
        embedder: the sentence embedder.
        kv: the run's KV handling.
        options: the run's options.
        issues: where problems found are appended.
    """

    def __init__(self, cat: Catalog, tokenizer: Any, fp: str, embedder: Embedder, kv: KVSync,
                 options: IngestOptions, issues: list[CorpusIssue]) -> None:
        self.cat, self.tokenizer, self.fp, self.embedder = cat, tokenizer, fp, embedder
        self.kv, self.options, self.issues = kv, options, issues
        self.signature = chunking_signature(fp, options.config)
        self.tally = _Tally()
        self.dirty = False  # the catalog holds changes its last commit does not
        self.since_commit = 0  # new chunks since the last commit

    def files(self, files: list[str]) -> None:
        """Ingest each file, committing every ``commit_every`` new chunks and when the loop ends or an
        exception stops it."""
        bar = self.options.bar(len(files), "ingest", "files")
        try:
            for path in files:
                bar.update(0, note=os.path.basename(path))
                added = self.file(path)
                bar.update(1, note=None if added is None else f"{os.path.basename(path)} +{added} chunks")
                if added is not None and self.since_commit >= self.options.commit_every:  # after an ingested file
                    self.cat.commit()
                    self.dirty, self.since_commit = False, 0
        finally:
            if self.dirty and not self.cat.interrupted:  # everything finished so far is consistent: keep it, even
                self.cat.commit()  # on an interrupt (a change cut half-way is not: the last commit stays, the rerun
            bar.close()  # redoes it)

    def file(self, path: str) -> int | None:
        """Read, chunk, embed and index one file (and write its new chunks' KV).

        Returns:
            The chunks it added; None where the file was not ingested (no document, or unchanged).
        """
        cat, t = self.cat, self.tally
        fr = read_file(path)
        self.issues.extend(fr.issues)
        if not fr.documents:
            t.failed += 1
            if path in cat.files and _no_longer_holds(cat, path, fr):
                t.removed += cat.remove_file(path)  # its old chunks are not what it holds: they go
                self.dirty = True
            return None
        if cat.is_current(path, fr.sha256, self.signature):
            t.unchanged += 1
            return None
        refs: list[ChunkRef] = []
        fresh: dict[str, ChunkRecord] = {}
        for doc in fr.documents:
            t.documents += 1
            for ch in chunk_text(doc.text, self.tokenizer, self.fp, self.options.config):
                refs.append(ChunkRef(ch.chunk_id, doc.line, ch.start, ch.end))
                if ch.chunk_id not in cat.records and ch.chunk_id not in fresh:
                    fresh[ch.chunk_id] = ChunkRecord(ch.chunk_id, -1, ch.text, ch.n_tokens)
        new = list(fresh.values())
        vecs = self.embedder.embed([r.text for r in new]) if new else None  # (M, D)
        self._write_new_kv(new)
        entry = FileEntry(path, fr.sha256, self.signature, tuple(refs))
        t.removed += cat.replace_file(entry, [(r, vecs[i]) for i, r in enumerate(new)])
        t.ingested += 1
        t.added += len(new)
        t.added_ids.update(r.chunk_id for r in new)
        t.tokens += sum(r.n_tokens for r in new)
        self.dirty = True
        self.since_commit += len(new)
        return len(new)

    def _write_new_kv(self, new: list[ChunkRecord]) -> None:
        """Write the KV of a file's new chunks (noted in the intent log first) and keep the recorded KV
        signature honest about chunks that go in without it."""
        writer, cat = self.kv.writer, self.cat
        if writer is not None:
            # before the KV, so it is never orphaned: the chunks whose KV this run writes (a writer that
            # says which are stored already keeps another index's KV out of a killed run's collection)
            missing = getattr(writer, "missing", None)
            todo = missing([r.text for r in new]) if (missing is not None and new) else [True] * len(new)
            cat.note_kv_intent({r.chunk_id: r.text for r, m in zip(new, todo) if m})
            self.tally.kv_bytes += _write_kv(writer, [r.text for r in new], self.kv.batch)
        if new and (writer is None or self.kv.unsaved) and cat.meta.kv_signature:
            # chunks go in without their KV (--no-kv, or store writes that failed): the signature no
            # longer says every chunk's KV is stored, so the next run with a writer checks them all.
            # Cleared in the commit that adds them: an interrupt or a kill after that commit keeps it
            cat.record_kv_signature("")

    def sync_kv(self) -> int:
        """Pass every indexed chunk through the writer where the engine's KV signature changed (or a refresh
        is asked); returns the chunks passed."""
        kv, cat = self.kv, self.cat
        stale = kv.signature is not None and kv.signature != cat.meta.kv_signature
        if kv.writer is None or not (kv.refresh or stale):
            return 0
        checked, written = _refresh_kv(cat, kv.writer, self.tally.added_ids, kv.batch, self.options)
        self.tally.kv_bytes += written
        if kv.signature is not None and not kv.unsaved:
            # recorded only once every chunk's KV is in the store: otherwise the next run tries again
            cat.record_kv_signature(kv.signature)
        cat.commit()
        return checked

    def collect(self) -> int:
        """Delete the KV of chunks no file references any more; returns the chunks collected."""
        deleter, cat = self.kv.deleter, self.cat
        if deleter is None or not cat.pending_gc:
            return 0
        refs = self.kv.references
        held = (frozenset(refs.held_elsewhere(cat.root, self.kv.signature, set(cat.pending_gc.values())))
                if refs is not None else frozenset())
        collected = cat.collect_garbage(deleter, held)
        cat.commit()
        finish = getattr(deleter, "finish", None)  # e.g. purge the deleted chunks from the donor logs
        if finish is not None:
            finish()
        return collected


def nothing_to_ingest(issues) -> str:
    """The error of a run with no corpus file to read (and, for an existing index, none that went).

    Args:
        issues: the :class:`CorpusIssue` of each path that gave no file (none: no paths were given).

    Returns:
        The message, naming each issue.
    """
    why = "; ".join(str(i) for i in issues) or "no paths given"
    return f"nothing to ingest (.txt, .md, .jsonl): {why}"


def _no_longer_holds(cat: Catalog, path: str, fr) -> bool:
    """Whether an indexed file that gave no document this run no longer holds what was indexed: emptied, or
    changed into bytes that cannot be read as text (another encoding, a binary, a JSONL of bad lines, too
    large, no longer a regular file). A file that could not be read (permissions, a passing error) keeps them."""
    if any(i.kind in (IssueKind.EMPTY, IssueKind.TOO_LARGE, IssueKind.NOT_REGULAR) for i in fr.issues):
        return True
    return bool(fr.sha256) and fr.sha256 != cat.files[path].sha256  # read ("" when it could not be)


def _refresh_kv(cat: Catalog, kv_writer: KVWriter, skip: set[str], batch: int,
                options: IngestOptions) -> tuple[int, int]:
    """Pass every indexed chunk not in ``skip`` through ``kv_writer``; (chunks passed, bytes written)."""
    texts = [r.text for cid, r in sorted(cat.records.items()) if cid not in skip]
    if not texts:  # every chunk was written by this run (a new index): no bar of nothing
        return 0, 0
    bar = options.bar(len(texts), "chunk KV", "chunks")
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
    """Print one ``warning: path:line: kind: message`` line per issue.

    Args:
        issues: the issues to print.
        stream: where to print; None: ``sys.stderr`` as it is at the call.
    """
    out = stream if stream is not None else sys.stderr
    for issue in issues:
        out.write(f"warning: {shown(str(issue))}\n")  # a file name may hold escape sequences
