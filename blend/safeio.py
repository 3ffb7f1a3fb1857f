"""Opening files whose bytes are not trusted: regular files only, reads bounded.

Every parser of stored or indexed bytes (store entries and record logs, index
files, corpus files, eval data) opens through here, so none of them waits on a
FIFO, reads a device, follows a final symbolic link it did not ask for, or
allocates what a file's size (or a header's claim) says before checking it
against a cap. Callers turn :class:`UnsafeFileError` into their own error type.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from typing import BinaryIO, TextIO

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISLNK, "a symbolic link"),
)


class UnsafeFileError(OSError):
    """A path that is not a regular file, or a file larger than its reader's cap.

    ``str(e)`` says what it is without the path (callers name the file).
    """

    def __init__(self, message: str, path: str | os.PathLike[str]) -> None:
        super().__init__(message)
        self.message = message
        self.path = str(path)

    def __str__(self) -> str:
        return self.message


class NotRegularFileError(UnsafeFileError):
    """A FIFO, device, directory, socket or (unfollowed) symbolic link."""


class FileTooLargeError(UnsafeFileError):
    """A regular file larger than its reader's cap."""


def file_kind(mode: int) -> str:
    """``"a FIFO"``, ``"a directory"``, ... for a non-regular ``st_mode``.

    Args:
        mode: an ``os.stat`` result's ``st_mode``.

    Returns:
        A phrase naming the kind of file, for an error message.
    """
    for test, name in _KINDS:
        if test(mode):
            return name
    return "a special file"


def is_regular(path: str | os.PathLike[str], follow_symlinks: bool = True) -> bool:
    """Whether ``path`` is a regular file (False if absent or unreadable).

    Args:
        path: the file.
        follow_symlinks: whether a symbolic link is judged by its target (False: a link is not regular).

    Returns:
        Whether it is a regular file.
    """
    try:
        return stat.S_ISREG(os.stat(path, follow_symlinks=follow_symlinks).st_mode)
    except OSError:
        return False


def open_regular(path: str | os.PathLike[str], flags: int = os.O_RDONLY, follow_symlinks: bool = False,
                 mode: int = 0o644) -> int:
    """Open ``path`` only if it is a regular file, never blocking on a FIFO.

    Args:
        path: the file.
        flags: access flags; ``O_NONBLOCK`` and ``O_CLOEXEC`` are added, and
            ``O_NOFOLLOW`` unless ``follow_symlinks``.
        follow_symlinks: whether a symbolic link as the last component is followed.
        mode: permissions of a file ``O_CREAT`` creates (0o600 for anything holding users' text or KV).

    Returns:
        A descriptor of a regular file (the caller closes it).

    Raises:
        FileNotFoundError: nothing at ``path`` (and no ``O_CREAT``).
        NotRegularFileError: a FIFO, device, directory, socket or (unfollowed) symbolic link.
        OSError: any other failure to open.
    """
    extra = os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags | extra, mode)
    except OSError as e:
        if e.errno == errno.ELOOP and not follow_symlinks:
            raise NotRegularFileError("a symbolic link, not a regular file", path) from None
        if e.errno in (errno.EISDIR, errno.ENXIO):  # a directory opened for writing; a FIFO with no reader
            raise NotRegularFileError(f"{e.strerror}; not a regular file", path) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise NotRegularFileError(f"{file_kind(mode)}, not a regular file", path)
    return fd


def pread_exact(fd: int, n: int, offset: int) -> bytes:
    """Up to ``n`` bytes at ``offset`` (fewer only at the end of the file).

    Args:
        fd: an open file descriptor.
        n: bytes wanted.
        offset: where to read from, in bytes.

    Returns:
        The bytes read (read in pieces of at most 16 MiB, so a huge ``n`` allocates no more than the file holds).
    """
    parts, got = [], 0
    while got < n:
        chunk = os.pread(fd, min(n - got, 1 << 24), offset + got)
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def read_regular(path: str | os.PathLike[str], max_bytes: int, follow_symlinks: bool = False) -> bytes:
    """The whole of a regular file of at most ``max_bytes``.

    Args:
        path: the file.
        max_bytes: the largest size accepted.
        follow_symlinks: whether a symbolic link is followed (False: a link is refused as not regular).

    Returns:
        The file's bytes (at most ``max_bytes``, should it grow while read).

    Raises:
        FileNotFoundError: absent.
        NotRegularFileError: not a regular file.
        FileTooLargeError: larger than ``max_bytes`` (checked before reading).
        OSError: unreadable.
    """
    fd = open_regular(path, follow_symlinks=follow_symlinks)
    try:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise FileTooLargeError(f"{size} bytes, over the cap of {max_bytes}", path)
        if size < 1 << 24:  # one read of the file and a byte more (pread_exact's pieces take 16 MiB buffers)
            data = os.pread(fd, size + 1, 0)
            if len(data) <= size:  # as fstat saw it (or shorter: it shrank meanwhile)
                return data
            return (data + pread_exact(fd, max_bytes + 1 - len(data), len(data)))[:max_bytes]  # it grew meanwhile
        return pread_exact(fd, max_bytes + 1, 0)[:max_bytes]
    finally:
        os.close(fd)


