"""Redis tier: entries as blobs (codec.py) in a Redis-compatible server.

Keys are ``<prefix>:<namespace>:<key hex>``, so namespaces never share a key
and several deployments can share a server under different prefixes. A SET
is atomic: concurrent writers of one key leave one complete blob.

Reads are bounded: a lookup first fetches the value's length and its first
``HEADER_PROBE`` bytes (one pipelined round trip), checks the length against
the header's claim and ``max_entry_bytes``, and only then GETs the value (a
second round trip), so a hostile value is rejected before it is allocated. Every
call is bounded in time too: one not done within the socket timeout plus its
bytes at ``min_rate`` finds the server down (``redis_link.py``).

The store is a cache, so an unreachable server is a miss, never an error: the
connection and its outage handling are in ``redis_link.py``, the record logs
in ``redis_logs.py``.
"""

from __future__ import annotations

import logging
import threading
from typing import Iterator

from blend.defaults import (
    DEFAULT_REDIS_CONNECT_TIMEOUT_S,
    DEFAULT_REDIS_MIN_RATE,
    DEFAULT_REDIS_RETRY_AFTER_S,
    DEFAULT_REDIS_SOCKET_TIMEOUT_S,
)
from blend.keys import Namespace, StoreKey, key_hex
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
from blend.store.redis_link import RedisLink
from blend.store.redis_logs import RedisRecordLogs

log = logging.getLogger(__name__)
HEADER_PROBE = 4096  # bytes fetched with the length; a real header is ~1 KB

_HEX_DIGITS = frozenset(b"0123456789abcdef")  # key_hex's digits (bytes iterate as ints)


