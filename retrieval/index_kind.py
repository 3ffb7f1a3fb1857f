"""Which faiss structure backs a vector index (:class:`IndexKind`): apart from :mod:`blend.retrieval.index`, so
that ``kvblend ingest``'s parser names the choices without importing faiss."""

from __future__ import annotations

from enum import Enum


class IndexKind(Enum):
    """Which faiss structure backs the index."""

    AUTO = "auto"
    EXACT = "exact"
    HNSW = "hnsw"
    IVF = "ivf"
