"""Local disk tier: one safetensors file per entry, written atomically.

Layout under ``root``::

    root/<namespace>/<key hex[:2]>/<key hex>.safetensors     entries (see codec.py)
    root/<namespace>/<key hex[:2]>/.<key hex>.<random>.tmp   a write in progress
    root/logs/<name>.jsonl                                   record logs (e.g. semantic donors; record_logs.py)

A put writes a private temporary file in the entry's directory, fsyncs it,
renames it over the entry (``os.replace`` is atomic on POSIX) and fsyncs the
directory (best effort; with ``fsync=False`` neither): a reader sees
the old file or the new one, a writer killed mid-write leaves only a ``.tmp``
that is never read, and two writers of one key leave one complete file.

Reads are bounded and open only regular files: an entry (or record log) is
opened with ``O_NOFOLLOW | O_NONBLOCK`` and must be a regular file inside the
store (a FIFO, device, directory or symbolic link at an entry's path is a
rejected lookup, never waited on or followed); the header is read first and
the file's size checked against the header's claim and ``max_entry_bytes``
before the tensors are read (see ``codec.check_size``).

With a byte budget the tier is an LRU on disk: a hit refreshes the entry's
mtime, and a put that takes the tier over budget removes the least recently
used entries (oldest mtime first, every namespace) until it is back under
``low_water`` of the budget. Every process sharing the folder adds its puts'
bytes to one shared tally (``root/budget.tally``: 8 bytes, updated under
``flock``); a process's estimate is its last scan's total plus what the tally
grew by since, so it sees the others' writes too. The folder (every process's
files) is scanned again when the estimate says over budget, before anything
is removed, and at least every ``rescan_s`` on a put. An entry larger than ``low_water`` of the budget is not
stored (its own prune would remove it, after every other entry); a path that
cannot be removed is skipped. A reader that loses a file to a concurrent prune
sees a miss.
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from blend import safeio
from blend.defaults import DEFAULT_DISK_RESCAN_S, DEFAULT_STALE_TEMP_S, DEFAULT_TOUCH_INTERVAL_S
from blend.keys import Namespace, StoreKey, key_hex
from blend.safeio import UnsafeFileError, pread_exact
from blend.store.base import (
    ABSENT,
    EntryInfo,
    KVEntry,
    Lookup,
    LookupStatus,
    StoreStats,
    Verdict,
    check_entry,
    check_put,
    counters_of,
    entry_problem,
)
from blend.store.record_logs import DiskRecordLogs
from blend.store.codec import (
    MAX_ENTRY_BYTES,
    MAX_HEADER_BYTES,
    EntryError,
    EntryErrorKind,
    check_size,
    decode,
    decode_header,
    encode_parts,
    header_length,
)

MAX_TOUCHED_KEYS = 1 << 16  # keys whose last recency update is remembered (the rate limit's memory)
log = logging.getLogger(__name__)

SUFFIX = ".safetensors"
TMP_SUFFIX = safeio.TMP_SUFFIX  # abandoned temp files (a crash mid-put) are swept by this suffix
LOW_WATER = 0.9  # a prune frees down to this fraction of the budget
TALLY_FILE = "budget.tally"  # bytes put by every process sharing the folder (8 bytes, little-endian, flock)


@dataclass(frozen=True)
class PruneResult:
    """What a prune removed and what is left."""

    removed: int
    freed_bytes: int
    kept_bytes: int


def open_regular(path: Path, flags: int = os.O_RDONLY) -> int:
    """``safeio.open_regular`` with a non-regular file as a NOT_A_BLOB :class:`EntryError`.

    Raises:
        FileNotFoundError, EntryError, OSError.
    """
    try:
        return safeio.open_regular(path, flags)
    except UnsafeFileError as e:
        raise EntryError(EntryErrorKind.NOT_A_BLOB, f"{path.name}: {e}") from None


def _read_entry(path: Path, max_bytes: int) -> bytearray:
    """The blob in one writable buffer, read only after its header's size claim was checked.

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


def _size(parts: list[memoryview | bytes]) -> int:
    """Bytes of an encoded entry's file."""
    return sum(memoryview(p).nbytes for p in parts)


