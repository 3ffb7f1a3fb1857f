"""The intent log of an index folder: ``DIR/kv-intent.jsonl``, chunks whose KV is written before the
commit that adds them.

An ingest appends ``{chunk id: text}`` lines before it writes their KV
(:func:`append_kv_intent`); the commit that adds them removes the log
(:func:`remove_kv_intent`). A run killed in between leaves the log behind, and
the next open queues every noted chunk the index does not hold for garbage
collection, so its KV is never orphaned. The log is this process's own crash
artefact: :func:`read_kv_intent` is lenient (see there); another index's collection reads it with
:func:`intended_texts`, which tells an absent log from one it could not read (as
:func:`read_kv_intent_strict` does) and keeps only the texts asked about.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path

from blend import safeio
from blend.prompt import is_unicode
from blend.retrieval.corpus import RetrievalError
from blend.retrieval.line_reader import lines_of

INTENT_FILE = "kv-intent.jsonl"  # chunks whose KV is written before the commit that adds them
MAX_INTENT_BYTES = 1 << 30  # a longer intent log is not read (its chunks' KV stays until a store prune)

log = logging.getLogger("blend.retrieval.catalog")  # the index folder's logger (the catalog's)


def append_kv_intent(root: Path, chunks: dict[str, str]) -> None:
    """Append chunks to the intent log (not fsynced: it outlives a killed process, not a power loss).

    Args:
        root: the index folder (it exists).
        chunks: chunk id -> text.
    """
    with safeio.append_text(root / INTENT_FILE) as f:
        f.write("\n")  # a line a killed run cut short must not swallow this batch's first one
        for cid, text in chunks.items():
            f.write(json.dumps({cid: text}, ensure_ascii=False) + "\n")


def remove_kv_intent(root: Path) -> None:
    """Remove the intent log, if there is one (every noted chunk is held or queued for collection now).

    Args:
        root: the index folder.
    """
    if os.path.lexists(root / INTENT_FILE):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(root / INTENT_FILE)


def read_kv_intent(root: Path) -> dict[str, str]:
    """The intent log of an index folder (chunk id -> text; empty when there is none). It is this
    process's own crash artefact, so a line cut by a kill, or any line that is not one id and its text,
    is skipped, and an unreadable or oversized log is ignored with a warning (its chunks' KV then stays
    until the store prunes it); it never stops an index from opening.

    Args:
        root: the index folder.

    Returns:
        chunk id -> text, of every well-formed line.
    """
    try:
        return read_kv_intent_strict(root)
    except RetrievalError as e:
        log.warning("%s; KV it noted is left to the store's pruning", e)
        return {}


def read_kv_intent_strict(root: Path) -> dict[str, str]:
    """:func:`read_kv_intent`, but a log that is there and cannot be read (a link, a FIFO, oversized,
    unreadable) is an error, not empty: another index's collection must then keep what it may hold.

    Args:
        root: an index folder.

    Returns:
        Chunk id -> text of every well-formed line (empty when there is no log).

    Raises:
        RetrievalError: the log is there but was not read.
    """
    path = Path(root) / INTENT_FILE
    try:
        raw = safeio.read_regular(path, MAX_INTENT_BYTES)
    except FileNotFoundError:
        return {}
    except OSError as e:  # safeio.UnsafeFileError too: a FIFO, a link, an oversized log
        raise RetrievalError(f"{path}: not read ({e})") from None
    out: dict[str, str] = {}
    # lines end at b"\n" only: a text may hold U+2028, U+0085 ... (JSON leaves them unescaped), at which
    # str.splitlines would cut its line and lose the chunk
    for line in raw.split(b"\n"):
        if (row := _intent_row(line)) is not None:
            out[row[0]] = row[1]
    return out


def intended_texts(root: Path, texts: set[str]) -> set[str]:
    """Which of ``texts`` the intent log of another index notes, read a line at a time (memory bounded by
    the longest of ``texts``, not by the log; a line too long to note any is passed over, as
    :func:`read_kv_intent_strict` skips a line that is no row).

    Args:
        root: an index folder.
        texts: the texts asked about.

    Returns:
        Those of ``texts`` it notes (none when there is no log).

    Raises:
        RetrievalError: the log is there but was not read (a link, a FIFO, oversized, unreadable).
    """
    path = Path(root) / INTENT_FILE
    held: set[str] = set()
    try:
        for _, line in lines_of(path, MAX_INTENT_BYTES, texts):
            if (row := _intent_row(line)) is not None and row[1] in texts:
                held.add(row[1])
    except FileNotFoundError:
        return set()
    except OSError as e:  # safeio.UnsafeFileError too
        raise RetrievalError(f"{path}: not read ({e})") from None
    return held


def _intent_row(line: bytes) -> tuple[str, str] | None:
    """(chunk id, text) of an intent log line; None for a line that is not one."""
    try:
        row = json.loads(line.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError; nesting too deep
        return None
    if isinstance(row, dict) and len(row) == 1:
        (cid, text), = row.items()
        if isinstance(text, str) and is_unicode(cid) and is_unicode(text):  # no lone surrogate (unwritable)
            return cid, text
    return None
