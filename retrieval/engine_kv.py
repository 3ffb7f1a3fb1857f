"""An engine's chunk KV kept in step with an index: what :func:`~blend.retrieval.ingest.ingest` is given
as its :class:`~blend.retrieval.ingest_options.KVSync`.

    kv = engine_kv_sync(engine, system)   # writer, deleter and signature over the engine's store
    ingest(paths, index_dir, tokenizer=..., embedder=..., kv=kv)

The writer precomputes new chunks' canonical KV and counts those that did not reach the store's last tier;
the deleter removes a deleted chunk's KV and its semantic donor; the signature says what keys the engine
derives, so an index can tell when its KV was computed under other ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from blend.keys import Namespace, StoreKey, key_hex
from blend.prompt import Segment, document_ids, preamble_segment
from blend.retrieval.ingest_options import KVSync
from blend.retrieval.registry import IndexRegistry
from blend.store.base import EntryState, store_tiers

if TYPE_CHECKING:  # the engine is imported lazily: retrieval works without it
    from blend.engine import Engine


class EngineKVWriter:
    """A :attr:`KVSync.writer <blend.retrieval.ingest_options.KVSync>` for :func:`~blend.retrieval.ingest.ingest` backed by an engine: texts -> bytes of
    KV written. A store write that fails is logged, never raised (the store is a cache), so after each
    batch it checks that every chunk's entry reached the store's last (most persistent) tier and counts
    those that did not in ``unsaved`` (an index must not record KV it does not have).

    Args:
        engine: the engine whose store receives canonical chunk KV.
        system: the system prompt the chunks will be asked under.
    """

    def __init__(self, engine: "Engine", system: str | None = None) -> None:
        self.engine, self.system = engine, system
        self.unsaved = 0  # chunks whose KV is not in the store's last tier after their batch

    def missing(self, texts: list[str]) -> list[bool]:
        """Which of ``texts`` have no KV in the store yet (the ones a call would write): an ingest notes only
        those in its intent log, so a killed run's collection never takes KV another index stored.

        Args:
            texts: chunk texts.

        Returns:
            One flag per text.
        """
        return [not self.engine.store.contains(Namespace.CANONICAL, key) for key, _ in self._keys(texts)]

    def _keys(self, texts: list[str]) -> list[tuple[StoreKey, bool]]:
        """Each chunk's canonical key (what :meth:`Engine.precompute_chunks` stores it under) and whether it
        fits the context after the preamble."""
        preamble = preamble_segment(self.engine.tokenizer, self.system)
        out = []
        for text in texts:
            ids = document_ids(self.engine.tokenizer, text)
            out.append((self.engine.segments.canonical_key(preamble.token_ids, ids),
                        self.engine.segments.chunk_fits(preamble, ids)))
        return out

    def __call__(self, texts: list[str]) -> int:
        last = store_tiers(self.engine.store)[-1]
        # a chunk longer than the context after the preamble gets no KV (no prompt holding it can be answered):
        # not a store failure, so it never keeps the index from recording its signature
        keys, fits = zip(*self._keys(texts)) if texts else ((), ())
        store, ns = self.engine.store, Namespace.CANONICAL
        for key in keys:
            # missing or damaged in the most persistent tier while the chain still holds the key (an emptied
            # Redis under a disk tier; a truncated file): precompute would take it as stored and never repair
            # it, so every copy goes and the chunk is computed again
            if store.contains(ns, key) and not _serves(last, key) and getattr(last, "available", True):
                store.delete(ns, key)  # (a tier in an outage answered nothing: its verdict is no reason)
        written = int(self.engine.precompute_chunks(list(texts), system=self.system))  # flushed on return
        self.unsaved += sum(ok and not last.contains(ns, key) for key, ok in zip(keys, fits))
        return written


def _serves(tier, key: StoreKey) -> bool:
    """Whether ``tier`` can serve ``key``'s canonical entry: the whole entry decoded where the tier can
    verify, else only whether it holds the key."""
    verify = getattr(tier, "verify", None)
    if verify is not None:
        return verify(Namespace.CANONICAL, key).state is EntryState.VALID
    return tier.contains(Namespace.CANONICAL, key)


def engine_kv_writer(engine: "Engine", system: str | None = None) -> EngineKVWriter:
    """A :attr:`KVSync.writer <blend.retrieval.ingest_options.KVSync>` for :func:`~blend.retrieval.ingest.ingest` backed by an engine (:class:`EngineKVWriter`).

    Args:
        engine: the engine whose store receives canonical chunk KV.
        system: the system prompt the chunks will be asked under.

    Returns:
        texts -> bytes of KV written; its ``unsaved`` counts chunks whose KV did not reach the store.
    """
    return EngineKVWriter(engine, system)


def canonical_chunk_key(engine: "Engine", preamble: Segment, text: str) -> StoreKey:
    """The canonical key :meth:`Engine.precompute_chunks` stores a chunk's KV under.

    Args:
        engine: the engine.
        preamble: the preamble segment the chunk is precomputed after.
        text: the chunk text.

    Returns:
        The chunk's canonical store key.
    """
    return engine.segments.canonical_key(preamble.token_ids, document_ids(engine.tokenizer, text))


def engine_kv_sync(engine: "Engine", system: str | None = None, write: bool = True,
                   refresh: bool = False) -> KVSync:
    """How :func:`~blend.retrieval.ingest.ingest` keeps an index's chunk KV in step with an engine: written
    (:func:`engine_kv_writer`), deleted with their chunks (:func:`engine_kv_deleter`) unless another index
    over the store still references them (:class:`~blend.retrieval.registry.IndexRegistry`), and checked
    against the engine's keys (:func:`engine_kv_signature`), all after ``system``'s preamble.

    Args:
        engine: the engine whose store holds the chunks' canonical KV.
        system: the system prompt the chunks will be asked under.
        write: write new chunks' KV (False: they go in without it, as ``kvblend ingest --no-kv``; removed
            chunks' KV is still deleted).
        refresh: pass every indexed chunk through the writer (e.g. after the store was emptied).

    Returns:
        The ingest's :class:`~blend.retrieval.ingest_options.KVSync`.
    """
    return KVSync(writer=engine_kv_writer(engine, system) if write else None,
                  deleter=engine_kv_deleter(engine, system), signature=engine_kv_signature(engine, system),
                  refresh=refresh, references=IndexRegistry(store_tiers(engine.store)))


def engine_kv_signature(engine: "Engine", system: str | None = None) -> str:
    """What an engine keys canonical chunk KV under, as a short string an index can record.

    The key of the empty chunk after the preamble: it hashes the engine's whole provenance (model,
    tokenizer, dtype, GEMM and attention backends, versions, store format) and the preamble, so it
    changes exactly when the keys :meth:`Engine.precompute_chunks` derives change.

    Args:
        engine: the engine.
        system: the system prompt the chunks will be asked under.

    Returns:
        A hex digest.
    """
    return key_hex(engine.segments.canonical_key(preamble_segment(engine.tokenizer, system).token_ids, []))


def engine_kv_deleter(engine: "Engine", system: str | None = None) -> "EngineKVDeleter":
    """A :attr:`KVSync.deleter <blend.retrieval.ingest_options.KVSync>` that removes a chunk's canonical KV from the engine's store, and the chunk
    from the engine's semantic donors.

    The key is derived exactly as ``Engine.precompute_chunks`` derives it, i.e. as
    :func:`engine_kv_writer` wrote it: unsalted, after ``system``'s preamble. KV of the chunk that
    requests computed under a ``cache_salt`` or another system prompt is not deleted (its keys hash
    the tenant's secret salt, which the index does not record); it can only ever be found for the
    very same tokens, and leaves the store by eviction (``store prune``, a byte budget, Redis TTL).

    Args:
        engine: the engine.
        system: the system prompt the chunks were precomputed under.

    Returns:
        (chunk id, text) -> True once the entry is gone (or was never stored); its ``finish()``, after a
        batch, rewrites the donor logs without the deleted chunks (``ingest`` calls it after collecting).
    """
    return EngineKVDeleter(engine, preamble_segment(engine.tokenizer, system))


class EngineKVDeleter:
    """Deletes chunks' canonical KV (see :func:`engine_kv_deleter`); :meth:`finish` after a batch purges
    the donor logs, so the deleted chunks' tokens leave them at once."""

    def __init__(self, engine: "Engine", preamble: Segment) -> None:
        self.engine, self.preamble = engine, preamble
        self.forgotten = 0

    def __call__(self, _cid: str, text: str) -> bool:
        key = canonical_chunk_key(self.engine, self.preamble, text)
        self.engine.store.delete(Namespace.CANONICAL, key)
        self.engine.segments.donors.forget(key)
        self.forgotten += 1
        gone = not self.engine.store.contains(Namespace.CANONICAL, key)
        # a tier that skipped or failed a call (a Redis outage) answered nothing: its copy may be there still,
        # so the chunk stays pending and the next collection deletes it again
        return gone and all(getattr(t, "available", True) for t in store_tiers(self.engine.store))

    def finish(self) -> None:
        """Rewrite the donor logs without the chunks deleted since the last call."""
        if self.forgotten:
            self.forgotten = 0
            self.engine.segments.donors.purge_logs()
