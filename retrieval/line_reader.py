"""Reading another index's JSON Lines files (chunk table, intent log) a line at a time, in memory bounded by
the texts a collection asks about rather than by the file.

A collection asks another index which of a few texts it references. Reading that index's chunks.jsonl
(up to ``MAX_INDEX_FILE_BYTES``, 8 GiB) or its intent log (1 GiB) whole, as its own catalog does, let a
large or crafted index make the collecting process allocate that much. :func:`bounded_lines` holds one
line at a time, and never more of it than :func:`row_bound` of the texts asked about: a longer line cannot
be a row holding one of them as kvblend writes rows, so it is passed over unread.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Iterator

from blend import safeio

ESCAPED_BYTES_PER_BYTE = 6  # the most JSON bytes one UTF-8 byte of a text takes ("\u001f" for 1 byte)
ROW_SLACK_BYTES = 1 << 12  # a row's other fields and punctuation (a chunk id is 64 hex characters)
_PIECE = 1 << 16  # how much of a line passed over is read at a time


def row_bound(texts: Iterable[str]) -> int:
    """The longest line a row holding one of ``texts`` takes, however JSON escapes its characters.

    Args:
        texts: the texts asked about.

    Returns:
        Bytes, newline excluded.
    """
    return ESCAPED_BYTES_PER_BYTE * max((len(t.encode("utf-8", "surrogatepass")) for t in texts), default=0) \
        + ROW_SLACK_BYTES


def bounded_lines(path: str | os.PathLike[str], max_bytes: int, max_line: int) -> Iterator[tuple[int, bytes | None]]:
    """The lines of a regular file, each without its ``b"\\n"``, numbered from 1; a line longer than
    ``max_line`` comes as None (it is read past in pieces, never held whole).

    Args:
        path: the file (a link or anything but a regular file is refused).
        max_bytes: the largest file read.
        max_line: the longest line returned.

    Yields:
        (line number, line or None), in order.

    Raises:
        FileNotFoundError: nothing at ``path``.
        safeio.UnsafeFileError: not a regular file, or larger than ``max_bytes`` (also when it grows past
            that while it is read).
        OSError: unreadable.
    """
    with os.fdopen(safeio.open_regular(path), "rb") as f:
        if os.fstat(f.fileno()).st_size > max_bytes:
            raise safeio.FileTooLargeError(f"over the cap of {max_bytes} bytes", path)
        n, seen = 0, 0
        while True:
            line = f.readline(max_line + 1)
            if not line:
                return
            n, seen = n + 1, seen + len(line)
            if line.endswith(b"\n"):
                yield n, line[:-1]
            elif len(line) <= max_line:  # the last line, without a newline
                yield n, line
            else:  # too long: read past the rest of it
                while (piece := f.readline(_PIECE)) and not piece.endswith(b"\n"):
                    seen += len(piece)
                    _check(seen, max_bytes, path)
                seen += len(piece)
                yield n, None
            _check(seen, max_bytes, path)


def _check(seen: int, max_bytes: int, path: str | os.PathLike[str]) -> None:
    if seen > max_bytes:  # it grew while it was read
        raise safeio.FileTooLargeError(f"over the cap of {max_bytes} bytes", path)


def lines_of(path: Path, max_bytes: int, texts: Iterable[str]) -> Iterator[tuple[int, bytes]]:
    """:func:`bounded_lines` for rows that may hold one of ``texts``: the non-blank lines of at most
    :func:`row_bound` bytes (longer ones are skipped).

    Args:
        path: the file.
        max_bytes: the largest file read.
        texts: the texts asked about.

    Yields:
        (line number, line), in order.

    Raises:
        As :func:`bounded_lines`.
    """
    for n, line in bounded_lines(path, max_bytes, row_bound(texts)):
        if line is not None and line.strip():
            yield n, line
