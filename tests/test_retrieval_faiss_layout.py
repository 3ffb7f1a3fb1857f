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
    if not again.faiss_loaded:
        assert again.search(q, 3)[1].tolist() == vi.search(q, 3)[1].tolist()
