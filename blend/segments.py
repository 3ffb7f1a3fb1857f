"""The segment cache: segment KV by provenance key, loaded or computed.

The one owner of the store, the provenance, the storage dtype, the
background loader and the donor index. It answers questions with values and
never touches a request's report:

    exact_keys / canonical_key      keys (blend.keys) under this engine's provenance
    prefix_keys                     where each prefix segment lives (doc 1: its canonical key)
    lookup                          a store lookup -> :class:`~blend.segment_values.Found` (hit / miss / rejected)
    append_exact                    load a prefix segment into a cache, or compute and store it
    canonical_kv                    a chunk computed alone right after the preamble
    compute_canonical               that chunk computed, stored and offered as a donor (a blend's miss)
    compute_question                the question after an exact prefix: a conversation's earlier
                                    turns loaded (or computed and stored), the rest computed
    precompute_chunks               store canonical KV ahead of requests

A blended request's documents are fetched through these by :mod:`blend.blend_fetch`
(keyed and looked up in the background, hit / donor / computed, the exact-prefix run); a
hot prefix (its rows kept in ``hot``) is attached instead of loaded, and remembered, by
:mod:`blend.prefix_cache`.

A segment computed here leaves exactly the rows a later load will see: with a
lower storage dtype, the cache continues from the rounded rows (cold == warm).
What it stores under an EXACT key is K after RoPE, taken from the cache's rows
(a later load copies it); under a CANONICAL key, K before RoPE (a later load
rotates it wherever the chunk lands). See :attr:`blend.keys.Namespace.k_after_rope`.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import replace
from typing import Sequence

import torch

from blend.defaults import DEFAULT_PREFIX_CACHE_BYTES
from blend.keys import Namespace, Provenance, StoreKey, canonical_key, exact_chain, key_hex
from blend.kvcache import KVCache, KVEntry
from blend.prefix_cache import PrefixCache
from blend.model import ModelRunner
from blend.prompt import Segment, document_ids
from blend.report import ReuseClass, SegmentReport
from blend.segment_values import Appended, Found, prefix_namespaces
from blend.semantic import Donors
from blend.store.base import KVStore, Lookup, LookupStatus, flush_writes
from blend.store.prefetch import Prefetcher

log = logging.getLogger(__name__)


class SegmentCache:
    """Segment KV of one engine: keys, store I/O, canonical chunks, donors.

    Args:
        model: the runner that computes missing segments.
        store: the KV store (any tier or chain).
        provenance: every field that changes the KV this engine produces.
        kv_dtype: dtype KV is stored at.
        overlap_loading: look chunks up in background threads while computing.
        semantic: the engine's experimental semantic flag (enables the donor index).
    """

    def __init__(self, model: ModelRunner, store: KVStore, provenance: Provenance, kv_dtype: torch.dtype,
                 overlap_loading: bool, semantic: bool) -> None:
        self.model = model
        self.store = store
        self.provenance = provenance
        self.provenance_json = provenance.canonical_json()  # what every stored entry must carry
        self.kv_dtype = kv_dtype
        self.overlap_loading = overlap_loading
        self.donors = Donors(store, self.provenance_json, semantic)
        device = model.device
        self.prefetcher = Prefetcher(store, device=device if device.type == "cuda" else None)
        self.hot = PrefixCache(DEFAULT_PREFIX_CACHE_BYTES)  # rotated prefixes found stored again

    def close(self) -> None:
        """Stop the background loader's threads; wait for the store's background writes."""
        self.prefetcher.close()
        self.flush()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until what this cache put into the store is in every tier (write-behind, see
        ``blend.store.write_behind``): the request paths call it before a request finishes.

        Returns:
            False if ``timeout`` (seconds) expired first.
        """
        return flush_writes(self.store, timeout)

    # ---- keys and lookups ---------------------------------------------------------------

    def exact_keys(self, segments: Sequence[Segment], salt: str = "") -> list[StoreKey]:
        """Prefix-chained keys of ``segments`` (see :func:`blend.keys.exact_chain`) under a cache salt."""
        return exact_chain(self.provenance, [s.token_ids for s in segments], salt)

    def prefix_keys(self, segments: Sequence[Segment], salt: str = "") -> list[tuple[Namespace, StoreKey]]:
        """Where each segment of a prompt's prefix is stored for exact reuse.

        The first document right after the preamble sits at its canonical position, so its
        exact KV *is* its canonical chunk KV (computed alone right after the same preamble, by
        the same program): it is kept once, under its canonical key, and found there by exact
        requests and blends alike. Every other segment has its prefix-chained exact key.

        Args:
            segments: the prefix's segments, in prompt order.
            salt: the request's cache salt.

        Returns:
            (namespace, key) per segment.
        """
        keys = list(zip(prefix_namespaces(segments), self.exact_keys(segments, salt)))
        if keys[1:] and keys[1][0] is Namespace.CANONICAL:
            keys[1] = (Namespace.CANONICAL, self.canonical_key(segments[0].token_ids, segments[1].token_ids, salt))
        return keys

    def canonical_key(self, preamble_ids: Sequence[int], ids: Sequence[int], salt: str = "") -> StoreKey:
        """Key of a chunk's canonical KV after ``preamble_ids`` under a cache salt."""
        return canonical_key(self.provenance, preamble_ids, ids, salt)

    def lookup(self, ns: Namespace, key: StoreKey, tokens: int, pending: Future[Lookup] | None = None) -> Found:
        """Look a segment's KV up (or collect a background lookup).

        Args:
            ns: namespace of the key.
            key: the segment's store key.
            tokens: the segment's length (an entry of another length is unusable).
            pending: a lookup already started by the prefetcher, if any.

        Returns:
            The entry on a usable hit, or why a found entry was rejected, with the wait.
        """
        t0 = time.perf_counter()
        found = pending.result() if pending is not None else self.store.get(ns, key, self.provenance_json)
        seconds = time.perf_counter() - t0
        if found.status is LookupStatus.MISS:
            return Found(None, "", seconds)
        if found.status is LookupStatus.HIT:
            why = self.shape_problem(found.entry, tokens)
            if not why:  # the namespace says which form its K is in (the codec does not keep the flag)
                return Found(replace(found.entry, rotated=ns.k_after_rope), "", seconds)
            return Found(None, why, seconds)  # REJECTED: the caller recomputes it and overwrites the entry
        return Found(None, found.reason or "stored entry is unusable", seconds)

    def shape_problem(self, entry: KVEntry, tokens: int | None = None) -> str:
        """Why ``entry`` cannot be this model's KV of a ``tokens``-token segment ('' if it can).

        An entry under this engine's provenance should always have the model's (layers, KV heads,
        head dim); one that does not (a corrupt or tampered store) would fail inside the model's
        loader, so it is rejected like any unusable entry.
        """
        d = self.model.dims
        want = (d.num_layers, d.num_kv_heads, d.head_dim)
        for name, t in (("k", entry.k), ("v", entry.v)):
            if t.dim() != 4 or (int(t.shape[0]), int(t.shape[1]), int(t.shape[3])) != want:
                return (f"stored entry's {name} has shape {tuple(t.shape)}, the model's KV is "
                        f"(layers, kv heads, tokens, head dim) = ({want[0]}, {want[1]}, T, {want[2]})")
        if entry.k.shape != entry.v.shape:
            return f"stored entry's k {tuple(entry.k.shape)} and v {tuple(entry.v.shape)} differ"
        if tokens is not None and entry.num_tokens != tokens:
            return f"stored entry has the wrong length ({entry.num_tokens} tokens, the segment has {tokens})"
        return ""

    # ---- computing ----------------------------------------------------------------------

    def _stored_form(self, kv: KVEntry) -> KVEntry:
        """The entry as the store keeps it: storage dtype, on the CPU, stamped with the provenance."""
        return KVEntry(kv.k.to(self.kv_dtype).cpu(), kv.v.to(self.kv_dtype).cpu(), self.provenance_json, kv.rotated)

    def _compute(self, cache: KVCache, ids: Sequence[int], ns: Namespace) -> KVEntry:
        """Compute a segment whose KV will be stored under ``ns``; leave exactly the stored rows in the cache.

        Returns:
            Its KV in ``ns``'s form: for EXACT, K after RoPE as the cache holds it (``rotated``); else K
            before RoPE.
        """
        start = cache.length
        rotated = ns.k_after_rope
        _, kv = self.model.prefill(cache, self.model.ids(ids), keep_kv=not rotated)
        if rotated:
            kv = cache.entry(start, cache.length)  # (L, Hkv, S, D) K after RoPE
        if self.kv_dtype != self.model.dtype:  # cold must equal warm: continue from the rounded rows
            cache.length = start
            dt = self.model.dtype
            kv = KVEntry(kv.k.to(self.kv_dtype).to(dt), kv.v.to(self.kv_dtype).to(dt), rotated=rotated)
            self.model.load(cache, kv)
        return kv

    def append_exact(self, cache: KVCache, seg: Segment, key: StoreKey | None,
                     namespace: Namespace = Namespace.EXACT) -> Appended:
        """Append one prefix segment: load it on an exact hit, else compute and store it.

        Args:
            cache: the request's cache (the segment goes at its end).
            seg: the segment.
            key: its key (:meth:`prefix_keys`); None computes it without the store (no reuse:
                the same program as a cold exact run, so turning the cache off changes no bit).
            namespace: the key's namespace (CANONICAL for the first document, see :meth:`prefix_keys`).

        Returns:
            What happened, for the segment's report row.
        """
        return self.append_run(cache, [seg], [(namespace, key)])[0]

    def append_run(self, cache: KVCache, segs: Sequence[Segment],
                   keys: Sequence[tuple[Namespace, StoreKey | None]]) -> list[Appended]:
        """:meth:`append_exact` over consecutive prefix segments, in order. The hits of a run of
        consecutive hits are loaded together (:meth:`ModelRunner.load_many`: one rotation per layer
        over all of them), just before the next segment computed or at the end: the same rows as
        loading each in turn.

        Args:
            cache: the request's cache (the segments go at its end, in order).
            segs: the segments.
            keys: each segment's namespace and key (:meth:`prefix_keys`; a None key computes it
                without the store).

        Returns:
            What happened to each segment, in order.
        """
        done: list[Appended] = []
        hits: list[KVEntry] = []
        for seg, (ns, key) in zip(segs, keys, strict=True):
            found = self.lookup(ns, key, len(seg)) if key is not None else None
            if found is not None and found.entry is not None:
                hits.append(found.entry)
                done.append(Appended(ReuseClass.EXACT, "", found.seconds))
                continue
            self.model.load_many(cache, hits)  # the rows this segment attends to
            hits = []
            kv = self._compute(cache, seg.token_ids, ns)
            if found is None:
                done.append(Appended(ReuseClass.COMPUTED, "", 0.0))
                continue
            self.store.put(ns, key, self._stored_form(kv))
            done.append(Appended(ReuseClass.REJECTED, found.rejected, found.seconds) if found.rejected
                        else Appended(ReuseClass.COMPUTED, "", found.seconds))
        self.model.load_many(cache, hits)
        return done

    def canonical_kv(self, preamble: Segment, ids: Sequence[int], salt: str = "") -> KVEntry:
        """A chunk's canonical KV: computed alone, right after the preamble.

        Args:
            preamble: the preamble segment (its exact KV is loaded or stored on the way).
            ids: the chunk's token ids.
            salt: the request's cache salt (keys the preamble's exact KV).

        Returns:
            The chunk's KV (K before RoPE), exactly as a later load will see it.
        """
        cache = self.model.new_cache(len(preamble) + len(ids))
        self.append_exact(cache, preamble, self.exact_keys([preamble], salt)[0])
        return self._compute(cache, ids, Namespace.CANONICAL)

    def compute_canonical(self, preamble: Segment, ids: Sequence[int], key: StoreKey, salt: str = "") -> KVEntry:
        """A chunk's canonical KV (:meth:`canonical_kv`), stored under ``key`` and offered as a donor: what a
        blend does with a document the store lacks (:func:`blend.blend_fetch.fetch_chunks`).

        Args:
            preamble: the preamble segment.
            ids: the chunk's token ids.
            key: the chunk's canonical key (under ``salt``).
            salt: the request's cache salt.

        Returns:
            The chunk's KV (K before RoPE), exactly as a later load will see it.
        """
        kv = self.canonical_kv(preamble, ids, salt)
        self.store.put(Namespace.CANONICAL, key, self._stored_form(kv))
        self.register_donor(preamble.token_ids, ids, key, salt)
        return kv

    def compute_rest(self, cache: KVCache, segs: Sequence[Segment]) -> tuple[torch.Tensor, tuple[SegmentReport, ...]]:
        """Compute the remaining segments in one causal pass, storing nothing.

        Args:
            cache: the request's cache (the segments go at its end).
            segs: the segments, in prompt order (the question last).

        Returns:
            First-token logits (V,) float32 and a COMPUTED report row per segment.
        """
        start = cache.length
        h, _ = self.model.prefill(cache, self.model.ids([t for seg in segs for t in seg.token_ids]), keep_kv=False)
        rows = []
        for seg in segs:
            rows.append(SegmentReport(seg.kind, ReuseClass.COMPUTED, len(seg), start))
            start += len(seg)
        return self.model.logits(h[-1:])[0], tuple(rows)

    def compute_question(self, cache: KVCache, prefix: Sequence[Segment], question: Segment, use_store: bool,
                         salt: str = "", attached: bool = False) -> tuple[torch.Tensor, tuple[SegmentReport, ...], float]:
        """The question segment after a prefix whose KV in ``cache`` is exact (or computed).

        A conversation's question segment is cut at its earlier turns' ends (:meth:`Segment.parts`):
        each earlier turn's part is a prefix segment of its own, looked up under its prefix-chained
        key and loaded, or computed and stored (as the previous turn's request left it); the last
        part is computed, and stored too so that the next turn finds it. A single question is
        computed in one pass and stores nothing. Without the store, the same schedule computes
        every part (no reuse stays bit-identical to exact reuse).

        Args:
            cache: the request's cache, holding exactly ``prefix`` (and, ``attached``, the earlier turns).
            prefix: the segments before the question, in prompt order (their chain starts the turns').
            question: the question segment.
            use_store: look up and store (exact reuse); False computes the same schedule.
            salt: the request's cache salt.
            attached: the cache already holds the earlier turns (a hot prefix,
                :func:`blend.prefix_cache.attach_hot`, which reports them): only the last part is computed.

        Returns:
            First-token logits (V,) float32, one report row per part computed or loaded here, the
            seconds spent on the store.
        """
        parts = question.parts()
        if len(parts) == 1:
            logits, rows = self.compute_rest(cache, [question])
            return logits, rows, 0.0
        keys = self.exact_keys([*prefix, *parts], salt)[len(prefix):] if use_store else [None] * len(parts)
        rows, waited = [], 0.0
        if not attached:
            start = cache.length
            earlier = self.append_run(cache, parts[:-1], [(Namespace.EXACT, k) for k in keys[:-1]])
            for part, key, done in zip(parts[:-1], keys[:-1], earlier):
                rows.append(SegmentReport(part.kind, done.reuse_class, len(part), start, key_hex(key) if key else "",
                                          note=done.note))
                waited += done.lookup_s
                start += len(part)
        last, key = parts[-1], keys[-1]
        start = cache.length
        h, _ = self.model.prefill(cache, self.model.ids(last.token_ids), keep_kv=False)  # (S, C)
        if key is not None:  # the next turn's earlier part: what it computes from scratch, rounded as stored
            self.store.put(Namespace.EXACT, key, self._stored_form(cache.entry(start, cache.length)))
        rows.append(SegmentReport(last.kind, ReuseClass.COMPUTED, len(last), start, key_hex(key) if key else ""))
        return self.model.logits(h[-1:])[0], tuple(rows), waited

    def register_donor(self, preamble_ids: Sequence[int], doc_ids: Sequence[int], key: StoreKey | None = None,
                       salt: str = "") -> bool:
        """Offer a stored canonical chunk as a semantic donor (a no-op unless enabled).

        Returns:
            True if it was newly registered.
        """
        if salt:  # a salted chunk is never a donor: donors are shared across salts
            return False
        key = key if key is not None else self.canonical_key(preamble_ids, doc_ids)
        return self.donors.register(key, preamble_ids, doc_ids)

    def chunk_fits(self, preamble: Segment, ids: Sequence[int]) -> bool:
        """Whether a chunk of ``ids`` fits the model's context after ``preamble`` (one that does not gets no
        canonical KV: no prompt holding it could be answered)."""
        return len(preamble) + len(ids) <= self.model.dims.max_positions

    def precompute_chunks(self, texts: Sequence[str], preamble: Segment, salt: str = "") -> int:
        """Compute and store canonical chunk KV (each chunk alone after the preamble).

        Args:
            texts: chunk texts (as given to ``build_prompt``, or already laid out).
            preamble: the preamble segment.
            salt: the cache salt of the requests that will reuse them.

        Returns:
            Bytes of KV written (0 when everything was already stored). A chunk that does not fit the model's
            context after the preamble is skipped (no prompt holding it could be answered; logged).
        """
        written, too_long = 0, 0
        for text in texts:
            ids = document_ids(self.model.loaded.tokenizer, text)  # as build_prompt lays it out (idempotent)
            if not self.chunk_fits(preamble, ids):
                too_long += 1
                continue
            key = self.canonical_key(preamble.token_ids, ids, salt)
            self.register_donor(preamble.token_ids, ids, key, salt)
            if self.store.contains(Namespace.CANONICAL, key):
                continue
            with torch.inference_mode():
                kv = self.canonical_kv(preamble, ids, salt)
            entry = self._stored_form(kv)
            self.store.put(Namespace.CANONICAL, key, entry)  # the disk write overlaps the next chunk's compute
            written += entry.nbytes
        self.flush()
        if too_long:
            log.warning("%d chunk(s) longer than the model's context of %d tokens (after the preamble): no KV "
                        "precomputed for them", too_long, self.model.dims.max_positions)
        return written