class RedisStore:
    """Entries in Redis under ``prefix``.

    Args:
        url: ``redis://HOST:PORT/DB`` (any URL redis-py accepts).
        prefix: first component of every key.
        ttl_s: expiry of each entry in seconds (None: no expiry).
        connect_timeout_s: TCP connect timeout; a dead host costs at most this.
        socket_timeout_s: per-read/write timeout on an established connection.
        retry_after_s: after a failure, calls skip the server for this long.
        min_rate: bytes/s; a call that moves n bytes and is not done within ``socket_timeout_s`` plus
            n / ``min_rate`` seconds finds the server down (a lookup waits no longer for a slow server).
        max_entry_bytes: the largest value read or written (a larger one is
            rejected before it is fetched).
    """

    name = "redis"

    def __init__(
        self,
        url: str,
        prefix: str = "kvblend",
        ttl_s: int | None = None,
        *,
        connect_timeout_s: float = DEFAULT_REDIS_CONNECT_TIMEOUT_S,
        socket_timeout_s: float = DEFAULT_REDIS_SOCKET_TIMEOUT_S,
        retry_after_s: float = DEFAULT_REDIS_RETRY_AFTER_S,
        min_rate: float = DEFAULT_REDIS_MIN_RATE,
        max_entry_bytes: int = MAX_ENTRY_BYTES,
    ) -> None:
        if ttl_s is not None and ttl_s < 1:  # Redis refuses SET ... EX 0 (and below): every put would fail
            raise ValueError(f"ttl_s must be at least 1 second (or None: no expiry), got {ttl_s}")
        self.max_entry_bytes = max_entry_bytes
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.retry_after_s = retry_after_s
        self._stats = StoreStats()
        self._lock = threading.Lock()
        self._link = RedisLink(url, self._stats, self._lock, connect_timeout_s=connect_timeout_s,
                               socket_timeout_s=socket_timeout_s, retry_after_s=retry_after_s, min_rate=min_rate)
        self.url = self._link.url  # what logs and messages show: the password never leaves the process
        self._logs = RedisRecordLogs(self._link, prefix)

    @property
    def available(self) -> bool:
        """False while in the back-off window after a failure."""
        return self._link.available

    # -- record logs (RecordLog; kept in redis_logs.py) ----------------------

    def append_record(self, log_name: str, line: bytes) -> None:
        """Append one record to the log ``log_name`` (see :meth:`RedisRecordLogs.append`)."""
        self._logs.append(log_name, line)

    def rewrite_records(self, log_name: str, expected: list[bytes], lines: list[bytes]) -> bool:
        """Replace the log's records if it still holds ``expected`` (see :meth:`RedisRecordLogs.rewrite`)."""
        return self._logs.rewrite(log_name, expected, lines)

    def read_records(self, log_name: str) -> list[bytes]:
        """Every record of the log, bounded (see :meth:`RedisRecordLogs.read`)."""
        return self._logs.read(log_name)

    def read_records_checked(self, log_name: str) -> list[bytes] | None:
        """See :meth:`RedisRecordLogs.read_checked` (None: the list was not read whole)."""
        return self._logs.read_checked(log_name)

    def has_records(self, log_name: str) -> bool:
        """Whether the log exists (False while the server is down; see :meth:`RedisRecordLogs.has`)."""
        return self._logs.has(log_name)

    # -- KVStore --------------------------------------------------------------

    def rkey(self, ns: Namespace, key: StoreKey) -> bytes:
        """The Redis key of (ns, key)."""
        return f"{self.prefix}:{ns.value}:{key_hex(key)}".encode()

    def _count(self, field: str) -> None:
        with self._lock:
            setattr(self._stats, field, getattr(self._stats, field) + 1)

    def _head(self, rk: bytes, what: str) -> tuple[int, bytes] | None:
        """(length, first header bytes) of a value whose header parses; None if absent or down.

        Raises:
            EntryError: not a string value, or a header that does not parse.
        """
        def probe() -> list:
            pipe = self._link.client.pipeline(transaction=False)
            pipe.exists(rk)
            pipe.strlen(rk)
            pipe.getrange(rk, 0, HEADER_PROBE - 1)
            return pipe.execute(raise_on_error=False)

        got = self._link.call(what, probe, None, nbytes=HEADER_PROBE)
        if got is None or not got[0]:
            return None
        if isinstance(got[1], Exception) or isinstance(got[2], Exception):  # e.g. WRONGTYPE: a list at the key
            raise EntryError(EntryErrorKind.NOT_A_BLOB, f"the value is not a string ({got[1] if isinstance(got[1], Exception) else got[2]})")
        size, head = int(got[1]), bytes(got[2])
        start = header_length(head)
        if start > len(head) and size >= start:  # a header longer than the probe (never written by put)
            head += bytes(self._link.call(what, lambda: self._link.client.getrange(rk, len(head), start - 1), b"",
                                          nbytes=start) or b"")
        return size, head[:start]

    def _fetch(self, ns: Namespace, key: StoreKey) -> bytes | None:
        """The value, fetched only after its size was checked against its header and the cap.

        Returns:
            The blob; None if absent or the server is down.

        Raises:
            EntryError: not a string, bad header, size differs from the claim or over the cap.
        """
        rk = self.rkey(ns, key)
        head = self._head(rk, "get")
        if head is None:
            return None
        size, header = head
        hdr, _, start = decode_header(header)
        want = check_size(hdr, start, size, self.max_entry_bytes)
        # bounded: GETRANGE of at most want + 1 bytes, never a GET of whatever the value became since
        # the probe (another writer may SET a larger one between the round trips); one byte more than
        # claimed tells a value that grew from the one probed
        blob = self._link.call("get", lambda: self._link.client.getrange(rk, 0, want), None, nbytes=want + 1)
        if blob is None:
            return None  # the server went down
        if not isinstance(blob, (bytes, bytearray, memoryview)):
            raise EntryError(EntryErrorKind.NOT_A_BLOB, f"GETRANGE returned {type(blob).__name__}")
        if len(blob) == 0:
            return None  # deleted since the probe
        if len(blob) != want:
            raise EntryError(EntryErrorKind.TRUNCATED if len(blob) < want else EntryErrorKind.SHAPE,
                             f"the value changed while read: {len(blob)}{'+' if len(blob) > want else ''} bytes, "
                             f"its header claimed {want}")
        return blob if isinstance(blob, bytes) else bytes(blob)

    def get(self, ns: Namespace, key: StoreKey, provenance: str) -> Lookup:
        try:
            blob = self._fetch(ns, key)
            if blob is None:
                self._count("misses")
                return Lookup(LookupStatus.MISS, tier=self.name)
            entry = decode(bytearray(blob), ns, key, self.max_entry_bytes)
            why = check_entry(entry, provenance)
        except EntryError as e:
            why = str(e)
        if not why:
            self._count("hits")
            return Lookup(LookupStatus.HIT, entry=entry, tier=self.name)
        self._count("rejected")
        log.warning("redis store: rejected %s: %s", self.rkey(ns, key).decode(), why)
        return Lookup(LookupStatus.REJECTED, reason=why, tier=self.name)

    def put(self, ns: Namespace, key: StoreKey, entry: KVEntry) -> None:
        """SET the blob (with the TTL); a failure (the server down, or refusing the write) is
        logged and counted (``put_errors``), not raised."""
        check_put(entry)
        if entry.nbytes + 8 + MAX_HEADER_BYTES > self.max_entry_bytes:  # it might not be read back
            log.warning("redis store: entry of %d bytes may exceed max_entry_bytes=%d; not stored",
                        entry.nbytes, self.max_entry_bytes)
            return
        blob = b"".join(encode_parts(ns, key, entry))
        ok = self._link.call("put", lambda: self._link.client.set(self.rkey(ns, key), blob, ex=self.ttl_s), None,
                             nbytes=len(blob))
        if ok:
            self._count("puts")
        else:
            with self._lock:
                self._stats.extra["put_errors"] = self._stats.extra.get("put_errors", 0) + 1

    def put_raw(self, ns: Namespace, key: StoreKey, blob: bytes) -> None:
        """Store arbitrary bytes under (ns, key): for tests and repair tools only."""
        self._link.call("put", lambda: self._link.client.set(self.rkey(ns, key), blob, ex=self.ttl_s), None,
                        nbytes=len(blob))

    def contains(self, ns: Namespace, key: StoreKey) -> bool:
        return bool(self._link.call("exists", lambda: self._link.client.exists(self.rkey(ns, key)), 0))

    def presence(self, ns: Namespace, key: StoreKey) -> Presence:
        """PRESENT or ABSENT as the server answers; UNKNOWN while it is down (``contains`` says False then)."""
        found = self._link.call("exists", lambda: self._link.client.exists(self.rkey(ns, key)), None)
        return Presence.UNKNOWN if found is None else Presence.PRESENT if found else Presence.ABSENT

    def delete(self, ns: Namespace, key: StoreKey) -> bool:
        return bool(self._link.call("delete", lambda: self._link.client.delete(self.rkey(ns, key)), 0))

    def _rkeys(self, ns: Namespace) -> list[bytes]:
        """The namespace's entry keys: exactly ``<prefix>:<ns>:`` and 64 lowercase hex digits (the glob also
        matches another deployment's keys whose prefix extends this one's, e.g. ``team:exact:exact:<hex>``)."""
        head = f"{self.prefix}:{ns.value}:".encode()  # bytes: a non-ASCII prefix is longer in bytes than in characters
        found = self._link.scan(f"{self.prefix}:{ns.value}:")
        return [rk for rk in found if len(rk) == len(head) + 64 and rk.startswith(head)
                and all(c in _HEX_DIGITS for c in rk[len(head):])]

    def keys(self, ns: Namespace) -> Iterator[StoreKey]:
        head = len(f"{self.prefix}:{ns.value}:".encode())
        for rk in self._rkeys(ns):
            yield StoreKey(bytes.fromhex(rk[head:].decode()))

    def counters(self) -> StoreStats:
        with self._lock:
            s = counters_of(self._stats)
        s.extra["available"] = float(self.available)
        return s

    def stats(self) -> StoreStats:
        with self._lock:
            s = StoreStats(**{**self._stats.__dict__, "extra": dict(self._stats.extra)})
        for ns in Namespace:
            rks = self._rkeys(ns)
            if not rks:
                continue

            def sizes(rks: list[bytes] = rks) -> list[int]:
                pipe = self._link.client.pipeline(transaction=False)
                for rk in rks:
                    pipe.strlen(rk)
                # a key holding another type (WRONGTYPE) answers with an error: skip it, not the namespace
                return [n for n in pipe.execute(raise_on_error=False) if isinstance(n, int)]

            lengths = self._link.call("stats", sizes, [], nbytes=None)
            s.entries += sum(1 for n in lengths if n)
            s.bytes += sum(lengths)
        s.extra["available"] = float(self.available)
        return s

    # -- inspection -----------------------------------------------------------

    def info(self, ns: Namespace, key: StoreKey) -> EntryInfo | None:
        head = self._head(self.rkey(ns, key), "info")
        if head is None:
            return None
        size, header = head
        hdr, _, start = decode_header(header)
        check_size(hdr, start, size, self.max_entry_bytes)
        return EntryInfo(ns, key, hdr.provenance, hdr.shape, hdr.dtype, size)

    def verify(self, ns: Namespace, key: StoreKey) -> Verdict:
        try:
            blob = self._fetch(ns, key)
            if blob is None:
                return ABSENT
            return Verdict.of(entry_problem(decode(bytearray(blob), ns, key, self.max_entry_bytes)))
        except EntryError as e:
            return Verdict.of(str(e) or "invalid entry")

    def check_reachable(self) -> str:
        """'' if the server answers PING and no call failed since the last check, else why not."""
        return self._link.check_reachable()

    def clear(self, ns: Namespace | None = None) -> int:
        n = 0
        for space in [ns] if ns is not None else list(Namespace):
            rks = self._rkeys(space)
            for i in range(0, len(rks), 1000):
                batch = rks[i : i + 1000]
                n += int(self._link.call("clear", lambda b=batch: self._link.client.delete(*b), 0, nbytes=None))
        if ns is None:  # everything: the record logs too (they only point at entries)
            self._logs.clear()
        return n

    def close(self) -> None:
        self._link.close()
