"""The real MiniLM embedder: offline load, normalized, semantic, batch-invariant."""

from __future__ import annotations

import numpy as np
import pytest

from blend.retrieval.embedder import Embedder


@pytest.fixture(scope="module")
def emb() -> Embedder:
    return Embedder.load(batch_size=4)


def test_normalized_and_shaped(emb: Embedder) -> None:
    v = emb.embed(["hello world", "a much longer sentence about faiss indexes and caches"])  # (2, 384)
    assert v.shape == (2, 384) and v.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)


def test_similar_sentences_closer_than_unrelated(emb: Embedder) -> None:
    a, b, c = emb.embed([
        "The cat sat on the mat.",
        "A cat was sitting on a rug.",
        "Quarterly revenue grew by eight percent in Europe.",
    ])
    assert float(a @ b) > float(a @ c) + 0.2


def test_batched_equals_unbatched(emb: Embedder) -> None:
    texts = [f"sentence number {i} " + "padding words " * (i % 7) for i in range(11)]
    batched = emb.embed(texts, batch_size=5)  # (11, D)
    single = np.stack([emb.embed([t], batch_size=1)[0] for t in texts])  # (11, D)
    np.testing.assert_allclose(batched, single, atol=1e-5)


def test_info_identifies_model(emb: Embedder) -> None:
    assert emb.info.name == "all-MiniLM-L6-v2" and emb.info.dim == 384 and len(emb.info.fingerprint) == 64
