"""What an ingest is asked to do and what it reports: its KV handling, its options and its summary."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Callable, Protocol, TextIO

from blend.defaults import DEFAULT_APPROX_THRESHOLD, DEFAULT_COMMIT_EVERY, DEFAULT_KV_BATCH
from blend.progress import Progress
from blend.retrieval.chunker import ChunkerConfig
from blend.retrieval.corpus import CorpusIssue
from blend.retrieval.index import IndexKind

KVWriter = Callable[[list[str]], int]
KVDeleter = Callable[[str, str], bool]


class KVReferences(Protocol):
    """The indexes sharing a store (:class:`~blend.retrieval.registry.IndexRegistry`)."""

    def register(self, root: str | os.PathLike[str]) -> None:
        """Record that ``root`` is an index over the store."""

    def held_elsewhere(self, root: str | os.PathLike[str], signature: str | None, texts: set[str]) -> set[str]:
        """Which of ``texts`` another live index over the store still references."""


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
        kv_bytes: bytes of KV written by ``KVSync.writer``.
        gc_collected: unreachable chunks whose KV was deleted.
        gc_pending: unreachable chunks whose KV still awaits deletion.
        seconds: wall time.
        files_removed: indexed files that no longer exist (under a folder given again, or named
            again), removed with their chunks.
        kv_checked: chunks already in the index whose KV this run made sure of again, because the
            engine's KV signature differs from the one the index recorded (or ``KVSync.refresh``).
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


@dataclass(frozen=True)
class KVSync:
    """How an ingest keeps chunk KV in step with its index (:func:`~blend.retrieval.engine_kv.engine_kv_sync`
    builds one over an engine).

    Attributes:
        writer: a batch of new chunk texts -> bytes of KV written (None: chunks go in without KV). It may
            also have ``missing(texts) -> [bool]`` (which texts it would write: only those are noted in the
            index's intent log) and ``unsaved`` (chunks whose KV did not reach the store).
        deleter: (chunk id, text) -> True once that chunk's KV is deleted (None: removed chunks' KV stays
            pending). It may also have ``finish()``, called after a collection.
        signature: what ``writer`` keys chunk KV under (``engine_kv_signature``). When it differs from the
            one the index recorded (a new model revision, dtype, GEMM backend, torch, system prompt...),
            every indexed chunk goes through ``writer`` again (it skips chunks whose KV is stored), so
            unchanged files do not leave their chunks without KV under the new keys. None: not checked.
        refresh: pass every indexed chunk through ``writer`` whatever the signature says (e.g. after the
            store was emptied).
        batch: chunk texts per ``writer`` call.
        references: the other indexes over the store: the run registers its index there, and a collection
            leaves the KV of chunks another index still references (None: every removed chunk's KV goes).
    """

    writer: KVWriter | None = None
    deleter: KVDeleter | None = None
    signature: str | None = None
    refresh: bool = False
    batch: int = DEFAULT_KV_BATCH
    references: KVReferences | None = None

    @property
    def unsaved(self) -> int:
        """Chunks whose KV the writer could not store (0 without a writer, or one that does not count)."""
        return int(getattr(self.writer, "unsaved", 0))


@dataclass(frozen=True)
class IngestOptions:
    """How an ingest chunks, indexes, commits and reports.

    Attributes:
        config: chunk sizes and overlap.
        kind: index kind (AUTO: exact below ``threshold`` vectors, HNSW above).
        threshold: size at which AUTO becomes approximate (>= 0).
        commit_every: commit after this many new chunks.
        progress: draw a progress bar.
        stream: where the bar goes (None: stderr).
    """

    config: ChunkerConfig = ChunkerConfig()
    kind: IndexKind = IndexKind.AUTO
    threshold: int = DEFAULT_APPROX_THRESHOLD
    commit_every: int = DEFAULT_COMMIT_EVERY
    progress: bool = True
    stream: TextIO | None = None

    def bar(self, total: int, desc: str, unit: str) -> Progress:
        """A progress bar on ``stream`` (stderr by default), drawn when ``progress`` says so.

        Args:
            total: units the run expects.
            desc: the bar's label.
            unit: what it counts.

        Returns:
            The bar (the caller closes it).
        """
        return Progress(total, desc=desc, unit=unit, stream=self.stream if self.stream is not None else sys.stderr,
                        enabled=self.progress)
