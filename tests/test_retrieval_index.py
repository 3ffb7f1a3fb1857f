"""faiss index: exact equals numpy brute force (ties included); HNSW recall; persistence."""

from __future__ import annotations

import numpy as np
import pytest

from blend.retrieval.index import ApproxParams, IndexKind, VectorIndex, brute_force_search


def _unit(rng: np.random.Generator, n: int, d: int) -> np.ndarray:
    x = rng.standard_normal((n, d)).astype(np.float32)  # (n, d)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_exact_matches_numpy_brute_force() -> None:
    rng = np.random.default_rng(0)
    x, q = _unit(rng, 2000, 64), _unit(rng, 50, 64)  # (N, D), (Q, D)
    ids = rng.permutation(10_000)[:2000].astype(np.int64)  # (N,)
    vi = VectorIndex(64, IndexKind.EXACT)
    vi.add(ids, x)
    s, i = vi.search(q, 10)
    bs, bi = brute_force_search(x, ids, q, 10)
    np.testing.assert_array_equal(i, bi)
    np.testing.assert_allclose(s, bs, atol=1e-5)


def test_exact_ties_broken_by_id_like_numpy() -> None:
    # small-integer vectors: inner products are exact in float32, so ties are real ties
    rng = np.random.default_rng(1)
    base = rng.integers(-2, 3, size=(40, 8)).astype(np.float32)  # (40, D)
    x = np.concatenate([base] * 5)  # (200, D): every vector five times
    ids = rng.permutation(200).astype(np.int64) * 3 + 1  # (200,)
    q = rng.integers(-2, 3, size=(30, 8)).astype(np.float32)  # (Q, D)
    vi = VectorIndex(8, IndexKind.EXACT)
    vi.add(ids, x)
    for k in (1, 3, 7, 12, 50):
        s, i = vi.search(q, k)
        bs, bi = brute_force_search(x, ids, q, k)
        np.testing.assert_array_equal(i, bi)
        np.testing.assert_array_equal(s, bs)


def test_hnsw_recall_at_10() -> None:
    rng = np.random.default_rng(2)
    x, q = _unit(rng, 3000, 384), _unit(rng, 100, 384)
    ids = np.arange(3000, dtype=np.int64)
    vi = VectorIndex(384, IndexKind.HNSW)
    vi.add(ids, x)
    _, i = vi.search(q, 10)
    _, bi = brute_force_search(x, ids, q, 10)
    recall = np.mean([len(set(i[r]) & set(bi[r])) / 10 for r in range(len(q))])
    assert recall >= 0.95, recall


def test_auto_switches_to_approximate_above_threshold() -> None:
    rng = np.random.default_rng(3)
    vi = VectorIndex(16, IndexKind.AUTO, ApproxParams(threshold=100))
    vi.add(np.arange(50), _unit(rng, 50, 16))
    assert vi.resolved_kind() is IndexKind.EXACT
    vi.add(np.arange(50, 150), _unit(rng, 100, 16))
    assert vi.resolved_kind() is IndexKind.HNSW
    s, i = vi.search(_unit(rng, 2, 16), 5)
    assert i.shape == (2, 5) and (i >= 0).all()


@pytest.mark.parametrize("kind", [IndexKind.EXACT, IndexKind.HNSW, IndexKind.IVF])
def test_remove_then_search_never_returns_removed(kind: IndexKind) -> None:
    rng = np.random.default_rng(4)
    x = _unit(rng, 400, 32)
    vi = VectorIndex(32, kind)
    vi.add(np.arange(400), x)
    vi.search(x[:3], 5)  # build
    gone = np.arange(0, 400, 2)
    assert vi.remove(gone) == 200
    _, i = vi.search(x[:20], 10)
    assert not np.isin(i, gone).any()
    assert vi.ntotal == 200


@pytest.mark.parametrize("kind", [IndexKind.EXACT, IndexKind.HNSW, IndexKind.IVF])
def test_save_load_identical_results(kind: IndexKind, tmp_path) -> None:
    rng = np.random.default_rng(5)
    x, q = _unit(rng, 600, 32), _unit(rng, 20, 32)
    vi = VectorIndex(32, kind)
    vi.add(np.arange(600) + 1000, x)
    s1, i1 = vi.search(q, 10)
    vi.save(tmp_path)
    back = VectorIndex.load(tmp_path, 32, kind)
    assert back._faiss is not None  # the stored faiss file was used, not a rebuild
    s2, i2 = back.search(q, 10)
    np.testing.assert_array_equal(i1, i2)
    np.testing.assert_array_equal(s1, s2)
