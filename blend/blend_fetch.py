"""The fetch step of a blended prefill: every document's KV, the exact ones first.

Through the segment cache (:class:`~blend.segments.SegmentCache`, which owns the store,
the prefetcher and the donor index, and computes and stores what is missing):

    start_fetch       key every document and start its lookup in the background
    fetch_chunks      documents' canonical KV (hit, donor, or computed and stored),
                      as :class:`~blend.segment_values.ChunkKV`
    exact_run         the documents after the first whose exact-prefix KV a blend
                      finds stored (this order computed before by the exact path)
    fetch_documents   every document's KV for :func:`blend.blending.prefill_blend`,
                      the exact ones first
"""

from __future__ import annotations

import time
from typing import Sequence

from blend.keys import Namespace, key_hex
from blend.kvcache import KVEntry
from blend.policy import ReusePolicy
from blend.prompt import Prompt
from blend.report import ReuseClass
from blend.segment_values import ChunkKV, PendingChunk
from blend.segments import SegmentCache


def start_fetch(segments: SegmentCache, prompt: Prompt, salt: str = "") -> list[PendingChunk]:
    """Key every document (under the request's cache salt) and start its lookup in the
    background (overlapped loading).

    Args:
        segments: the engine's segment cache (its prefetcher runs the lookups).
        prompt: the request.
        salt: the request's cache salt.

    Returns:
        One :class:`PendingChunk` per document, in prompt order.
    """
    out = []
    for doc in prompt.documents:
        key = segments.canonical_key(prompt.preamble.token_ids, doc.token_ids, salt)
        fut = (segments.prefetcher.submit(Namespace.CANONICAL, key, segments.provenance_json)
               if segments.overlap_loading else None)
        out.append(PendingChunk(key, fut))
    return out


def fetch_chunks(segments: SegmentCache, prompt: Prompt, pending: Sequence[PendingChunk], semantic: bool,
                 salt: str = "", start: int = 0, computed: dict[bytes, tuple[int, KVEntry]] | None = None
                 ) -> tuple[list[ChunkKV], float]:
    """Canonical KV of documents: a hit is loaded; a miss or rejection is computed and stored.

    Args:
        segments: the engine's segment cache.
        prompt: the request.
        pending: :func:`start_fetch`'s result for documents ``start``, ``start + 1``, ...
        semantic: a miss may be seeded from a donor (experimental opt-in).
        salt: the request's cache salt (the keys in ``pending`` were derived under it).
        start: index of the first document fetched (document 0 is EXACT at its canonical position).
        computed: canonical KV this request computed before this call, by key: (document index, KV). A
            document of the same text takes it (not computed again); this call's computations are added.

    Returns:
        One :class:`ChunkKV` per document fetched, and the seconds spent on the store
        (lookups and the donor search).
    """
    out, waited = [], 0.0
    pre_ids = prompt.preamble.token_ids
    done = {} if computed is None else computed  # key -> (document, KV) computed by this request
    for i, (doc, p) in enumerate(zip(prompt.documents[start:], pending), start=start):
        first = done.get(bytes(p.key))
        if first is not None:  # the same text again: its canonical KV is the one just computed
            if p.future is not None:
                p.future.cancel()  # its lookup started before that KV was stored: not needed
            out.append(ChunkKV(first[1], ReuseClass.COMPUTED, key_hex(p.key),
                               f"the same text as document {first[0]}: computed once for both"))
            continue
        found = segments.lookup(Namespace.CANONICAL, p.key, len(doc), p.future)
        waited += found.seconds
        if found.entry is not None:
            segments.register_donor(pre_ids, doc.token_ids, p.key, salt)
            cls = ReuseClass.EXACT if i == 0 else ReuseClass.BLENDED
            out.append(ChunkKV(found.entry, cls, key_hex(p.key)))
            continue
        if not found.rejected and semantic:
            t0 = time.perf_counter()
            # a donor entry of another shape (a corrupt store) is dropped; the next donor is tried
            donated = segments.donors.donor_kv(pre_ids, doc.token_ids, p.key, segments.shape_problem)
            waited += time.perf_counter() - t0
            if donated is not None:
                out.append(ChunkKV(donated.kv, ReuseClass.SEMANTIC, key_hex(p.key), donated.note, donated.forced))
                continue
        kv = segments.compute_canonical(prompt.preamble, doc.token_ids, p.key, salt)
        done[bytes(p.key)] = (i, kv)
        if found.rejected:
            out.append(ChunkKV(kv, ReuseClass.REJECTED, key_hex(p.key), found.rejected + "; recomputed"))
        else:
            out.append(ChunkKV(kv, ReuseClass.COMPUTED, key_hex(p.key), "miss: computed canonically, then reused"))
    return out, waited


