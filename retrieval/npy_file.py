"""A strict ``.npy`` reader: the header is checked before a byte of data is allocated.

numpy's own reader evaluates the header as a Python literal, may unpickle, and
raises a wide range of exceptions on damaged input; an index folder is
untrusted bytes, so its ``.npy`` files are read here: a regular file only, the
header matched against what ``np.save`` writes, the dtype and shape against
what the caller expects, and the size against the header's claim and a cap.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

from blend import safeio
from blend.retrieval.corpus import RetrievalError

def load_npy(path: Path, dtype: np.dtype, shape: tuple[int | None, ...], max_bytes: int) -> np.ndarray:
    """An ``.npy`` array read only after its header was checked (no pickles, no allocation from a claim).

    Args:
        path: the file.
        dtype: the exact dtype it must hold.
        shape: the shape it must have; ``None`` matches any length.
        max_bytes: the most data bytes read (the index's ``MAX_INDEX_FILE_BYTES``).

    Returns:
        The array (C order, ``dtype``).

    Raises:
        RetrievalError: naming ``path``: missing, irregular, over ``max_bytes``,
            not an .npy, another dtype or shape, or a size that disagrees with its header.
    """
    try:
        fd = safeio.open_regular(path)
    except OSError as e:  # FileNotFoundError, safeio.UnsafeFileError, ...
        raise RetrievalError(f"{path}: unreadable ({e})") from None
    try:
        size = os.fstat(fd).st_size
        head = safeio.pread_exact(fd, 12, 0)
        start, descr, fortran, got_shape = _npy_header(head, safeio.pread_exact(fd, _NPY_MAX_HEADER, 0))
        if descr != dtype.str or fortran or len(got_shape) != len(shape) or any(
                w is not None and g != w for g, w in zip(got_shape, shape)):
            raise RetrievalError(f"{path}: holds {descr} {'(Fortran order) ' if fortran else ''}{got_shape}, "
                                 f"expected {dtype.str} {tuple('N' if w is None else w for w in shape)}")
        n = int(np.prod(got_shape, dtype=object)) * dtype.itemsize
        if n > max_bytes or start + n != size:
            raise RetrievalError(f"{path}: header claims {n} data bytes, the file holds {size - start} "
                                 f"(cap {max_bytes})")
        data = safeio.pread_exact(fd, n, start)
    except ValueError as e:
        raise RetrievalError(f"{path}: not a readable .npy file ({e})") from None
    finally:
        os.close(fd)
    if len(data) != n:
        raise RetrievalError(f"{path}: shrank while read")
    return np.frombuffer(data, dtype=dtype).reshape(got_shape).copy()


_NPY_MAGIC = b"\x93NUMPY"
_NPY_MAX_HEADER = 4096  # np.save writes ~128 bytes
_NPY_HEADER = re.compile(
    r"\{'descr': '([<>|=][a-zA-Z][0-9]{1,2})', 'fortran_order': (True|False), "
    r"'shape': \(((?:[0-9]{1,19}, )*(?:[0-9]{1,19},?)?)\), \} *\n"
)


def _npy_header(head: bytes, prefix: bytes) -> tuple[int, str, bool, tuple[int, ...]]:
    """(data offset, dtype string, Fortran order, shape) of an ``.npy`` file as ``np.save`` writes it.

    A strict pattern, not numpy's reader: numpy evaluates the header as a Python
    literal and raises a wide range of exceptions on damaged input.

    Raises:
        ValueError: anything else.
    """
    if len(head) < 10 or head[:6] != _NPY_MAGIC or head[6:8] not in (b"\x01\x00", b"\x02\x00", b"\x03\x00"):
        raise ValueError("no .npy magic")
    if head[6] == 1:
        hlen, start = int.from_bytes(head[8:10], "little"), 10
    else:
        hlen, start = int.from_bytes(head[8:12], "little"), 12
    if hlen > _NPY_MAX_HEADER - start or len(prefix) < start + hlen:
        raise ValueError(f"header of {hlen} bytes")
    try:
        text = prefix[start : start + hlen].decode("latin-1" if head[6] < 3 else "utf-8")
    except UnicodeDecodeError:
        raise ValueError("header is not text") from None
    m = _NPY_HEADER.fullmatch(text)
    if m is None:
        raise ValueError("header is not {'descr', 'fortran_order', 'shape'} as np.save writes it")
    dims = tuple(int(d) for d in m.group(3).replace(",", " ").split())
    return start + hlen, m.group(1), m.group(2) == "True", dims
