"""A saved faiss index is walked before faiss reads it (blend.retrieval.faiss_layout).

faiss sizes what a file claims before reading it (an IVF index every list at once), so a crafted
``faiss.index`` under a matching digest made the process allocate gigabytes before faiss refused
it. Every claim must now fit the file; anything else is rebuilt from the vectors.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blend.retrieval import index as index_mod
from blend.retrieval.faiss_layout import LayoutError, check_layout
from blend.retrieval.index import IndexKind, VectorIndex

DIM = 8
KINDS = [(IndexKind.EXACT, 0), (IndexKind.EXACT, 30), (IndexKind.HNSW, 0), (IndexKind.HNSW, 60),
         (IndexKind.IVF, 80), (IndexKind.IVF, 400)]


def saved(folder: Path, kind: IndexKind, n: int, remove: int = 0) -> VectorIndex:
    rng = np.random.default_rng(n)
    vi = VectorIndex(DIM, kind)
    if n:
        vi.add(np.arange(n, dtype=np.int64) * 7 + 1, rng.standard_normal((n, DIM)).astype(np.float32))
        vi.search(np.ones((1, DIM), np.float32), 1)  # built, so a removal edits the faiss index in place
    if remove:
        vi.remove(np.arange(remove, dtype=np.int64) * 7 + 1)
    vi.save(folder)
    return vi


def rewrite(folder: Path, data: bytes) -> None:
    """Write faiss bytes with a matching digest, as whoever writes the folder can."""
    kind = (folder / "faiss.kind").read_text().split()[0]
    (folder / "faiss.index").write_bytes(data)
    (folder / "faiss.kind").write_text(f"{kind} {hashlib.sha256(data).hexdigest()}")


@pytest.mark.parametrize("kind,n", KINDS)
def test_every_layout_the_index_writes_is_accepted_and_used(tmp_path: Path, kind: IndexKind, n: int) -> None:
    vi = saved(tmp_path, kind, n, remove=5 if kind is IndexKind.IVF else 0)
    check_layout((tmp_path / "faiss.index").read_bytes(), vi.resolved_kind().value, DIM)
    assert VectorIndex.load(tmp_path, DIM, kind).faiss_loaded


def _ivf_sizes_offset(data: bytes) -> tuple[int, int]:
    """Where an IVF file's "full" list sizes start, and how many lists it has."""
    at = data.index(b"ilar")  # then nlist, code_size (uint64 each), b"full", the sizes' count, the sizes
    assert data[at + 20:at + 24] == b"full"
    nlist = struct.unpack_from("<Q", data, at + 4)[0]
    return at + 32, nlist


