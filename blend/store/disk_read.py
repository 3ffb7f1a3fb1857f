"""Bounded reads of a disk store's entry files, opening only regular files.

An entry (or record log) is opened with ``O_NOFOLLOW | O_NONBLOCK`` and must be
a regular file inside the store (a FIFO, device, directory or symbolic link at
an entry's path is a rejected lookup, never waited on or followed); the header
is read first and the file's size checked against the header's claim and
``max_entry_bytes`` before the tensors are read (see ``codec.check_size``).
"""

from __future__ import annotations

import os
from pathlib import Path

from blend import safeio
from blend.safeio import UnsafeFileError, pread_exact
from blend.store.codec import EntryError, EntryErrorKind, check_size, decode_header, header_length


def open_regular(path: Path, flags: int = os.O_RDONLY) -> int:
    """``safeio.open_regular`` with a non-regular file as a NOT_A_BLOB :class:`EntryError`.

    Args:
        path: the file.
        flags: access flags (``safeio.open_regular`` adds ``O_NONBLOCK``, ``O_CLOEXEC`` and ``O_NOFOLLOW``).

    Returns:
        An open file descriptor (the caller closes it).

    Raises:
        FileNotFoundError, EntryError, OSError.
    """
    try:
        return safeio.open_regular(path, flags)
    except UnsafeFileError as e:
        raise EntryError(EntryErrorKind.NOT_A_BLOB, f"{path.name}: {e}") from None


def read_entry(path: Path, max_bytes: int) -> bytearray:
    """The blob in one writable buffer, read only after its header's size claim was checked.

    Args:
        path: the entry's file.
        max_bytes: the largest file read (a larger claim is refused before any allocation).

    Returns:
        The whole file's bytes.

    Raises:
        FileNotFoundError: absent.
        EntryError: not a regular file, bad header, size differs from the claim or over ``max_bytes``.
        OSError: unreadable.
    """
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        head = pread_exact(fd, 8, 0)
        head += pread_exact(fd, header_length(head) - 8, 8)
        hdr, _, start = decode_header(head)
        want = check_size(hdr, start, size, max_bytes)
        buf = bytearray(want)
        view, got = memoryview(buf), 0
        while got < want:
            n = os.preadv(fd, [view[got:]], got)
            if not n:
                raise EntryError(EntryErrorKind.TRUNCATED, f"file shrank to {got} bytes while read")
            got += n
        return buf
    finally:
        os.close(fd)
