"""A saved faiss index's bytes walked before faiss reads them: every size claim must fit the file.

faiss's reader allocates what a size field claims before it reads the data (an inverted-list index
sizes all of its lists first), bounded only by 2^40 elements per vector. A crafted ``faiss.index``
under a matching digest (whoever writes the folder writes both) could so make the process allocate,
and zero, gigabytes before faiss notices the file is short. This walks the three layouts
:class:`~blend.retrieval.index.VectorIndex` writes (an id map over a flat or HNSW index, and a flat
inverted-file index over a flat quantizer), field by field as faiss reads them, and accepts the bytes
only if every vector fits in what is left of the file and the file ends where the layout does. Any
other layout, including one a future faiss writes differently, is refused: the index is then rebuilt
from its vectors, slower but never unsafe.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

FLAT_IP, ID_MAP2, HNSW_FLAT, IVF_FLAT = b"IxFI", b"IxM2", b"IHNf", b"IwFl"
INNER_PRODUCT = 0  # faiss.METRIC_INNER_PRODUCT
_HEADER = struct.Struct("<iqqq?i")  # d, ntotal, two unused int64s, is_trained, metric_type
NO_DIRECT_MAP = 0  # faiss DirectMap::NoMap: VectorIndex never maintains a direct map


MAX_EF = 1 << 16  # an HNSW build beam past this is no index VectorIndex writes (a crafted one would cost every add)


class LayoutError(ValueError):
    """The bytes are not a layout this module accepts (the caller rebuilds the index)."""


@dataclass(frozen=True)
class Layout:
    """What a walked file holds, for comparing with the index's own ids and vectors."""

    ids: np.ndarray  # (N,) int64 in the file's order
    vectors: np.ndarray  # (N, D) float32, row i is ids[i]'s