def test_a_crafted_ivf_list_size_never_reaches_faiss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One list claiming 2^34 entries: faiss would size it (~600 GB of codes and ids) before reading."""
    vi = saved(tmp_path, IndexKind.IVF, 400)
    data = bytearray((tmp_path / "faiss.index").read_bytes())
    first, _ = _ivf_sizes_offset(bytes(data))
    struct.pack_into("<Q", data, first, 1 << 34)
    rewrite(tmp_path, bytes(data))
    with pytest.raises(LayoutError):
        check_layout(bytes(data), "ivf", DIM)
    calls = []
    real = index_mod.faiss.deserialize_index
    monkeypatch.setattr(index_mod.faiss, "deserialize_index", lambda b: calls.append(1) or real(b))
    again = VectorIndex.load(tmp_path, DIM, IndexKind.IVF)
    assert calls == [] and not again.faiss_loaded
    q = np.ones((1, DIM), np.float32)
    assert again.search(q, 5)[1].tolist() == vi.search(q, 5)[1].tolist()  # rebuilt from the vectors


def test_a_crafted_list_count_and_trailing_bytes_are_refused(tmp_path: Path) -> None:
    saved(tmp_path, IndexKind.IVF, 400)
    data = (tmp_path / "faiss.index").read_bytes()
    at = data.index(b"ilar")
    bad = bytearray(data)
    struct.pack_into("<Q", bad, at + 4, 1 << 40)  # nlist: faiss sizes that many lists first
    for crafted in (bytes(bad), data + b"\0", data[:-1]):
        with pytest.raises(LayoutError):
            check_layout(crafted, "ivf", DIM)


@pytest.mark.parametrize("kind,n", [(IndexKind.EXACT, 30), (IndexKind.HNSW, 60), (IndexKind.IVF, 400)])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_overwritten_field_is_refused_or_loads_an_index_that_searches_as_the_vectors_say(
        tmp_path_factory: pytest.TempPathFactory, kind: IndexKind, n: int, data: st.DataObject) -> None:
    folder = tmp_path_factory.mktemp("fz")
    vi = saved(folder, kind, n)
    raw = bytearray((folder / "faiss.index").read_bytes())
    at = data.draw(st.integers(0, len(raw) - 8))
    value = data.draw(st.sampled_from([0, 1, 255, 1 << 31, 1 << 34, 1 << 40, 1 << 63, (1 << 64) - 1]))
    struct.pack_into("<Q", raw, at, value)
    try:
        check_layout(bytes(raw), vi.resolved_kind().value, DIM)
    except LayoutError:
        pass  # the only error the walker raises
    rewrite(folder, bytes(raw))
    again = VectorIndex.load(folder, DIM, kind)  # never raises: a refused file is rebuilt
    q = np.ones((1, DIM), np.float32)
    if not again.faiss_loaded or kind is IndexKind.EXACT:
        assert again.search(q, 3)[1].tolist() == vi.search(q, 3)[1].tolist()
    else:  # a kept HNSW graph or IVF centroid table decides which rows a search visits, never what they hold
        assert set(again.search(q, 3)[1].flatten().tolist()) <= set(vi.ids.tolist())


# ---- crafted files whose sizes fit but whose structure faiss would read out of bounds, or whose
# contents are not the index's own (a writer of faiss 1.15's layouts, field by field)

def _header(d, ntotal, trained=True):
    return struct.pack("<iqqq?i", d, ntotal, 1 << 20, 1 << 20, trained, 0)


def _vec(fmt, items):
    items = list(items)
    return struct.pack("<Q", len(items)) + struct.pack(f"<{len(items)}{fmt}", *items)


def _flat(vectors: np.ndarray) -> bytes:
    return b"IxFI" + _header(DIM, len(vectors)) + _vec("f", vectors.reshape(-1).tolist())


def _idmap2(n, inner, ids) -> bytes:
    return b"IxM2" + _header(DIM, n) + inner + _vec("q", ids)


def _hnsw(vi, probas, cum, levels, max_level, entry, efc=40) -> bytes:
    n = len(vi.ids)
    offsets = np.concatenate([[0], np.cumsum([cum[lv] for lv in levels])]).astype(int).tolist()
    neighbors = [(i + 1) % n for i in range(offsets[-1])]
    graph = (b"IHNf" + _header(DIM, n) + _vec("d", probas) + _vec("i", cum) + _vec("i", levels) + _vec("Q", offsets)
             + _vec("i", neighbors) + struct.pack("<5i", entry, max_level, efc, 16, 0) + _flat(vi.vectors))
    return _idmap2(n, graph, vi.ids.tolist())


HNSW_CRAFTS = {
    # faiss accepts max_level < len(cum); its search reads cum[max_level + 1], one past the end (SIGSEGV)
    "max level at the table's end": lambda vi: _hnsw(vi, [1.0], [0] + [4] * 7, [7] * len(vi.ids), 7, 0),
    # 101 level probabilities for a 2-entry table: the next add draws a level past it (SIGSEGV)
    "probabilities past the table": lambda vi: _hnsw(vi, [0.0] * 100 + [1.0], [0, 4], [1] * len(vi.ids), 0, 0),
    "entry point below the top": lambda vi: _hnsw(vi, [0.5, 0.5], [0, 4, 6], [2] + [1] * (len(vi.ids) - 1), 1, 3),
    "a beam of 2^30 per add": lambda vi: _hnsw(vi, [1.0], [0, 4], [1] * len(vi.ids), 0, 0, efc=1 << 30),
}


@pytest.mark.parametrize("craft", sorted(HNSW_CRAFTS))
def test_an_hnsw_graph_faiss_would_read_out_of_bounds_is_refused(tmp_path: Path, craft: str) -> None:
    vi = saved(tmp_path, IndexKind.HNSW, 60)
    data = HNSW_CRAFTS[craft](vi)
    with pytest.raises(LayoutError):
        check_layout(data, "hnsw", DIM)
    rewrite(tmp_path, data)
    again = VectorIndex.load(tmp_path, DIM, IndexKind.HNSW)
    assert not again.faiss_loaded


def test_a_well_formed_crafted_hnsw_graph_is_accepted(tmp_path: Path) -> None:
    """The writer above is faithful: a legal graph it writes passes and loads (so the refusals are the checks')."""
    vi = saved(tmp_path, IndexKind.HNSW, 60)
    data = _hnsw(vi, [1.0], [0, 4], [1] * 60, 0, 0)
    check_layout(data, "hnsw", DIM)
    rewrite(tmp_path, data)
    assert VectorIndex.load(tmp_path, DIM, IndexKind.HNSW).faiss_loaded


def _ivf(n, nlist, centroids, lists, sizes=None, sparse=None, trained=True, dm=0) -> bytes:
    out = (b"IwFl" + _header(DIM, n, trained) + struct.pack("<QQ", nlist, 1) + _flat(centroids)
           + struct.pack("<b", dm) + _vec("q", []) + b"ilar" + struct.pack("<QQ", nlist, 4 * DIM))
    sizes = sizes if sizes is not None else [len(ids) for ids, _ in lists] + [0] * (nlist - len(lists))
    out += b"full" + _vec("Q", sizes) if sparse is None else b"sprs" + _vec("Q", sparse)
    for ids, vecs in lists:
        out += vecs.astype("<f4").tobytes() + np.asarray(ids, "<i8").tobytes()
    return out


def test_crafted_inverted_lists_are_refused(tmp_path: Path) -> None:
    vi = saved(tmp_path, IndexKind.IVF, 400)
    ids, vecs = vi.ids, vi.vectors
    good = _ivf(400, 2, vecs[:2], [(ids, vecs)])
    check_layout(good, "ivf", DIM)
    many = 2_000_000  # one byte of sparse table per claimed list: faiss sized them all (~136 bytes each)
    crafts = {
        "lists without centroids": _ivf(400, many, vecs[:1], [(ids, vecs)], sparse=[0, 400] * (many // 16)),
        "more centroids than lists": _ivf(400, 2, vecs[:10], [(ids, vecs)]),
        "untrained": _ivf(400, 2, vecs[:2], [(ids, vecs)], trained=False),
        "a direct map": _ivf(400, 2, vecs[:2], [(ids, vecs)], dm=1),
        "lists short of the count": _ivf(400, 2, vecs[:2], [(ids[:10], vecs[:10])]),
    }
    for name, data in crafts.items():
        with pytest.raises(LayoutError):
            check_layout(data, "ivf", DIM)


@pytest.mark.parametrize("kind", [IndexKind.EXACT, IndexKind.HNSW, IndexKind.IVF])
def test_a_file_holding_other_ids_or_vectors_than_the_index_is_rebuilt(tmp_path: Path, kind: IndexKind) -> None:
    """ids rotated by one (the same set) or vectors negated searched differently from the vectors beside
    them; the file's contents must be the index's own."""
    n = 400 if kind is IndexKind.IVF else 30
    vi = saved(tmp_path, kind, n)
    q = np.ones((2, DIM), np.float32)
    for ids, vecs in ((np.roll(vi.ids, 1), vi.vectors), (vi.ids, -vi.vectors)):
        if kind is IndexKind.IVF:
            data = _ivf(n, 2, vi.vectors[:2], [(ids, vecs)])
        elif kind is IndexKind.EXACT:
            data = _idmap2(n, _flat(vecs), ids.tolist())
        else:
            graph = _hnsw(vi, [1.0], [0, 4], [1] * n, 0, 0)
            data = graph.replace(_flat(vi.vectors), _flat(vecs)).replace(_vec("q", vi.ids.tolist()), _vec("q", ids))
        check_layout(data, vi.resolved_kind().value, DIM)  # well-formed ...
        rewrite(tmp_path, data)
        again = VectorIndex.load(tmp_path, DIM, kind)
        assert not again.faiss_loaded  # ... but not this index's: rebuilt
        assert again.search(q, 5)[1].tolist() == vi.search(q, 5)[1].tolist()
