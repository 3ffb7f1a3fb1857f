"""Record logs in Redis: one list per log, ``<prefix>:log:<name>``, one record per element.

The functions take the client (and run inside :class:`blend.store.redis_store.RedisStore`'s outage
handling). Reads are bounded: the server's own size figure is checked first, then the list is read in
pages of ``LOG_PAGE`` records and the bytes counted, so a list larger than ``MAX_LOG_BYTES`` raises
:class:`OversizedLogError` before it is all fetched. Such a list (written before compactions bounded it,
or grown by many appenders between them) is trimmed to its newest records within
``OVERSIZED_KEEP_BYTES`` (:func:`trim_log`): records are self-contained and a later record only overrides
earlier ones, so the newest replay as they did.
"""

from __future__ import annotations

import redis

from blend.store.record_logs import MAX_LOG_BYTES, OVERSIZED_KEEP_BYTES

LOG_PAGE = 1024  # records per LRANGE page of a record-log read
LOG_OVERHEAD_BYTES = 1 << 20  # the server's per-list bookkeeping on top of the records' bytes


class OversizedLogError(Exception):
    """A record log larger than ``MAX_LOG_BYTES`` (it is not read whole: only its newest records)."""

    def __init__(self, size: int) -> None:
        super().__init__(f"record log of {size} bytes")
        self.size = size


def read_log(client: redis.Redis, name: bytes) -> list[bytes]:
    """Every record of the list ``name``, in pages.

    Args:
        client: the server.
        name: the list's key.

    Returns:
        The records in append order (empty when absent).

    Raises:
        OversizedLogError: the list holds more than ``MAX_LOG_BYTES`` (by the server's figure, or counted).
    """
    try:
        size = client.memory_usage(name, samples=0) or 0  # bytes the key holds (0 when absent)
    except redis.ResponseError:  # a Redis-compatible server without MEMORY: the pages still bound it
        size = 0
    if size > MAX_LOG_BYTES + LOG_OVERHEAD_BYTES:
        raise OversizedLogError(size)
    lines: list[bytes] = []
    total, start = 0, 0
    while True:
        page = [bytes(x) for x in client.lrange(name, start, start + LOG_PAGE - 1)]
        total += sum(len(x) for x in page)
        if total > MAX_LOG_BYTES:  # grew after the size check
            raise OversizedLogError(total)
        lines += page
        if len(page) < LOG_PAGE:
            return lines
        start += LOG_PAGE


def trim_log(client: redis.Redis, name: bytes) -> list[bytes]:
    """The newest records of the list ``name`` within ``OVERSIZED_KEEP_BYTES``, read from its end in pages,
    and the list trimmed to them (WATCH + MULTI: an append meanwhile leaves it as it is, for the next read).

    Args:
        client: the server.
        name: the list's key.

    Returns:
        Those records, oldest first.
    """
    kept: list[bytes] = []
    with client.pipeline(transaction=True) as pipe:
        try:
            pipe.watch(name)  # from here until multi() the pipeline's commands run at once
            total, end, full = 0, -1, False
            while not full:
                page = [bytes(x) for x in pipe.lrange(name, end - LOG_PAGE + 1, end)]
                for line in reversed(page):
                    total += len(line)
                    if total > OVERSIZED_KEEP_BYTES:
                        full = True
                        break
                    kept.append(line)
                full = full or len(page) < LOG_PAGE
                end -= LOG_PAGE
            kept.reverse()
            pipe.multi()
            if kept:
                pipe.ltrim(name, -len(kept), -1)
            else:
                pipe.delete(name)
            pipe.execute()
        except redis.WatchError:
            pass
    return kept


def rewrite_log(client: redis.Redis, name: bytes, expected: list[bytes], lines: list[bytes]) -> bool:
    """Replace the list ``name`` with ``lines`` if it still holds exactly ``expected`` (WATCH + MULTI: a
    concurrent RPUSH aborts the swap).

    Args:
        client: the server.
        name: the list's key.
        expected: what the caller read.
        lines: the new records.

    Returns:
        Whether it was replaced.
    """
    with client.pipeline(transaction=True) as pipe:
        try:
            pipe.watch(name)
            if [bytes(x) for x in pipe.lrange(name, 0, -1)] != list(expected):
                return False
            pipe.multi()
            pipe.delete(name)
            if lines:
                pipe.rpush(name, *lines)
            pipe.execute()
            return True
        except redis.WatchError:
            return False