TMP_SUFFIX = ".tmp"  # atomic_file's temporary files: .NAME.XXXXXXXX.tmp beside their target


def fsync_dir(folder: str | os.PathLike[str]) -> None:
    """fsync a directory so a rename inside it survives power loss (best effort: some file
    systems and platforms cannot open or fsync a directory; that is not an error).

    Args:
        folder: the directory.
    """
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_files(folder: str | os.PathLike[str]) -> None:
    """fsync every regular file directly inside ``folder``, then the folder: what was written there is on
    disk before a rename publishes the folder (a crash could otherwise leave the new name over empty files).

    Args:
        folder: the directory (subfolders and symbolic links in it are left alone).

    Raises:
        OSError: a file could not be opened or fsynced.
    """
    for entry in os.scandir(folder):
        if entry.is_file(follow_symlinks=False):
            fd = os.open(entry.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fsync_dir(folder)


def _umask() -> int:
    """The process's umask, read without changing it (Linux: /proc); 0o022 where it cannot be read."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def _mode_for(target: str) -> int | None:
    """The mode a replacement of ``target`` gets: the old file's, or what a plain open() would create
    for a new one (mkstemp's 0600 would hide it from users who could read the old one); None where it
    cannot be read (the temporary file keeps 0600: a mode is no reason to fail a write)."""
    try:
        try:
            return stat.S_IMODE(os.stat(target).st_mode)
        except FileNotFoundError:
            return 0o666 & ~_umask()
    except OSError:
        return None


@contextmanager
def _replace_in_folder(dir_fd: int, name: str, path: str | os.PathLike[str], *, fsync: bool,
                       mode: int | None) -> Iterator[BinaryIO]:
    """The steps every atomic write shares, inside the folder open at ``dir_fd``: a fresh temporary file
    (``.NAME.XXXXXXXX.tmp``, created exclusively, never through a link), written by the block, flushed
    and fsynced, renamed over ``name`` and the folder fsynced (best effort). On any failure the temporary
    file is removed and the error raised; ``name`` is unchanged.

    Args:
        dir_fd: the folder's descriptor (the caller closes it).
        name: the file's name in that folder.
        path: the file's path, for errors.
        fsync: fsync the file and the folder.
        mode: the file's mode (None: 0600).
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(100):  # a fresh name, as mkstemp picks one
        tmp = f".{name}.{secrets.token_hex(4)}{TMP_SUFFIX}"
        try:
            fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(errno.EEXIST, "no free temporary file name", os.fspath(path))
    try:
        with os.fdopen(fd, "wb") as f:
            try:
                os.fchmod(f.fileno(), 0o600 if mode is None else mode)  # whatever the umask
            except OSError:
                pass  # a mode we cannot set is not a reason to fail the write
            yield f
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise
    if fsync:
        try:
            os.fsync(dir_fd)
        except OSError:
            pass  # best effort: some file systems cannot fsync a folder


@contextmanager
def atomic_file(path: str | os.PathLike[str], *, fsync: bool = True, private: bool = False) -> Iterator[BinaryIO]:
    """A binary file that replaces ``path`` atomically when the block ends: a reader sees the old file
    or the new one, never part.

    A private temporary file (in the target's folder, a fresh name, so two writers never share one) is
    written by the block, flushed and fsynced, then renamed over ``path`` and the folder fsynced (best
    effort). If the block or the rename fails the temporary file is removed and the error raised;
    ``path`` is unchanged.

    Args:
        path: the file to replace (its folder must exist).
        fsync: fsync the file and its folder (durable across power loss).
        private: owner-only (0600); otherwise the file gets the mode of the file it replaces, or what a
            plain ``open()`` would create.

    Yields:
        The temporary file, open for writing.

    Raises:
        OSError: the write or the rename failed.
    """
    target = os.fspath(path)
    dir_fd = os.open(os.path.dirname(target) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        with _replace_in_folder(dir_fd, os.path.basename(target), target, fsync=fsync,
                                mode=None if private else _mode_for(target)) as f:
            yield f
    finally:
        os.close(dir_fd)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes | bytearray | memoryview, *,
                       fsync: bool = True, private: bool = False) -> None:
    """Replace ``path`` with ``data`` atomically (:func:`atomic_file`).

    Args:
        path: the file to replace (its folder must exist).
        data: the new contents.
        fsync: fsync the file and its folder (durable across power loss).
        private: owner-only (0600) whatever the umask.

    Raises:
        OSError: the write or the rename failed.
    """
    with atomic_file(path, fsync=fsync, private=private) as f:
        f.write(data)


def atomic_write_text(path: str | os.PathLike[str], text: str, *, encoding: str = "utf-8",
                      fsync: bool = True) -> None:
    """:func:`atomic_write_bytes` of ``text`` encoded (UTF-8 by default).

    Args:
        path: the file to replace (its folder must exist).
        text: the new contents.
        encoding: the text's encoding.
        fsync: fsync the file and its folder (durable across power loss).

    Raises:
        OSError: the write or the rename failed (the old file is left as it was).
    """
    atomic_write_bytes(path, text.encode(encoding), fsync=fsync)


def save_figure(fig, path: str | os.PathLike[str], **kwargs) -> None:
    """A matplotlib figure written as :func:`atomic_file` writes (never through a link or into a FIFO).

    Args:
        fig: the figure.
        path: the image file; its suffix names the format unless ``format`` is given (none: png).
        **kwargs: passed to ``savefig``.
    """
    fmt = kwargs.pop("format", None) or (os.path.splitext(os.fspath(path))[1].lstrip(".") or "png")
    with atomic_file(path) as f:
        fig.savefig(f, format=fmt, **kwargs)


def append_text(path: str | os.PathLike[str], encoding: str = "utf-8") -> TextIO:
    """A text file opened for appending (created if absent), only if it is a regular file.

    Args:
        path: the file.
        encoding: its text encoding.

    Returns:
        The open file (the caller closes it).

    Raises:
        NotRegularFileError: a link or FIFO at ``path`` (never written through or waited on).
        OSError: any other failure to open.
    """
    fd = open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    return os.fdopen(fd, "a", encoding=encoding)


def _relative_parts(root: str | os.PathLike[str], path: str | os.PathLike[str]) -> list[str]:
    """``path``'s components below ``root`` (raises UnsafeFileError for a path not lexically inside it)."""
    rel = os.path.relpath(os.fspath(path), os.fspath(root))
    parts = rel.split(os.sep)
    if any(p in ("", ".", "..") for p in parts):
        raise UnsafeFileError("not inside the folder it must be in", path)
    return parts


def _open_folders_beneath(root: str | os.PathLike[str], folders: list[str], path: str | os.PathLike[str],
                          create: bool = False) -> int:
    """A descriptor of ``root``/``folders``..., each folder opened with ``O_NOFOLLOW`` relative to the one
    before (``create``: missing ones made, mode 0777 less the umask). The caller closes it.

    Raises:
        UnsafeFileError: a folder on the way is a symbolic link or not a folder (``path`` names it).
        OSError: any other failure.
    """
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in folders:
            flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                try:
                    nxt = os.open(part, flags, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    try:
                        os.mkdir(part, dir_fd=fd)
                    except FileExistsError:  # another writer made it meanwhile
                        pass
                    nxt = os.open(part, flags, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise UnsafeFileError("a folder on its way is a symbolic link or not a folder", path) from None
                raise
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def unlink_beneath(root: str | os.PathLike[str], path: str | os.PathLike[str]) -> None:
    """Remove ``path`` (a file or link, never a link's target) without following any symbolic link below
    ``root``: each folder between them is opened with ``O_NOFOLLOW`` relative to the one before, and the
    file is unlinked relative to the last. A folder swapped for a link after it was listed (a race to make
    a prune delete elsewhere) is refused instead of followed.

    Args:
        root: the folder the path must lie in (itself trusted as given).
        path: a path inside ``root`` (lexically: no ``..`` components).

    Raises:
        FileNotFoundError: nothing there.
        UnsafeFileError: a folder on the way is a symbolic link or not a folder, or ``path`` is not inside
            ``root``.
        OSError: any other failure to remove.
    """
    parts = _relative_parts(root, path)
    fd = _open_folders_beneath(root, parts[:-1], path)
    try:
        os.unlink(parts[-1], dir_fd=fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_file_beneath(root: str | os.PathLike[str], path: str | os.PathLike[str], *, fsync: bool = True
                        ) -> Iterator[BinaryIO]:
    """:func:`atomic_file` for a file inside ``root`` that never follows a symbolic link below ``root``:
    the folders between them are opened (made where missing) with ``O_NOFOLLOW`` relative to the one
    before, and the private (0600) temporary file is created, renamed over ``path`` and its folder
    fsynced through that last folder's descriptor. A folder swapped for a link between a check and the
    rename (a race to make a store write elsewhere) is refused instead of followed.

    Args:
        root: the folder the path must lie in (itself trusted as given).
        path: the file to replace, lexically inside ``root``.
        fsync: fsync the file and its folder (durable across power loss).

    Yields:
        The temporary file, open for writing.

    Raises:
        UnsafeFileError: a folder on the way is a symbolic link or not a folder, or ``path`` is not inside
            ``root``.
        OSError: the write or the rename failed (``path`` is unchanged; the temporary file is removed).
    """
    parts = _relative_parts(root, path)
    dir_fd = _open_folders_beneath(root, parts[:-1], path, create=True)
    try:
        with _replace_in_folder(dir_fd, parts[-1], path, fsync=fsync, mode=None) as f:
            yield f
    finally:
        os.close(dir_fd)
