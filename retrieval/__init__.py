"""Retrieval for kvblend: chunk, embed, index a corpus; ask over it with KV reuse.

Three lines for a pipeline::

    from blend.retrieval import RAG
    rag = RAG.open("my-index")                      # written by `kvblend ingest`
    ans = rag.ask("Who keeps the lighthouse?", top_k=3)   # ans.answer, ans.retrieved, ans.reuse

Names are imported lazily so ``import blend.retrieval`` stays cheap and never
imports the engine.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "RAG": "pipeline", "RagAnswer": "pipeline", "Retrieved": "pipeline", "ChunkReuse": "pipeline",
    "ingest": "ingest",
    "IngestSummary": "ingest_options", "IngestOptions": "ingest_options", "KVSync": "ingest_options",
    "ChunkerConfig": "chunker", "chunk_text": "chunker",
    "Embedder": "embedder",
    "Catalog": "catalog", "IndexKind": "index_kind", "VectorIndex": "index",
    "CorpusIssue": "corpus", "RetrievalError": "corpus",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"blend.retrieval.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'blend.retrieval' has no attribute {name!r}")
