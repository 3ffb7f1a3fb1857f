"""Record logs beside a disk store: ``<folder>/<name>.jsonl``, one record per line.

Appends are one ``write`` on an O_APPEND file under a shared ``flock``, so
concurrent appenders (threads or processes) interleave whole lines; a rewrite
(compaction) takes the exclusive lock, checks that the log still holds what
the caller read (compare-and-swap), writes a temp file and renames it over the
log, so a reader sees the old log or the new one and no append is lost.

A log is untrusted bytes: only a regular file is opened (a FIFO or link at a
log's path is refused, never waited on), and a torn last line is dropped. A log
larger than ``MAX_LOG_BYTES`` (written before compactions bounded it, or grown
by many appenders between them) is never read whole: its last
``OVERSIZED_KEEP_BYTES``, from the first whole line, replace it, with a warning
that older records were dropped. Records are self-contained, and a later record
only overrides earlier ones, so the newest records replay as they did. Failures
are logged, never raised: the logs only point at entries of a cache.
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

from blend import safeio

log = logging.getLogger(__name__)

MAX_LOG_BYTES = 256 << 20  # a record log larger than this is not read whole (a donor line is ~2 KB)
OVERSIZED_KEEP_BYTES = 64 << 20  # of a log over MAX_LOG_BYTES, the newest records within this many bytes are kept


class DiskRecordLogs:
    """The record logs in one folder.

    Args:
        folder: where the ``<name>.jsonl`` files live (created on the first append).
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def _own_folder(self) -> bool:
        """Whether the folder is the store's own: not a symlink, resolving inside its parent (the store's
        root). A symlinked ``logs`` would have appends write, and ``clear`` delete, files elsewhere."""
        if self.folder.is_symlink():
            return False
        parent = os.path.realpath(self.folder.parent)
        return os.path.commonpath([parent, os.path.realpath(self.folder)]) == parent

    def path(self, name: str) -> Path:
        """The file of the log ``name`` (a plain name: no slash, no leading dot).

        Raises:
            ValueError: a bad name; safeio.UnsafeFileError (an OSError) when the folder leads outside the store.
        """
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"bad log name {name!r}")
        if not self._own_folder():
            raise safeio.UnsafeFileError(f"{self.folder} leads outside the store", self.folder)
        return self.folder / f"{name}.jsonl"

    def append(self, name: str, line: bytes) -> None:
        """Append one record (no newline inside) under a shared lock."""
        if b"\n" in line:
            raise ValueError("a record must not contain a newline")
        try:
            path = self.path(name)
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = _open_current(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, fcntl.LOCK_SH)
            try:
                size = os.fstat(fd).st_size
                # a writer that died mid-line left a torn tail: end it, or this record would be glued onto it
                # and skipped with it
                torn = size > 0 and os.pread(fd, 1, size - 1) != b"\n"
                os.write(fd, (b"\n" if torn else b"") + line + b"\n")
            finally:
                os.close(fd)  # releases the lock
        except OSError as e:  # safeio.UnsafeFileError too
            log.warning("disk store: cannot append to log %s: %s", name, e)

    def rewrite(self, name: str, expected: list[bytes], lines: list[bytes]) -> bool:
        """Replace the log with ``lines`` if it still holds exactly ``expected``.

        Returns:
            Whether it was replaced (False: changed meanwhile, absent, or unwritable).
        """
        if any(b"\n" in ln for ln in lines):
            raise ValueError("a record must not contain a newline")
        try:
            path = self.path(name)
            fd = _open_current(path, os.O_RDWR, fcntl.LOCK_EX)
        except FileNotFoundError:
            return False
        except OSError as e:
            log.warning("disk store: cannot lock log %s: %s", name, e)
            return False
        try:
            size = os.fstat(fd).st_size
            if size > MAX_LOG_BYTES:
                log.warning("disk store: log %s holds %d bytes, over %d; not rewritten", path, size, MAX_LOG_BYTES)
                return False
            if complete_lines(safeio.pread_exact(fd, size, 0)) != list(expected):
                return False  # appended to (or rewritten) since it was read: try another time
            # a private temp file, fsynced, renamed over the log, the folder fsynced; removed on failure
            # (through the store root's folders, never a link: the log cannot be replaced elsewhere)
            with safeio.atomic_file_beneath(self.folder.parent, path) as f:
                f.write(b"".join(ln + b"\n" for ln in lines))
            return True  # appenders waiting on the old file reopen the new one
        except OSError as e:
            log.warning("disk store: cannot rewrite log %s: %s", path, e)
            return False
        finally:
            os.close(fd)

    def read(self, name: str) -> list[bytes]:
        """Complete lines of the log (empty, with a warning, if unreadable or irregular; an oversized log is
        trimmed to its newest records first, see :meth:`_trim`)."""
        try:
            return self._read(name)
        except safeio.FileTooLargeError:
            return self._trim(name)
        except OSError as e:  # safeio.UnsafeFileError too: a FIFO or a link
            log.warning("disk store: cannot read log %s: %s", name, e)
            return []

    def read_checked(self, name: str) -> list[bytes] | None:
        """:meth:`read`, telling an absent log (empty) from one that is there but was not read whole (None,
        with a warning: a FIFO, a link, unreadable; or oversized: trimmed now, its older records dropped)."""
        try:
            return self._read(name)
        except safeio.FileTooLargeError:
            self._trim(name)
            return None
        except OSError as e:  # safeio.UnsafeFileError too: a FIFO or a link
            log.warning("disk store: cannot read log %s: %s", name, e)
            return None

    def _read(self, name: str) -> list[bytes]:
        try:
            data = safeio.read_regular(self.path(name), MAX_LOG_BYTES)
        except FileNotFoundError:
            return []
        return complete_lines(data)

    def _trim(self, name: str) -> list[bytes]:
        """Replace an oversized log by its last ``OVERSIZED_KEEP_BYTES`` from the first whole line (under the
        exclusive lock; memory bounded by that, never the log's size).

        Returns:
            The records kept (also when the log cannot be rewritten: they are read all the same).
        """
        try:
            path = self.path(name)
            fd = _open_current(path, os.O_RDWR, fcntl.LOCK_EX)
        except FileNotFoundError:
            return []
        except OSError as e:
            log.warning("disk store: cannot read log %s: %s", name, e)
            return []
        lines: list[bytes] = []
        try:
            size = os.fstat(fd).st_size
            if size <= MAX_LOG_BYTES:  # another process trimmed it while this one waited for the lock
                return complete_lines(safeio.pread_exact(fd, size, 0))
            start = size - OVERSIZED_KEEP_BYTES
            tail = safeio.pread_exact(fd, size - start + 1, start - 1)  # a byte before: is the first line whole?
            first, last = tail.find(b"\n") + 1, tail.rfind(b"\n") + 1  # 0, 0 when there is no newline at all
            kept = tail[first:last] if first else b""
            lines = complete_lines(kept)
            log.warning("disk store: log %s held %d bytes, over %d: kept its newest %d records (%d bytes); older "
                        "records were dropped", path, size, MAX_LOG_BYTES, len(lines), len(kept))
            with safeio.atomic_file_beneath(self.folder.parent, path) as f:
                f.write(kept)
        except OSError as e:
            log.warning("disk store: cannot trim log %s: %s", path, e)
        finally:
            os.close(fd)
        return lines

    def has(self, name: str) -> bool:
        """Whether the log exists with anything in it (one stat: cheap enough before every append).

        Args:
            name: the log's name.

        Returns:
            False if absent or empty; True otherwise, an unreadable one included (an append reports that).
        """
        try:
            return os.stat(self.path(name)).st_size > 0
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError:
            return True

    def clear(self) -> None:
        """Remove every log (and a compaction's temp file left by a crash)."""
        if not self.folder.is_dir() or not self._own_folder():
            if self.folder.is_symlink():
                log.warning("disk store: not clearing %s: it leads outside the store", self.folder)
            return
        for p in self.folder.glob("*"):
            try:  # relative to the store's root, no link followed: the folder may be swapped after the check
                safeio.unlink_beneath(self.folder.parent, p)
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning("disk store: cannot remove %s: %s", p, e)


