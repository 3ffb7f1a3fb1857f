"""A disk store's byte budget: the shared tally, the folder's scans and the least-recently-used prune.

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
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from blend import safeio
from blend.defaults import DEFAULT_STALE_TEMP_S
from blend.keys import Namespace
from blend.store.disk_layout import entry_files, sweep_temp

log = logging.getLogger("blend.store.disk")  # the disk tier's one logger, wherever its code lives

LOW_WATER = 0.9  # a prune frees down to this fraction of the budget
TALLY_FILE = "budget.tally"  # bytes put by every process sharing the folder (8 bytes, little-endian, flock)


@dataclass(frozen=True)
class PruneResult:
    """What a prune removed and what is left."""

    removed: int
    freed_bytes: int
    kept_bytes: int


class DiskBudget:
    """The bytes in one disk store's folder as its budget sees them, and the prune that keeps them under it.

    The store owns one and counts the entries each prune removes (its ``evictions``).

    Args:
        root: the store's folder (every namespace's entries, and the shared tally ``TALLY_FILE``).
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self._lock = threading.Lock()
        self._approx_bytes: int | None = None  # bytes on disk as of the last scan plus every process's puts
        self._scan_total = 0  # bytes on disk at the last scan (after its prune)
        self._tally_at_scan = 0  # the shared tally (:meth:`_tally`) when that scan began
        self._scanned_at = 0.0  # time.monotonic() of that scan

    def after_put(self, size: int, budget: int, rescan_s: float) -> PruneResult | None:
        """Count a put's bytes; scan the folder, pruning it if over ``budget``, when the estimate says over
        it or the last scan is older than ``rescan_s``.

        Args:
            size: bytes of the file just written.
            budget: the store's byte budget.
            rescan_s: the age (seconds) past which the last scan is not trusted.

        Returns:
            The scan's prune (see :meth:`_recount`), None when no scan was due.
        """
        tally = self._tally(size)  # every process's puts, this one's included
        with self._lock:
            if self._approx_bytes is None or time.monotonic() - self._scanned_at >= rescan_s:
                recount = True  # the first put, or a scan too old to trust
            else:
                # the last scan plus every process's puts since (an overwrite adds bytes it did not add, a
                # removal elsewhere is not subtracted: the estimate errs high, and only a scan prunes)
                grown = tally - self._tally_at_scan if tally is not None else size
                self._approx_bytes = self._scan_total + max(grown, size)
                recount = self._approx_bytes > budget
        if recount:
            return self._recount(budget)
        return None

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

    def _recount(self, budget: int) -> PruneResult:
        """Scan the folder (includes the file just written, and other processes' files); prune down to
        the low-water mark only if the scan is over ``budget``. Killed writers' stale temp files go first:
        they are bytes on disk that no entry count sees."""
        sweep_temp(self.root, DEFAULT_STALE_TEMP_S)
        tally = self._tally()  # read before the listing: a put landing during it is counted again (errs high)
        with self._lock:
            self._tally_at_scan = tally if tally is not None else 0
        rows = self.entries_by_age()
        if sum(size for _, size, _ in rows) > budget:
            return self.prune_rows(rows, int(budget * LOW_WATER))
        return self.prune_rows(rows, budget)  # removes nothing: records the scan

    def entries_by_age(self) -> list[tuple[float, int, Path]]:
        """(mtime, size, path) of every entry file, least recently used first.

        Returns:
            One row per entry file of every namespace, oldest mtime first (ties by path).
        """
        rows = []
        for ns in Namespace:
            for p in entry_files(self.root, ns):
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
        sweep_temp(self.root, DEFAULT_STALE_TEMP_S)  # killed writers' leftovers (see _recount)
        return self.prune_rows(self.entries_by_age(), max_bytes)

    def prune_rows(self, rows: list[tuple[float, int, Path]], max_bytes: int) -> PruneResult:
        """:meth:`prune` over a scan's ``rows`` (:meth:`entries_by_age`); records the scan's total.

        Args:
            rows: (mtime, size, path) of the entry files, least recently used first.
            max_bytes: bytes to keep (>= 0).

        Returns:
            How many entries were removed, the bytes freed and the bytes kept.
        """
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
        if removed:
            log.info("disk store: pruned %d entries (%d bytes) under %s", removed, freed, self.root)
        return PruneResult(removed, freed, total)