def exact_run(segments: SegmentCache, prompt: Prompt, salt: str = "") -> tuple[list[ChunkKV], float]:
    """The documents after the first whose exact KV is stored, in prompt order, up to the first miss.

    An exact-prefix entry's key commits to every token before it (preamble and earlier
    documents) and to the provenance, so a blend that finds one holds that document's
    exact KV at exactly this position: nothing to re-position or recompute. Such entries
    exist where this prompt's document order was computed before by the exact path (an
    exact request, ``precompute`` under an exact policy; a near-tie guard's recompute stores none).

    Args:
        segments: the engine's segment cache.
        prompt: the request (its first document must already be exact in the cache).
        salt: the request's cache salt.

    Returns:
        One EXACT :class:`ChunkKV` per document 2, 3, ... that hit, and the seconds spent on the store.
    """
    keys = segments.prefix_keys([prompt.preamble, *prompt.documents], salt)
    out, waited = [], 0.0
    for doc, (ns, key) in zip(prompt.documents[1:], keys[2:]):
        found = segments.lookup(ns, key, len(doc))
        waited += found.seconds
        if found.entry is None:  # a miss or an unusable entry ends the run: the rest is blended
            break
        out.append(ChunkKV(found.entry, ReuseClass.EXACT, key_hex(key), "exact prefix hit"))
    return out, waited


def fetch_documents(segments: SegmentCache, prompt: Prompt, pending: list[PendingChunk], policy: ReusePolicy
                    ) -> tuple[list[ChunkKV], int, float]:
    """Every document's KV, the exact ones first.

    Doc 1 sits at its canonical position: its own KV is exact there. With ``policy.take_exact``, so are
    the documents after it whose exact-prefix entries this order's exact path stored before (their keys
    commit to every token before them). The rest are canonical chunks, to re-position.

    Args:
        segments: the engine's segment cache.
        prompt: the request.
        pending: :func:`start_fetch`'s result for every document.
        policy: a blend policy (semantic reuse, ``take_exact``, the cache salt).

    Returns:
        One :class:`ChunkKV` per document, how many lead the prompt exactly, and the store seconds.
    """
    # canonical KV this request computes, by key: a later copy of the same text takes it
    computed: dict[bytes, tuple[int, KVEntry]] = {}
    chunks, waited = fetch_chunks(segments, prompt, pending[:1], policy.semantic, policy.cache_salt,
                                  computed=computed)
    n_exact = 1 if chunks and chunks[0].own_kv else 0
    if n_exact and policy.take_exact:  # opt-in: the answer then depends on what the store holds
        run, w = exact_run(segments, prompt, policy.cache_salt)
        chunks, n_exact, waited = chunks + run, n_exact + len(run), waited + w
        for p in pending[1:len(chunks)]:  # canonical lookups of documents the run took: not needed
            if p.future is not None:
                p.future.cancel()  # a lookup still queued never runs (one already running just finishes)
    rest, w = fetch_chunks(segments, prompt, pending[len(chunks):], policy.semantic, policy.cache_salt,
                           start=len(chunks), computed=computed)
    return chunks + rest, n_exact, waited + w