def complete_lines(data: bytes) -> list[bytes]:
    """A record log's non-blank lines; the part after the last newline is torn and dropped.

    Args:
        data: the log's bytes as read.

    Returns:
        Each whole line without its newline, in order, blank ones left out.
    """
    return [ln for ln in data.split(b"\n")[:-1] if ln.strip()]


def _owner_only(fd: int) -> None:
    """Drop group and other permissions of an open file we own (best effort: another user's file stays)."""
    try:
        st = os.fstat(fd)
        if st.st_mode & 0o077 and st.st_uid == os.geteuid():
            os.fchmod(fd, st.st_mode & 0o700)
    except OSError:
        pass


def _open_current(path: Path, flags: int, lock: int) -> int:
    """Open ``path`` and take ``lock`` (fcntl.flock) on the file that is at ``path``
    once the lock is held: a compaction may have renamed a new file over the one
    opened, so the open is retried until the locked file is the current one.

    Returns:
        The locked descriptor (closing it releases the lock).

    Raises:
        FileNotFoundError, safeio.UnsafeFileError (not a regular file), OSError.
    """
    while True:
        # a FIFO or link at a log's path is refused, never waited on; owner-only, as the entries: a donor log
        # holds documents' token ids, which decode back to their text
        fd = safeio.open_regular(path, flags, mode=0o600)
        if flags & (os.O_WRONLY | os.O_RDWR):
            _owner_only(fd)  # a log an earlier version created 0644 is made private the first time it is written
        try:
            fcntl.flock(fd, lock)
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                return fd
        except FileNotFoundError:
            pass  # replaced between the open and the stat: open again
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
