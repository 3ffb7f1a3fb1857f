"""A faiss vector index over int64 ids: exact inner product or approximate.

``EXACT`` is ``IndexIDMap2(IndexFlatIP)``; ``HNSW`` is an inner-product HNSW
graph; ``IVF`` an inverted file with a flat inner-product quantizer. ``AUTO``
resolves to exact below ``threshold`` vectors and HNSW at or above it.

The index keeps its own copy of ids and vectors, so it can always be rebuilt
(HNSW cannot remove ids in place; IVF needs training data; AUTO switches
kind as it grows). On disk the ``.npy`` files are read only after their header's
shape and dtype were checked against the file's size, the expected dtype and a
cap (``npy_file.py``); the faiss file is handed to faiss only if its sha256 equals the one saved
beside it (faiss's reader is not written for hostile bytes), else it is rebuilt. Search order is deterministic: score descending, then id
ascending; a tie at the k-th place is resolved by fetching more candidates
until the boundary score is strictly passed.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np

from blend import safeio
from blend.defaults import DEFAULT_APPROX_THRESHOLD
from blend.retrieval.corpus import RetrievalError
from blend.retrieval.faiss_layout import Layout, LayoutError, check_layout
from blend.retrieval.index_kind import IndexKind
from blend.retrieval.npy_file import load_npy

MAX_INDEX_FILE_BYTES = 8 << 30  # the largest index file read (vectors of ~5M chunks at dim 384)
MAX_DIM = 1 << 16  # the largest embedding dimension an index may claim


@dataclass(frozen=True)
class ApproxParams:
    """Parameters of the approximate indexes.

    Attributes:
        threshold: AUTO switches from exact to HNSW at this many vectors.
        hnsw_m: HNSW graph degree.
        ef_construction: HNSW build-time beam.
        ef_search: HNSW search-time beam (raised to k if smaller).
        ivf_lists_per_sqrt: IVF lists = this * sqrt(N) (at most N / 39).
        ivf_nprobe_frac: fraction of IVF lists probed per query.
    """

    threshold: int = DEFAULT_APPROX_THRESHOLD
    hnsw_m: int = 32
    ef_construction: int = 200
    ef_search: int = 128
    ivf_lists_per_sqrt: float = 1.0
    ivf_nprobe_frac: float = 0.5


def brute_force_search(vectors: np.ndarray, ids: np.ndarray, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Reference top-k by inner product in numpy (score desc, then id asc).

    Args:
        vectors: (N, D) float32.
        ids: (N,) int64.
        queries: (Q, D) float32.
        k: neighbours per query.

    Returns:
        (scores (Q, k') float32, ids (Q, k') int64), k' = min(k, N).
    """
    scores = queries.astype(np.float32) @ vectors.astype(np.float32).T  # (Q, N)
    k = min(k, len(ids))
    out_s = np.zeros((len(queries), k), dtype=np.float32)  # (Q, k)
    out_i = np.zeros((len(queries), k), dtype=np.int64)  # (Q, k)
    for q in range(len(queries)):
        order = np.lexsort((ids, -scores[q]))[:k]  # primary: -score, secondary: id
        out_s[q], out_i[q] = scores[q, order], ids[order]
    return out_s, out_i


