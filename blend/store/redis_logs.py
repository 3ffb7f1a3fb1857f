"""Record logs in Redis: one list per log, ``<prefix>:log:<name>``, one record per element.

Appends are an RPUSH (atomic, so concurrent appenders interleave whole
records); a rewrite (compaction) is a compare-and-swap under WATCH + MULTI, so
a concurrent append aborts it and no record is lost. A log is untrusted data:
none larger than ``MAX_LOG_BYTES`` is read whole (the server's size figure is
checked first, then the list is read in pages). Such a list (written before
compactions bounded it, or grown by many appenders between them) is trimmed to
its newest records within ``OVERSIZED_KEEP_BYTES`` (:func:`trim_log`; the server
measures the records, so none is read to learn that it does not fit): records
are self-contained and a later record only overrides earlier ones, so the newest
replay as they did. A rewrite reads no more than the records it expects.
Failures are logged, never raised: the logs only point at entries of a cache.
The disk tier's logs are in ``record_logs.py``.
"""

from __future__ import annotations

import redis

from blend.store.record_logs import MAX_LOG_BYTES, OVERSIZED_KEEP_BYTES
from blend.store.redis_link import RedisLink, RefusedData, log

LOG_PAGE = 1024  # records per LRANGE page of a record-log read
LOG_OVERHEAD_BYTES = 1 << 20  # the server's per-list bookkeeping on top of the records' bytes


class OversizedLogError(RefusedData):
    """A record log larger than ``MAX_LOG_BYTES`` (it is not read whole: only its newest records)."""

    def __init__(self, size: int) -> None:
        super().__init__(f"record log of {size} bytes")
        self.size = size


class RedisRecordLogs:
    """The record logs of one Redis store.

    Args:
        link: the store's connection (its outage handling covers the logs too).
        prefix: the store's key prefix.
    """

    def __init__(self, link: RedisLink, prefix: str) -> None:
        self.link = link
        self.prefix = prefix

    def key(self, name: str) -> bytes:
        """``<prefix>:log:<name>``; a name holds no colon, so no other deployment's key reads as one of
        this store's logs (``clear`` tells them apart by that: see :meth:`keys`).

        Args:
            name: the log's name.

        Returns:
            The list's Redis key.

        Raises:
            ValueError: a name with a colon (or an empty one).
        """
        if not name or ":" in name:
            raise ValueError(f"bad record log name {name!r} (a plain name without ':')")
        return f"{self.prefix}:log:{name}".encode()

    def keys(self) -> list[bytes]:
        """This store's record logs: ``<prefix>:log:`` then a name without a colon. The glob also matches
        every key of a deployment whose prefix extends ``<prefix>:log`` (``kvb:log:exact:<hex>``,
        ``kvb:log:log:<name>``, ``kvb:log:x:...``): each holds a colon past ``<prefix>:log:``."""
        head = f"{self.prefix}:log:".encode()
        found = self.link.scan(f"{self.prefix}:log:")
        return [rk for rk in found if rk.startswith(head) and len(rk) > len(head) and b":" not in rk[len(head):]]

    def append(self, name: str, line: bytes) -> None:
        """Append one record to the list ``<prefix>:log:<name>`` (RPUSH; no TTL: logs are tiny)."""
        rk = self.key(name)
        self.link.call("append_record", lambda: self.link.client.rpush(rk, line), None, nbytes=len(line))

    def rewrite(self, name: str, expected: list[bytes], lines: list[bytes]) -> bool:
        """Replace the list with ``lines`` if it still holds exactly ``expected``
        (WATCH + MULTI: a concurrent RPUSH aborts the swap). Returns whether it was replaced.

        The list is compared without reading more than ``expected``'s bytes: its length first, then the
        server's size figure, then page by page (another writer may have pushed a huge record since)."""
        rk = self.key(name)

        def swap() -> bool:
            with self.link.client.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(rk)
                    if not _holds(pipe, rk, expected):
                        return False
                    pipe.multi()
                    pipe.delete(rk)
                    if lines:
                        pipe.rpush(rk, *lines)
                    pipe.execute()
                    return True
                except redis.WatchError:
                    return False

        moved = sum(map(len, expected)) + sum(map(len, lines))
        return bool(self.link.call("rewrite_records", swap, False, nbytes=moved))

    def read(self, name: str) -> list[bytes]:
        """Every record of the list (empty when absent or the server is down: it is read in pages, and
        the server's own size figure is checked before the first). A list holding more than
        ``MAX_LOG_BYTES`` is trimmed to its newest records (:func:`trim_log`), with a warning that older
        records were dropped, and those are returned."""
        return self._read(name)[0]

    def read_checked(self, name: str) -> list[bytes] | None:
        """:meth:`read`, but None when the list was not read whole: the server is down or refused the call,
        or the list was oversized (trimmed now, its older records dropped)."""
        lines, whole = self._read(name)
        return lines if whole else None

    def _read(self, name: str) -> tuple[list[bytes], bool]:
        """(:meth:`read`'s records, whether they are the whole list)."""
        rk = self.key(name)
        client = self.link.client

        def bounded() -> list[bytes]:
            try:
                size = client.memory_usage(rk, samples=0) or 0  # bytes the key holds (0 when absent)
            except redis.ResponseError:  # a Redis-compatible server without MEMORY: the pages still bound it
                size = 0
            if size > MAX_LOG_BYTES + LOG_OVERHEAD_BYTES:
                raise OversizedLogError(size)
            lines: list[bytes] = []
            total, start = 0, 0
            while True:
                page = [bytes(x) for x in client.lrange(rk, start, start + LOG_PAGE - 1)]
                total += sum(len(x) for x in page)
                if total > MAX_LOG_BYTES:  # grew after the size check
                    raise OversizedLogError(total)
                lines += page
                if len(page) < LOG_PAGE:
                    return lines
                start += LOG_PAGE

        try:
            got = self.link.call("read_records", bounded, None, nbytes=MAX_LOG_BYTES)
        except OversizedLogError as e:
            kept = self.link.call("read_records", lambda: trim_log(client, rk), [], nbytes=OVERSIZED_KEEP_BYTES)
            log.warning("redis store %s: log %s holds %d bytes, over %d: kept its newest %d records; older records "
                        "were dropped", self.link.url, name, e.size, MAX_LOG_BYTES, len(kept))
            return kept, False
        return ([], False) if got is None else (got, True)

    def has(self, name: str) -> bool:
        """Whether the list ``<prefix>:log:<name>`` exists (False while the server is down)."""
        rk = self.key(name)
        return bool(self.link.call("has_records", lambda: self.link.client.exists(rk), 0))

    def clear(self) -> None:
        """Delete every record log of this store."""
        logs = self.keys()
        if logs:
            self.link.call("clear", lambda: self.link.client.delete(*logs), 0, nbytes=None)