class DiskStore:
    """Entries as files under ``root``.

    Args:
        root: directory of the store (created on first put).
        fsync: fsync each file before the rename (durable across power loss).
        budget_bytes: upper bound on the bytes of entry files (None: unbounded);
            least recently used entries are removed past it.
        max_entry_bytes: the largest entry file read or written (a larger one is
            rejected before any allocation).
        rescan_s: with a budget, a put recounts the folder (every process's files) when its
            last scan is older than this (seconds).
    """

    name = "disk"

    def __init__(self, root: str | os.PathLike[str], fsync: bool = True,
                 budget_bytes: int | None = None, max_entry_bytes: int = MAX_ENTRY_BYTES,
                 rescan_s: float = DEFAULT_DISK_RESCAN_S) -> None:
        if budget_bytes is not None and budget_bytes <= 0:
            raise ValueError(f"disk store budget must be positive, got {budget_bytes}")
        if max_entry_bytes <= 0:
            raise ValueError(f"max_entry_bytes must be positive, got {max_entry_bytes}")
        self.root = Path(root).expanduser()
        self.fsync = fsync
        self.budget_bytes = budget_bytes
        self.max_entry_bytes = max_entry_bytes
        self._stats = StoreStats()
        self._lock = threading.Lock()
        self.rescan_s = rescan_s
        self._approx_bytes: int | None = None  # bytes on disk as of the last scan plus every process's puts
        self._scan_total = 0  # bytes on disk at the last scan (after its prune)
        self._tally_at_scan = 0  # the shared tally (:meth:`_tally`) when that scan began
        self._scanned_at = 0.0  # time.monotonic() of that scan
        self._logs = DiskRecordLogs(self.root / "logs")
        self._put_failures: set[tuple[str, int | None]] = set()  # causes of failed writes already logged
        self._touched: OrderedDict[tuple[Namespace, StoreKey], float] = OrderedDict()  # last recency update

    def path(self, ns: Namespace, key: StoreKey) -> Path:
        """Where the entry for (ns, key) lives."""
        h = key_hex(key)
        return self.root / ns.value / h[:2] / (h + SUFFIX)

    def _count(self, field: str, n: int = 1) -> None:
        with self._lock:
            setattr(self._stats, field, getattr(self._stats, field) + n)

    def _leads_inside(self, folder: Path) -> bool:
        """Whether ``folder`` resolves inside the store (not through a symlinked folder to elsewhere)."""
        root = os.path.realpath(self.root)
        return os.path.commonpath([root, os.path.realpath(folder)]) == root

    def _inside(self, path: Path) -> None:
        """Raise EntryError if ``path``'s folder resolves outside the store (a symlinked folder)."""
        if not self._leads_inside(path.parent):
            raise EntryError(EntryErrorKind.NOT_A_BLOB, f"{path.parent} leads outside the store")

    def _shards(self, ns: Namespace) -> Iterator[Path]:
        """The namespace's two-hex-digit folders that resolve inside the store: listing, pruning and
        clearing never follow a symlinked folder out of it (they would delete files that are not the store's)."""
        base = self.root / ns.value
        if not base.is_dir() or not self._leads_inside(base / "x"):
            return
        for d in base.glob("??"):
            if d.is_dir() and not d.is_symlink() and self._leads_inside(d / "x"):
                yield d

    def _load(self, ns: Namespace, key: StoreKey) -> KVEntry | None:
        """Decoded entry, None if absent; raises EntryError if unusable."""
        path = self.path(ns, key)
        self._inside(path)
        try:
            buf = _read_entry(path, self.max_entry_bytes)
        except FileNotFoundError:
            return None
        return decode(buf, ns, key, self.max_entry_bytes)

    def get(self, ns: Namespace, key: StoreKey, provenance: str) -> Lookup:
        try:
            entry = self._load(ns, key)
        except EntryError as e:
            why = str(e)
        except OSError as e:
            log.warning("disk store: cannot read %s: %s", self.path(ns, key), e)
            self._count("misses")
            return Lookup(LookupStatus.MISS, reason=f"unreadable: {e}", tier=self.name)
        else:
            if entry is None:
                self._count("misses")
                return Lookup(LookupStatus.MISS, tier=self.name)
            why = check_entry(entry, provenance)
            if not why:
                self._count("hits")
                self.touch(ns, key)
                return Lookup(LookupStatus.HIT, entry=entry, tier=self.name)
        self._count("rejected")
        log.warning("disk store: rejected %s: %s", self.path(ns, key), why)
        return Lookup(LookupStatus.REJECTED, reason=why, tier=self.name)

    def put(self, ns: Namespace, key: StoreKey, entry: KVEntry) -> None:
        """Write ``entry`` atomically; an I/O failure is logged, not raised (the store is a cache)."""
        check_put(entry)
        if self.budget_bytes is not None and entry.nbytes > self.budget_bytes:
            log.warning("disk store: entry of %d bytes exceeds the budget of %d; not stored",
                        entry.nbytes, self.budget_bytes)
            return
        if entry.nbytes + 8 + MAX_HEADER_BYTES > self.max_entry_bytes:  # it might not be read back
            log.warning("disk store: entry of %d bytes may exceed max_entry_bytes=%d; not stored",
                        entry.nbytes, self.max_entry_bytes)
            return
        parts = encode_parts(ns, key, entry)
        if self.budget_bytes is not None and _size(parts) > self.budget_bytes * LOW_WATER:
            log.warning("disk store: entry of %d bytes exceeds the budget's low-water mark (%d); not stored",
                        _size(parts), int(self.budget_bytes * LOW_WATER))
            return  # its own put's prune would remove it, after every other entry
        dest = self.path(ns, key)
        try:
            # a private temp file (0600), fsynced, renamed over the entry, the folder fsynced; removed on
            # failure. Every folder below the root is opened without following links and the file is written
            # and renamed through the last one's descriptor: a folder swapped for a link between a check and
            # the rename can never make the write land outside the store
            self.root.mkdir(parents=True, exist_ok=True)  # the root itself is trusted as given
            with safeio.atomic_file_beneath(self.root, dest, fsync=self.fsync) as f:
                for part in parts:
                    f.write(part)
                size = f.tell()
            self._after_put(size)
        except (OSError, EntryError) as e:
            cause = (type(e).__name__, getattr(e, "errno", None))
            with self._lock:
                self._stats.extra["put_errors"] = self._stats.extra.get("put_errors", 0) + 1
                first = cause not in self._put_failures
                self._put_failures.add(cause)
            if first:  # once per cause: an unwritable store would print one line per chunk (thousands)
                log.warning("disk store: write of %s failed: %s (later writes failing the same way are "
                            "counted in put_errors, not logged)", dest, e)
            else:
                log.debug("disk store: write of %s failed: %s", dest, e)
            return
        self._count("puts")

    # ---- byte budget --------------------------------------------------------------------

    def touch(self, ns: Namespace, key: StoreKey) -> None:
        """Count a use of ``key`` served by a faster tier above this one (a memory hit never reads the
        disk): its entry is then as recent here as it is there, and a budget's least-recently-used
        pruning (this process's or another's sharing the folder) keeps the hottest entries, not the
        ones no faster tier holds. Best effort; nothing happens for an absent entry.

        At most once per key every ``DEFAULT_TOUCH_INTERVAL_S`` (one ``utime``, a few microseconds, on the
        caller's thread: a lookup never waits behind queued writes), which is far finer than the order a
        budget prunes in.

        Args:
            ns: the entry's namespace.
            key: its key.
        """
        now = time.monotonic()
        with self._lock:
            last = self._touched.get((ns, key))
            if last is not None and now - last < DEFAULT_TOUCH_INTERVAL_S:
                return
            self._touched[(ns, key)] = now
            self._touched.move_to_end((ns, key))
            while len(self._touched) > MAX_TOUCHED_KEYS:
                self._touched.popitem(last=False)
        self._touch(self.path(ns, key))

    @staticmethod
    def _touch(path: Path) -> None:
        try:
            os.utime(path, None)  # mtime = now: most recently used
        except OSError:
            pass  # removed meanwhile, or a read-only store: recency is best effort

    def _after_put(self, size: int) -> None:
        if self.budget_bytes is None:
            return
        tally = self._tally(size)  # every process's puts, this one's included
        with self._lock:
            if self._approx_bytes is None or time.monotonic() - self._scanned_at >= self.rescan_s:
                recount = True  # the first put, or a scan too old to trust
            else:
                # the last scan plus every process's puts since (an overwrite adds bytes it did not add, a
                # removal elsewhere is not subtracted: the estimate errs high, and only a scan prunes)
                grown = tally - self._tally_at_scan if tally is not None else size
                self._approx_bytes = self._scan_total + max(grown, size)
                recount = self._approx_bytes > self.budget_bytes
        if recount:
            self._recount(self.budget_bytes)

    def _tally(self, add: int = 0) -> int | None:
        """The shared tally of bytes put into this folder by every process, after adding ``add`` (None: it
        cannot be kept here, e.g. a read-only or odd file; the process then counts only its own puts)."""
        try:
            fd = safeio.open_regular(self.root / TALLY_FILE, os.O_RDWR | os.O_CREAT, mode=0o600)
        except OSError as e:  # safeio.UnsafeFileError too: a link or FIFO planted at its path
            log.debug("disk store: no shared budget tally: %s", e)
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            raw = os.pread(fd, 8, 0)
            value = int.from_bytes(raw, "little") if len(raw) == 8 else 0
            value = (value + add) % (1 << 63)  # wraps after 8 EiB put: a difference across it is a rescan
            if add:
                os.pwrite(fd, value.to_bytes(8, "little"), 0)
            return value
        except OSError as e:
            log.debug("disk store: cannot update the shared budget tally: %s", e)
            return None
        finally:
            os.close(fd)  # (closing drops the lock)

    def _recount(self, budget: int) -> None:
        """Scan the folder (includes the file just written, and other processes' files); prune down to
        the low-water mark only if the scan is over ``budget``. Killed writers' stale temp files go first:
        they are bytes on disk that no entry count sees."""
        self.sweep_temp(DEFAULT_STALE_TEMP_S)
        tally = self._tally()  # read before the listing: a put landing during it is counted again (errs high)
        with self._lock:
            self._tally_at_scan = tally if tally is not None else 0
        rows = self._entries_by_age()
        if sum(size for _, size, _ in rows) > budget:
            self._prune_rows(rows, int(budget * LOW_WATER))
        else:
            self._prune_rows(rows, budget)  # removes nothing: records the scan

    def _entries_by_age(self) -> list[tuple[float, int, Path]]:
        """(mtime, size, path) of every entry file, least recently used first."""
        rows = []
        for ns in Namespace:
            for p in self._files(ns):
                try:
                    st = p.lstat()  # a link's own size: its target is not the store's
                except FileNotFoundError:
                    continue
                rows.append((st.st_mtime, st.st_size, p))
        rows.sort(key=lambda r: (r[0], str(r[2])))
        return rows

    def prune(self, max_bytes: int) -> PruneResult:
        """Remove least recently used entries until the entry files total at most ``max_bytes``.

        Args:
            max_bytes: bytes to keep (>= 0).

        Returns:
            How many entries were removed, the bytes freed and the bytes kept.
        """
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.sweep_temp(DEFAULT_STALE_TEMP_S)  # killed writers' leftovers (see _recount)
        return self._prune_rows(self._entries_by_age(), max_bytes)

    def _prune_rows(self, rows: list[tuple[float, int, Path]], max_bytes: int) -> PruneResult:
        """:meth:`prune` over a scan's ``rows`` (:meth:`_entries_by_age`); records the scan's total."""
        scanned_at = time.monotonic()
        total = sum(size for _, size, _ in rows)
        removed = freed = 0
        for _, size, path in rows:
            if total <= max_bytes:
                break
            try:
                safeio.unlink_beneath(self.root, path)  # never through a folder swapped for a link meanwhile
            except FileNotFoundError:
                pass  # another process pruned it first: it is gone either way
            except OSError as e:  # a directory at an entry's path, no permission: it stays, the next one goes
                log.warning("disk store: cannot remove %s while pruning: %s", path, e)
                continue
            else:
                removed += 1
                freed += size
            total -= size
        with self._lock:
            self._approx_bytes, self._scan_total, self._scanned_at = total, total, scanned_at
            self._stats.evictions += removed
        if removed:
            log.info("disk store: pruned %d entries (%d bytes) under %s", removed, freed, self.root)
        return PruneResult(removed, freed, total)

    # ---- record logs (RecordLog; kept in record_logs.py) ----------------------------------

    def append_record(self, log_name: str, line: bytes) -> None:
        """See :meth:`DiskRecordLogs.append` (failures are logged, not raised)."""
        self._logs.append(log_name, line)

    def rewrite_records(self, log_name: str, expected: list[bytes], lines: list[bytes]) -> bool:
        """See :meth:`DiskRecordLogs.rewrite` (compare-and-swap)."""
        return self._logs.rewrite(log_name, expected, lines)

    def read_records(self, log_name: str) -> list[bytes]:
        """See :meth:`DiskRecordLogs.read` (complete lines; bounded; never a FIFO)."""
        return self._logs.read(log_name)

    def contains(self, ns: Namespace, key: StoreKey) -> bool:
        path = self.path(ns, key)
        try:
            return path.is_file()
        except OSError as e:  # an unreadable folder (EACCES, EIO): a miss, as get() says, never an error
            log.warning("disk store: cannot look for %s: %s", path, e)
            return False

    def delete(self, ns: Namespace, key: StoreKey) -> bool:
        """Remove the entry (a FIFO or link at its path too, never a link's target); False if
        nothing was there or it cannot be removed (a directory, no permission: logged)."""
        path = self.path(ns, key)
        if not self._leads_inside(path.parent):
            log.warning("disk store: not deleting %s: its folder leads outside the store", path)
            return False
        try:
            safeio.unlink_beneath(self.root, path)  # the folders checked above are not followed if swapped since
            return True
        except FileNotFoundError:
            return False
        except OSError as e:
            log.warning("disk store: cannot delete %s: %s", path, e)
            return False

    def _files(self, ns: Namespace) -> Iterator[Path]:
        for shard in self._shards(ns):
            yield from shard.glob(f"*{SUFFIX}")

    def keys(self, ns: Namespace) -> Iterator[StoreKey]:
        for p in self._files(ns):
            stem = p.name[: -len(SUFFIX)]
            if len(stem) == 64:
                try:
                    yield StoreKey(bytes.fromhex(stem))
                except ValueError:
                    continue

    def temp_files(self, older_than_s: float = 0.0) -> list[Path]:
        """Leftovers of interrupted writes (never read as entries)."""
        now = time.time()
        found = []
        for ns in Namespace:
            for shard in self._shards(ns):
                for p in shard.glob(f".*{TMP_SUFFIX}"):
                    try:
                        if now - p.lstat().st_mtime >= older_than_s:
                            found.append(p)
                    except FileNotFoundError:
                        continue
        return found

    def sweep_temp(self, older_than_s: float = DEFAULT_STALE_TEMP_S) -> int:
        """Remove interrupted writes no byte has reached for ``older_than_s`` (the default: a write in
        progress touches its file with every block, so only killed writers' leftovers go); returns how many."""
        n = 0
        for p in self.temp_files(older_than_s):
            try:
                if not stat.S_ISREG(p.lstat().st_mode):  # a directory or link under a temp name: not ours
                    continue
                safeio.unlink_beneath(self.root, p)
                n += 1
            except FileNotFoundError:
                pass
            except OSError as e:  # another user's file in a shared folder: it stays, the sweep goes on
                log.warning("disk store: cannot remove the stale temp file %s: %s", p, e)
        return n

    def counters(self) -> StoreStats:
        with self._lock:
            return counters_of(self._stats)

    def stats(self) -> StoreStats:
        with self._lock:
            s = StoreStats(**{**self._stats.__dict__, "extra": dict(self._stats.extra)})
        for ns in Namespace:
            for p in self._files(ns):
                try:
                    s.bytes += p.lstat().st_size
                    s.entries += 1
                except FileNotFoundError:
                    continue
        s.extra["temp_files"] = len(self.temp_files())
        return s

    def info(self, ns: Namespace, key: StoreKey) -> EntryInfo | None:
        path = self.path(ns, key)
        self._inside(path)
        try:
            fd = open_regular(path)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise EntryError(EntryErrorKind.NOT_A_BLOB, f"unreadable: {e}") from None
        try:
            size = os.fstat(fd).st_size
            head = pread_exact(fd, 8, 0)
            head += pread_exact(fd, header_length(head) - 8, 8)
        except OSError as e:  # an I/O error mid-read: the entry is unreadable, said in the store's own error
            raise EntryError(EntryErrorKind.NOT_A_BLOB, f"unreadable: {e}") from None
        finally:
            os.close(fd)
        hdr, _, start = decode_header(head)
        check_size(hdr, start, size, self.max_entry_bytes)
        return EntryInfo(ns, key, hdr.provenance, hdr.shape, hdr.dtype, size)

    def verify(self, ns: Namespace, key: StoreKey) -> Verdict:
        try:
            entry = self._load(ns, key)
        except EntryError as e:
            return Verdict.of(str(e) or "invalid entry")
        except OSError as e:
            return Verdict.of(f"unreadable: {e}")
        return ABSENT if entry is None else Verdict.of(entry_problem(entry))

    def check_reachable(self) -> str:
        """'' if the root is a readable folder (or absent: an empty store), else why not."""
        try:
            with os.scandir(self.root):
                return ""
        except FileNotFoundError:
            return ""
        except OSError as e:
            return f"{self.root}: {e.strerror or e}"

    def clear(self, ns: Namespace | None = None) -> int:
        n = 0
        for space in [ns] if ns is not None else list(Namespace):
            for p in list(self._files(space)):
                try:
                    safeio.unlink_beneath(self.root, p)
                    n += 1
                except FileNotFoundError:
                    pass
                except OSError as e:  # a folder swapped for a link since it was listed: refused, never followed
                    log.warning("disk store: cannot remove %s: %s", p, e)
        self.sweep_temp(0.0)
        if ns is None:  # everything: the record logs too (they only point at entries)
            self._logs.clear()
        return n