class _Reader:
    """A cursor over the file that refuses any claim past its end."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = memoryview(data), 0

    def take(self, n: int) -> memoryview:
        if n < 0 or n > len(self.data) - self.pos:
            raise LayoutError(f"a field of {n} bytes at offset {self.pos} runs past the end ({len(self.data)} bytes)")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> tuple:
        s = struct.Struct("<" + fmt)
        return s.unpack(self.take(s.size))

    def vector(self, item: int) -> int:
        """A faiss vector (uint64 count, then count items of ``item`` bytes): its count."""
        return len(self.array(np.dtype(f"V{item}")))

    def array(self, dtype: np.dtype) -> np.ndarray:
        """A faiss vector read as a numpy array of ``dtype`` (little-endian), after its count was checked."""
        dtype = np.dtype(dtype)
        (count,) = self.unpack("Q")
        if count > (len(self.data) - self.pos) // dtype.itemsize:
            raise LayoutError(f"a vector of {count} x {dtype.itemsize} bytes at offset {self.pos} does not fit the file")
        return np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype)

    def fourcc(self, *want: bytes) -> bytes:
        got = bytes(self.take(4))
        if got not in want:
            raise LayoutError(f"{got!r} at offset {self.pos - 4}, expected one of {want}")
        return got


def check_layout(data: bytes, kind: str, dim: int) -> Layout:
    """Accept ``data`` only as the layout :class:`VectorIndex` writes for ``kind``.

    Args:
        data: the whole ``faiss.index`` file.
        kind: "exact", "hnsw" or "ivf" (an :class:`IndexKind` value).
        dim: the vectors' dimension.

    Returns:
        The ids and vectors the file holds (the caller compares them with its own).

    Raises:
        LayoutError: another layout, a claim past the end, a graph or list structure faiss would
            read out of bounds, or bytes after the index.
    """
    r = _Reader(data)
    if kind in ("exact", "hnsw"):
        r.fourcc(ID_MAP2)
        n = _header(r, dim)
        vectors = _flat(r, dim) if kind == "exact" else _hnsw_flat(r, dim)
        ids = r.array(np.dtype("<i8"))  # the id map
        if not len(ids) == len(vectors) == n:
            raise LayoutError(f"{n} vectors in the header, {len(vectors)} stored, {len(ids)} ids")
        out = Layout(ids, vectors)
    elif kind == "ivf":
        out = _ivf_flat(r, dim)
    else:
        raise LayoutError(f"no layout for index kind {kind!r}")
    if r.pos != len(data):
        raise LayoutError(f"{len(data) - r.pos} bytes after the index")
    return out


def _header(r: _Reader, dim: int) -> int:
    """A trained inner-product index header of dimension ``dim``; returns its ntotal."""
    d, ntotal, _, _, is_trained, metric = _HEADER.unpack(r.take(_HEADER.size))
    if d != dim or metric != INNER_PRODUCT or ntotal < 0 or not is_trained:
        raise LayoutError(f"header d={d} ntotal={ntotal} trained={is_trained} metric={metric} "
                          f"(expected d={dim}, trained, inner product)")
    return ntotal


def _flat(r: _Reader, dim: int) -> np.ndarray:
    """IndexFlatIP: its codes are ntotal x d floats. Returns them (ntotal, d)."""
    r.fourcc(FLAT_IP)
    ntotal = _header(r, dim)
    codes = r.array(np.dtype("<f4"))
    if len(codes) != ntotal * dim:
        raise LayoutError("a flat index's vectors disagree with its count")
    return codes.reshape(ntotal, dim)


def _hnsw_flat(r: _Reader, dim: int) -> np.ndarray:
    """IndexHNSWFlat: the header, the graph, then its flat storage (returned). The graph's values are
    checked as faiss's search and add read them: levels within the per-level neighbour table, each node's
    neighbour span where its level says, neighbours naming nodes, the entry point at the top level."""
    r.fourcc(HNSW_FLAT)
    n = _header(r, dim)
    probas = r.array(np.dtype("<f8"))
    cum = r.array(np.dtype("<i4")).astype(np.int64)
    levels = r.array(np.dtype("<i4")).astype(np.int64)
    offsets = r.array(np.dtype("<u8"))
    neighbors = r.array(np.dtype("<i4"))
    entry, max_level, ef_construction, ef_search, _ = r.unpack("5i")
    storage = _flat(r, dim)
    _check_graph(n, probas, cum, levels, offsets, neighbors, entry, max_level)
    # efSearch is set before every search (VectorIndex._configure), efConstruction is read by every add
    if not (1 <= ef_construction <= MAX_EF and ef_search >= 1) or len(storage) != n:
        raise LayoutError(f"HNSW beams {ef_construction}/{ef_search}, {len(storage)} stored vectors for {n}")
    return storage


def _check_graph(n: int, probas: np.ndarray, cum: np.ndarray, levels: np.ndarray, offsets: np.ndarray,
                 neighbors: np.ndarray, entry: int, max_level: int) -> None:
    """An HNSW graph whose every read stays in bounds (else LayoutError)."""
    top = len(cum) - 1  # levels a node may have (faiss: cum has one entry per level and a leading 0)
    if len(probas) != top or top < 1 or cum[0] != 0 or np.any(np.diff(cum) < 0):
        raise LayoutError(f"HNSW: {len(probas)} level probabilities for a {len(cum)}-entry neighbour table")
    if len(levels) != n or len(offsets) != n + 1:
        raise LayoutError(f"HNSW: {len(levels)} levels and {len(offsets)} offsets for {n} nodes")
    if n == 0:
        if entry != -1 or max_level != -1 or len(neighbors) or offsets[0] != 0:
            raise LayoutError("HNSW: an empty graph with an entry point or neighbours")
        return
    if levels.min() < 1 or levels.max() > top:
        raise LayoutError(f"HNSW: node levels {levels.min()}..{levels.max()} outside 1..{top}")
    spans = cum[levels].astype(np.uint64)  # (N,) neighbour slots each node's level gives it
    if offsets[0] != 0 or not np.array_equal(np.diff(offsets), spans) or int(offsets[-1]) != len(neighbors):
        raise LayoutError("HNSW: neighbour offsets disagree with the nodes' levels")
    if len(neighbors) and (neighbors.min() < -1 or neighbors.max() >= n):
        raise LayoutError("HNSW: a neighbour names no node")
    if not (0 <= entry < n) or max_level != levels[entry] - 1 or levels.max() - 1 > max_level:
        raise LayoutError(f"HNSW: entry point {entry} at level {max_level} is not the graph's top")


def _ivf_flat(r: _Reader, dim: int) -> Layout:
    """IndexIVFFlat: header, list count, nprobe, flat quantizer (one centroid per list: the lists faiss
    sizes are backed by the file's own bytes), an empty direct map, then the lists, whose sizes are all
    claimed (and allocated by faiss) before any list's data. Returns every list's ids and vectors."""
    r.fourcc(IVF_FLAT)
    n = _header(r, dim)
    nlist, _ = r.unpack("QQ")
    centroids = _flat(r, dim)
    if len(centroids) != nlist or nlist < 1:
        raise LayoutError(f"{nlist} inverted lists for {len(centroids)} centroids")
    (map_type,) = r.unpack("b")
    if map_type != NO_DIRECT_MAP or r.vector(8):
        raise LayoutError(f"inverted lists: direct map of type {map_type}")
    r.fourcc(b"ilar")
    lists, code_size = r.unpack("QQ")
    if lists != nlist or code_size != 4 * dim:
        raise LayoutError(f"inverted lists: {lists} lists of {code_size}-byte codes (expected {nlist}, {4 * dim})")
    sizes = _list_sizes(r, nlist)
    if sum(sizes) != n:
        raise LayoutError(f"inverted lists hold {sum(sizes)} entries for {n}")
    ids, vectors = [], []
    for size in sizes:  # each list: its codes, then its ids
        vectors.append(np.frombuffer(r.take(size * code_size), dtype="<f4").reshape(size, dim))
        ids.append(np.frombuffer(r.take(size * 8), dtype="<i8"))
    return Layout(np.concatenate(ids) if ids else np.zeros(0, np.int64),
                  np.concatenate(vectors) if vectors else np.zeros((0, dim), np.float32))


def _list_sizes(r: _Reader, nlist: int) -> list[int]:
    """The lists' sizes ("full": one per list; "sprs": (list, size) pairs)."""
    if r.fourcc(b"full", b"sprs") == b"full":
        sizes = r.array(np.dtype("<u8"))
        if len(sizes) != nlist:
            raise LayoutError("inverted lists: a size per list expected")
        return [int(x) for x in sizes]
    pairs = r.array(np.dtype("<u8"))
    if len(pairs) % 2:
        raise LayoutError("inverted lists: sparse sizes come in pairs")
    out = [0] * nlist
    for j in range(0, len(pairs), 2):
        if pairs[j] >= nlist:
            raise LayoutError("inverted lists: a sparse size names no list")
        out[int(pairs[j])] = int(pairs[j + 1])
    return out