def _holds(pipe: redis.client.Pipeline, rk: bytes, expected: list[bytes]) -> bool:
    """Whether the list ``rk`` holds exactly ``expected``, read in pages and at most ``expected``'s bytes
    (plus one page's difference: a page is compared before the next is read)."""
    if pipe.llen(rk) != len(expected):
        return False
    want = sum(map(len, expected))
    try:
        size = pipe.memory_usage(rk, samples=0) or 0
    except redis.ResponseError:  # a Redis-compatible server without MEMORY: the pages' lengths still tell
        size = 0
    if size > want + LOG_OVERHEAD_BYTES:
        return False
    for start in range(0, len(expected), LOG_PAGE):
        if [bytes(x) for x in pipe.lrange(rk, start, start + LOG_PAGE - 1)] != expected[start : start + LOG_PAGE]:
            return False
    return True


# the lengths of a list's elements ARGV[1]..ARGV[2] (negative indices, oldest first), measured by the server:
# an element is never sent to learn whether it fits
_LENGTHS = """
local n = redis.call('LLEN', KEYS[1])
local out = {}
for i = tonumber(ARGV[1]), tonumber(ARGV[2]) do
  if -i <= n then out[#out + 1] = string.len(redis.call('LINDEX', KEYS[1], i)) end
end
return out
"""


def _newest_within(pipe: redis.client.Pipeline, name: bytes, budget: int) -> int:
    """How many of the list's newest records fit in ``budget`` bytes together, measured by the server."""
    count, total, end = 0, 0, -1
    while True:
        lengths = [int(n) for n in pipe.eval(_LENGTHS, 1, name, end - LOG_PAGE + 1, end)]
        for n in reversed(lengths):
            if total + n > budget:
                return count
            total += n
            count += 1
        if len(lengths) < LOG_PAGE:
            return count
        end -= LOG_PAGE


def trim_log(client: redis.Redis, name: bytes) -> list[bytes]:
    """The newest records of the list ``name`` within ``OVERSIZED_KEEP_BYTES``, and the list trimmed to them
    (WATCH + MULTI: an append meanwhile leaves it as it is, for the next read).

    The server measures the records from the end (a script), so only the kept ones are read: a list of a few
    huge records (written by another process, or a hostile one) was read whole, page by page, to find that
    none fit. A server that runs no scripts has the list deleted instead (its records only point at entries).

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
            try:
                count = _newest_within(pipe, name, OVERSIZED_KEEP_BYTES)
            except redis.ResponseError as e:  # scripting off (or another type at the key): nothing is kept
                log.warning("redis store: cannot measure the records of %r (%s); deleting it", name, e)
                count = 0
            for start in range(-count, 0, LOG_PAGE):
                kept += [bytes(x) for x in pipe.lrange(name, start, min(start + LOG_PAGE, 0) - 1)]
            pipe.multi()
            if kept:
                pipe.ltrim(name, -len(kept), -1)
            else:
                pipe.delete(name)
            pipe.execute()
        except redis.WatchError:
            pass
    return kept
