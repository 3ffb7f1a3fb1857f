"""Where a disk store's files lie, and walking them without leaving the store.

Layout under ``root``::

    root/<namespace>/<key hex[:2]>/<key hex>.safetensors     entries (see codec.py)
    root/<namespace>/<key hex[:2]>/.<key hex>.<random>.tmp   a write in progress
    root/logs/<name>.jsonl                                   record logs (e.g. semantic donors; record_logs.py)

Listing, pruning, clearing and the temp sweep walk only the shard folders that
resolve inside the store: a symlinked folder never leads them out of it.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from pathlib import Path
from typing import Iterator

from blend import safeio
from blend.keys import Namespace

log = logging.getLogger("blend.store.disk")  # the disk tier's one logger, wherever its code lives

SUFFIX = ".safetensors"
TMP_SUFFIX = safeio.TMP_SUFFIX  # abandoned temp files (a crash mid-put) are swept by this suffix


def leads_inside(root: Path, folder: Path) -> bool:
    """Whether ``folder`` resolves inside the store (not through a symlinked folder to elsewhere).

    Args:
        root: the store's folder.
        folder: a folder in it (it need not exist).

    Returns:
        True when ``folder``'s real path lies under ``root``'s.
    """
    real_root = os.path.realpath(root)
    return os.path.commonpath([real_root, os.path.realpath(folder)]) == real_root


def _shards(root: Path, ns: Namespace) -> Iterator[Path]:
    """The namespace's two-hex-digit folders that resolve inside the store: listing, pruning and
    clearing never follow a symlinked folder out of it (they would delete files that are not the store's)."""
    base = root / ns.value
    if not base.is_dir() or not leads_inside(root, base / "x"):
        return
    for d in base.glob("??"):
        if d.is_dir() and not d.is_symlink() and leads_inside(root, d / "x"):
            yield d


def entry_files(root: Path, ns: Namespace) -> Iterator[Path]:
    """The entry files of one namespace, in the shard folders that resolve inside the store.

    Args:
        root: the store's folder.
        ns: the namespace listed.

    Yields:
        Each ``*.safetensors`` path (listed lazily, shard by shard).
    """
    for shard in _shards(root, ns):
        yield from shard.glob(f"*{SUFFIX}")


def temp_files(root: Path, older_than_s: float = 0.0) -> list[Path]:
    """Leftovers of interrupted writes (never read as entries).

    Args:
        root: the store's folder.
        older_than_s: only temp files no byte has reached for this long (seconds).

    Returns:
        Their paths, every namespace's.
    """
    now = time.time()
    found = []
    for ns in Namespace:
        for shard in _shards(root, ns):
            for p in shard.glob(f".*{TMP_SUFFIX}"):
                try:
                    if now - p.lstat().st_mtime >= older_than_s:
                        found.append(p)
                except FileNotFoundError:
                    continue
    return found


def sweep_temp(root: Path, older_than_s: float) -> int:
    """Remove interrupted writes no byte has reached for ``older_than_s`` (a write in progress touches its
    file with every block, so with ``DEFAULT_STALE_TEMP_S`` only killed writers' leftovers go).

    Args:
        root: the store's folder.
        older_than_s: the age (seconds since the last byte) from which a temp file is removed.

    Returns:
        How many were removed.
    """
    n = 0
    for p in temp_files(root, older_than_s):
        try:
            if not stat.S_ISREG(p.lstat().st_mode):  # a directory or link under a temp name: not ours
                continue
            safeio.unlink_beneath(root, p)
            n += 1
        except FileNotFoundError:
            pass
        except OSError as e:  # another user's file in a shared folder: it stays, the sweep goes on
            log.warning("disk store: cannot remove the stale temp file %s: %s", p, e)
    return n
