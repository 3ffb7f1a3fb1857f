"""Local disk tier: one safetensors file per entry, written atomically.

Files lie as ``disk_layout.py`` describes (entries, temp files of writes in progress, record logs).

A put writes a private temporary file in the entry's directory, fsyncs it,
renames it over the entry (``os.replace`` is atomic on POSIX) and fsyncs the
directory (best effort; with ``fsync=False`` neither): a reader sees
the old file or the new one, a writer killed mid-write leaves only a ``.tmp``
that is never read, and two writers of one key leave one complete file.

Reads are bounded and open only regular files (``disk_read.py``). A byte budget makes the tier an LRU
on disk, shared by every process using the folder (``disk_budget.py``).
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Iterator

from blend import safeio
from blend.defaults import DEFAULT_DISK_RESCAN_S, DEFAULT_STALE_TEMP_S, DEFAULT_TOUCH_INTERVAL_S
from blend.keys import Namespace, StoreKey, key_hex
from blend.safeio import pread_exact
from blend.store.base import (
    ABSENT,
    EntryInfo,
    KVEntry,
    Lookup,
    LookupStatus,
    Presence,
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
from blend.store.disk_budget import LOW_WATER, DiskBudget, PruneResult
from blend.store.disk_layout import SUFFIX, entry_files, leads_inside, sweep_temp, temp_files
from blend.store.disk_read import open_regular, read_entry

MAX_TOUCHED_KEYS = 1 << 16  # keys whose last recency update is remembered (the rate limit's memory)
log = logging.getLogger(__name__)


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
        self._budget = DiskBudget(self.root)  # the folder's byte count between scans, and its prune
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
        return leads_inside(self.root, folder)

    def _inside(self, path: Path) -> None:
        """Raise EntryError if ``path``'s folder resolves outside the store (a symlinked folder)."""
        if not self._leads_inside(path.parent):
            raise EntryError(EntryErrorKind.NOT_A_BLOB, f"{path.parent} leads outside the store")

    def _load(self, ns: Namespace, key: StoreKey) -> KVEntry | None:
        """Decoded entry, None if absent; raises EntryError if unusable."""
        path = self.path(ns, key)
        self._inside(path)
        try:
            buf = read_entry(path, self.max_entry_bytes)
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
        path = self.path(ns, key)
        if self._leads_inside(path.parent):  # never a folder linked out of the store
            self._touch(path)

    @staticmethod
    def _touch(path: Path) -> None:
        try:
            os.utime(path, None, follow_symlinks=False)  # mtime = now: most recently used (never a link's target)
        except OSError:
            pass  # removed meanwhile, or a read-only store: recency is best effort

    def _after_put(self, size: int) -> None:
        if self.budget_bytes is None:
            return
        pruned = self._budget.after_put(size, self.budget_bytes, self.rescan_s)
        if pruned is not None:
            self._count("evictions", pruned.removed)

    def prune(self, max_bytes: int) -> PruneResult:
        """Remove least recently used entries until the entry files total at most ``max_bytes``.

        Args:
            max_bytes: bytes to keep (>= 0).

        Returns:
            How many entries were removed, the bytes freed and the bytes kept.
        """
        pruned = self._budget.prune(max_bytes)
        self._count("evictions", pruned.removed)
        return pruned

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

    def read_records_checked(self, log_name: str) -> list[bytes] | None:
        """See :meth:`DiskRecordLogs.read_checked` (None: the log is there but was not read)."""
        return self._logs.read_checked(log_name)

    def has_records(self, log_name: str) -> bool:
        """See :meth:`DiskRecordLogs.has` (a stat, never a read)."""
        return self._logs.has(log_name)

    def presence(self, ns: Namespace, key: StoreKey) -> Presence:
        """PRESENT if an entry file is there, ABSENT if nothing is (or no regular file, as ``contains``),
        UNKNOWN if the folder cannot be looked into (EACCES, EIO: ``contains`` says False then too)."""
        path = self.path(ns, key)
        try:
            st = os.stat(path)  # as contains (is_file) looks: a link to a file counts
        except (FileNotFoundError, NotADirectoryError):
            return Presence.ABSENT
        except OSError as e:
            log.warning("disk store: cannot look for %s: %s", path, e)
            return Presence.UNKNOWN
        return Presence.PRESENT if stat.S_ISREG(st.st_mode) else Presence.ABSENT

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
        """The namespace's entry files (see :func:`disk_layout.entry_files`)."""
        return entry_files(self.root, ns)

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
        return temp_files(self.root, older_than_s)

    def sweep_temp(self, older_than_s: float = DEFAULT_STALE_TEMP_S) -> int:
        """Remove interrupted writes no byte has reached for ``older_than_s`` (the default: a write in
        progress touches its file with every block, so only killed writers' leftovers go); returns how many."""
        return sweep_temp(self.root, older_than_s)

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
        # killed writers' leftovers only: a write in progress (another namespace's, another process's) renames
        # its temp file after this, and removing it lost that write
        self.sweep_temp()
        if ns is None:  # everything: the record logs too (they only point at entries)
            self._logs.clear()
        return n

