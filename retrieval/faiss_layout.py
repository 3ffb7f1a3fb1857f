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

FLAT_IP, ID_MAP2, HNSW_FLAT, IVF_FLAT = b"IxFI", b"IxM2", b"IHNf", b"IwFl"
INNER_PRODUCT = 0  # faiss.METRIC_INNER_PRODUCT
_HEADER = struct.Struct("<iqqq?i")  # d, ntotal, two unused int64s, is_trained, metric_type
_DIRECT_MAP_HASHTABLE = 2  # faiss DirectMap::Hashtable: a second vector of (id, offset) pairs


class LayoutError(ValueError):
    """The bytes are not a layout this module accepts (the caller rebuilds the index)."""


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
        (count,) = self.unpack("Q")
        if count > (len(self.data) - self.pos) // item:
            raise LayoutError(f"a vector of {count} x {item} bytes at offset {self.pos} does not fit the file")
        self.take(count * item)
        return count

    def fourcc(self, *want: bytes) -> bytes:
        got = bytes(self.take(4))
        if got not in want:
            raise LayoutError(f"{got!r} at offset {self.pos - 4}, expected one of {want}")
        return got


def check_layout(data: bytes, kind: str, dim: int) -> None:
    """Accept ``data`` only as the layout :class:`VectorIndex` writes for ``kind``.

    Args:
        data: the whole ``faiss.index`` file.
        kind: "exact", "hnsw" or "ivf" (an :class:`IndexKind` value).
        dim: the vectors' dimension.

    Raises:
        LayoutError: another layout, a claim past the end, or bytes after it.
    """
    r = _Reader(data)
    if kind in ("exact", "hnsw"):
        r.fourcc(ID_MAP2)
        _header(r, dim)
        if kind == "exact":
            _flat(r, dim)
        else:
            _hnsw_flat(r, dim)
        r.vector(8)  # the id map (int64)
    elif kind == "ivf":
        _ivf_flat(r, dim)
    else:
        raise LayoutError(f"no layout for index kind {kind!r}")
    if r.pos != len(data):
        raise LayoutError(f"{len(data) - r.pos} bytes after the index")


def _header(r: _Reader, dim: int) -> int:
    """An index header; returns its ntotal."""
    d, ntotal, _, _, _, metric = r.unpack(_HEADER.format[1:])
    if d != dim or metric != INNER_PRODUCT or ntotal < 0:
        raise LayoutError(f"header d={d} ntotal={ntotal} metric={metric} (expected d={dim}, inner product)")
    return ntotal


def _flat(r: _Reader, dim: int) -> None:
    """IndexFlatIP: its codes are ntotal x d floats."""
    r.fourcc(FLAT_IP)
    ntotal = _header(r, dim)
    if r.vector(4) != ntotal * dim:
        raise LayoutError("a flat index's vectors disagree with its count")


def _hnsw_flat(r: _Reader, dim: int) -> None:
    """IndexHNSWFlat: the header, the graph's vectors and five ints, then its flat storage."""
    r.fourcc(HNSW_FLAT)
    _header(r, dim)
    for item in (8, 4, 4, 8, 4):  # assign_probas, cum_nneighbor_per_level, levels, offsets, neighbors
        r.vector(item)
    r.unpack("5i")  # entry_point, max_level, efConstruction, efSearch, an unused int
    _flat(r, dim)


def _ivf_flat(r: _Reader, dim: int) -> None:
    """IndexIVFFlat: header, list count, nprobe, flat quantizer, direct map, then the lists, whose
    sizes are all claimed (and allocated by faiss) before any list's data."""
    r.fourcc(IVF_FLAT)
    _header(r, dim)
    nlist, _ = r.unpack("QQ")
    _flat(r, dim)
    (map_type,) = r.unpack("b")
    r.vector(8)
    if map_type == _DIRECT_MAP_HASHTABLE:
        r.vector(16)
    r.fourcc(b"ilar")
    n, code_size = r.unpack("QQ")
    if n != nlist or code_size != 4 * dim:
        raise LayoutError(f"inverted lists: {n} lists of {code_size}-byte codes (expected {nlist}, {4 * dim})")
    sizes = _list_sizes(r, nlist)
    for size in sizes:  # each list: its codes, then its ids
        r.take(size * (code_size + 8))


def _list_sizes(r: _Reader, nlist: int) -> list[int]:
    """The lists' sizes ("full": one per list; "sprs": (list, size) pairs), each list's data checked to
    fit the rest of the file before faiss would size it."""
    left = len(r.data) - r.pos
    if r.fourcc(b"full", b"sprs") == b"full":
        start = r.pos + 8
        if r.vector(8) != nlist:
            raise LayoutError("inverted lists: a size per list expected")
        sizes = list(struct.unpack_from(f"<{nlist}Q", r.data, start))
    else:
        start = r.pos + 8
        count = r.vector(8)
        if count % 2:
            raise LayoutError("inverted lists: sparse sizes come in pairs")
        pairs = struct.unpack_from(f"<{count}Q", r.data, start)
        sizes = [0] * min(nlist, left)
        if nlist > left:  # every list costs faiss a vector header: more lists than bytes is a claim
            raise LayoutError(f"{nlist} inverted lists in {left} bytes")
        for j in range(0, count, 2):
            if pairs[j] >= nlist:
                raise LayoutError("inverted lists: a sparse size names no list")
            sizes[pairs[j]] = pairs[j + 1]
    if sum(sizes) > left:  # each entry has at least 8 bytes of id
        raise LayoutError("inverted lists claim more entries than the file holds")
    return sizes