class VectorIndex:
    """Inner-product index over (id, vector) pairs with add, remove, search, save, load.

    Args:
        dim: vector dimension.
        kind: requested kind (AUTO resolves by size).
        params: approximate-index parameters.
    """

    def __init__(self, dim: int, kind: IndexKind = IndexKind.AUTO, params: ApproxParams = ApproxParams()) -> None:
        self.dim = dim
        self.kind = kind
        self.params = params
        self._ids = np.zeros((0,), dtype=np.int64)  # (N,)
        self._vecs = np.zeros((0, dim), dtype=np.float32)  # (N, D)
        self._faiss: faiss.Index | None = None
        self._built_kind: IndexKind | None = None
        self._loaded_faiss = False  # load() used the saved faiss file (it was not rebuilt)

    @property
    def faiss_loaded(self) -> bool:
        """Whether :meth:`load` used the saved faiss file (False: it was missing, damaged or stale)."""
        return self._loaded_faiss

    @property
    def ntotal(self) -> int:
        return int(len(self._ids))

    @property
    def ids(self) -> np.ndarray:
        return self._ids

    @property
    def vectors(self) -> np.ndarray:
        return self._vecs

    def resolved_kind(self, n: int | None = None) -> IndexKind:
        """The concrete kind for ``n`` vectors (default: the current count)."""
        n = self.ntotal if n is None else n
        if self.kind is IndexKind.AUTO:
            return IndexKind.HNSW if n >= self.params.threshold else IndexKind.EXACT
        if self.kind is IndexKind.IVF and n < 39:
            return IndexKind.EXACT  # too few vectors to train lists
        return self.kind

    def add(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        """Add vectors under new ids.

        Args:
            ids: (M,) int64, not already present.
            vectors: (M, D) float32.
        """
        ids = np.ascontiguousarray(ids, dtype=np.int64)  # (M,)
        vectors = np.ascontiguousarray(vectors, dtype=np.float32).reshape(-1, self.dim)  # (M, D)
        if len(ids) != len(vectors):
            raise ValueError(f"{len(ids)} ids for {len(vectors)} vectors")
        if len(ids) == 0:
            return
        self._ids = np.concatenate([self._ids, ids])  # (N+M,)
        self._vecs = np.concatenate([self._vecs, vectors])  # (N+M, D)
        if self._faiss is not None and self._built_kind is self.resolved_kind():
            self._faiss.add_with_ids(vectors, ids)
        else:
            self._faiss = None  # rebuilt lazily at the next search

    def remove(self, ids: np.ndarray) -> int:
        """Remove ids (unknown ids are ignored).

        Args:
            ids: (M,) int64.

        Returns:
            Number of vectors removed.
        """
        ids = np.asarray(ids, dtype=np.int64)  # (M,)
        keep = ~np.isin(self._ids, ids)  # (N,)
        removed = int((~keep).sum())
        if removed == 0:
            return 0
        self._ids, self._vecs = self._ids[keep], self._vecs[keep]
        if self._faiss is not None and self._built_kind in (IndexKind.EXACT, IndexKind.IVF) and self._built_kind is self.resolved_kind():
            self._faiss.remove_ids(ids)
        else:
            self._faiss = None
        return removed

    def _build(self) -> faiss.Index:
        kind = self.resolved_kind()
        n, p = self.ntotal, self.params
        if kind is IndexKind.EXACT:
            index = faiss.IndexIDMap2(faiss.IndexFlatIP(self.dim))
        elif kind is IndexKind.HNSW:
            inner = faiss.IndexHNSWFlat(self.dim, p.hnsw_m, faiss.METRIC_INNER_PRODUCT)
            inner.hnsw.efConstruction = p.ef_construction
            index = faiss.IndexIDMap2(inner)
        else:
            nlist = int(max(1, min(p.ivf_lists_per_sqrt * np.sqrt(n), n // 39)))
            quantizer = faiss.IndexFlatIP(self.dim)
            index = faiss.IndexIVFFlat(quantizer, self.dim, nlist, faiss.METRIC_INNER_PRODUCT)
            index.train(self._vecs)
        if n:
            index.add_with_ids(self._vecs, self._ids)
        self._faiss, self._built_kind = index, kind
        return index

    def _configure(self, index: faiss.Index, k: int) -> None:
        if self._built_kind is IndexKind.HNSW:
            faiss.downcast_index(index.index).hnsw.efSearch = max(self.params.ef_search, k)
        elif self._built_kind is IndexKind.IVF:
            ivf = faiss.extract_index_ivf(index)
            ivf.nprobe = max(1, int(round(ivf.nlist * self.params.ivf_nprobe_frac)))

    def search_candidates(self, queries: np.ndarray, k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """The top-k candidates per query plus every vector tied with the k-th score.

        Args:
            queries: (Q, D) float32.
            k: neighbours wanted.

        Returns:
            Per query (scores (C,) float32, ids (C,) int64), unsorted, C >= min(k, N)
            for the exact index (an approximate one may return fewer).
        """
        queries = np.ascontiguousarray(queries, dtype=np.float32).reshape(-1, self.dim)  # (Q, D)
        k = min(k, self.ntotal)
        if k <= 0:
            return [(np.zeros(0, np.float32), np.zeros(0, np.int64)) for _ in range(len(queries))]
        index = self._faiss if self._faiss is not None else self._build()
        kk = min(self.ntotal, k + 8)
        while True:
            self._configure(index, kk)
            dist, lab = index.search(queries, kk)  # (Q, kk), (Q, kk)
            valid = lab >= 0  # (Q, kk)
            kth = np.where(valid[:, k - 1], dist[:, k - 1], -np.inf)  # (Q,)
            last = np.where(valid[:, -1], dist[:, -1], -np.inf)  # (Q,)
            if kk >= self.ntotal or not np.any((last >= kth) & valid[:, -1]):
                break
            kk = min(self.ntotal, kk * 2)
        out = []
        for q in range(len(queries)):
            keep = valid[q] & ((dist[q] >= kth[q]) | (np.arange(kk) < k))  # (kk,)
            out.append((dist[q][keep], lab[q][keep]))
        return out

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-k ids by inner product, ties broken by id.

        Args:
            queries: (Q, D) float32.
            k: neighbours wanted.

        Returns:
            (scores (Q, k') float32, ids (Q, k') int64), k' = min(k, N); rows an
            approximate index could not fill are padded with (-inf, -1).
        """
        cands = self.search_candidates(queries, k)
        k = min(k, self.ntotal)
        out_s = np.full((len(cands), k), -np.inf, dtype=np.float32)  # (Q, k)
        out_i = np.full((len(cands), k), -1, dtype=np.int64)  # (Q, k)
        for q, (s, i) in enumerate(cands):
            order = np.lexsort((i, -s))[:k]  # primary: -score, secondary: id
            out_s[q, : len(order)], out_i[q, : len(order)] = s[order], i[order]
        return out_s, out_i

    def save(self, folder: str | os.PathLike[str]) -> None:
        """Write ids, vectors and the faiss index into ``folder`` (which must exist)."""
        d = Path(folder)
        np.save(d / "ids.npy", self._ids)
        np.save(d / "vectors.npy", self._vecs)
        index = self._faiss if self._faiss is not None else self._build()
        data = faiss.serialize_index(index).tobytes()
        (d / "faiss.index").write_bytes(data)
        kind = self._built_kind.value if self._built_kind else ""
        (d / "faiss.kind").write_text(f"{kind} {hashlib.sha256(data).hexdigest()}")

    @classmethod
    def load(cls, folder: str | os.PathLike[str], dim: int, kind: IndexKind, params: ApproxParams = ApproxParams()) -> "VectorIndex":
        """Read what :meth:`save` wrote; the faiss file is rebuilt if missing or inconsistent.

        Args:
            folder: the folder given to :meth:`save`.
            dim: vector dimension.
            kind: requested kind.
            params: approximate-index parameters.

        Returns:
            The index, searching exactly as it did when saved.

        Raises:
            RetrievalError: ids.npy or vectors.npy missing, irregular, damaged, of
                another dtype or shape, or disagreeing (the file is named).
        """
        d = Path(folder)
        self = cls(dim, kind, params)
        self._ids = load_npy(d / "ids.npy", np.dtype("<i8"), (None,), MAX_INDEX_FILE_BYTES)  # (N,)
        self._vecs = load_npy(d / "vectors.npy", np.dtype("<f4"), (None, dim), MAX_INDEX_FILE_BYTES)  # (N, D)
        if len(self._vecs) != len(self._ids) or len(np.unique(self._ids)) != len(self._ids):
            raise RetrievalError(f"{d / 'ids.npy'}: {len(self._ids)} ids (unique: {len(np.unique(self._ids))}) "
                                 f"for {len(self._vecs)} vectors")
        self._faiss = self._load_faiss(d, dim)
        self._loaded_faiss = self._faiss is not None
        return self

    def _load_faiss(self, d: Path, dim: int) -> faiss.Index | None:
        """The saved faiss index if its digest, size and kind match; None (rebuild) otherwise."""
        try:
            kind_text, _, digest = safeio.read_regular(d / "faiss.kind", 1024).decode("ascii").partition(" ")
            built = IndexKind(kind_text.strip())
            data = safeio.read_regular(d / "faiss.index", MAX_INDEX_FILE_BYTES)
        except (OSError, ValueError):  # absent, irregular, oversized, not ASCII, unknown kind
            return None
        if built is not self.resolved_kind() or hashlib.sha256(data).hexdigest() != digest.strip():
            return None  # damaged, or saved by a build that wrote no digest: never parsed
        try:
            layout = check_layout(data, built.value, dim)  # every claim fits the file, before faiss allocates any
            if not self._holds(layout):  # the ids and vectors the file's index searches must be the index's own
                return None
            index = faiss.deserialize_index(np.frombuffer(data, dtype=np.uint8))
            if not _is_kind(index, built):  # another index type under this kind's name: rebuilt
                return None
        except (LayoutError, RuntimeError, MemoryError, AttributeError):  # another layout; faiss's refusals
            return None
        if index.ntotal != self.ntotal or index.d != dim:
            return None
        self._built_kind = built
        return index


    def _holds(self, layout: Layout) -> bool:
        """Whether a walked faiss file holds exactly this index's ids and vectors (bit for bit; an inverted
        file's lists in any order), so that it searches as one rebuilt from them would (an HNSW graph
        aside: it only decides which of them a search visits)."""
        if len(layout.ids) != len(self._ids):
            return False
        mine, theirs = np.argsort(self._ids, kind="stable"), np.argsort(layout.ids, kind="stable")
        return bool(np.array_equal(layout.ids[theirs], self._ids[mine])
                    and np.array_equal(layout.vectors[theirs].view(np.uint32), self._vecs[mine].view(np.uint32)))


def _is_kind(index: faiss.Index, kind: IndexKind) -> bool:
    """Whether a deserialized index is what :meth:`VectorIndex._build` makes for ``kind`` (inner product)."""
    index = faiss.downcast_index(index)
    if index.metric_type != faiss.METRIC_INNER_PRODUCT:
        return False
    if kind is IndexKind.IVF:
        return isinstance(index, faiss.IndexIVFFlat)
    if not isinstance(index, faiss.IndexIDMap2):
        return False
    inner = faiss.downcast_index(index.index)
    return isinstance(inner, faiss.IndexHNSWFlat if kind is IndexKind.HNSW else faiss.IndexFlatIP)

