"""Redis tier: entries as blobs (codec.py) in a Redis-compatible server.

Keys are ``<prefix>:<namespace>:<key hex>``, so namespaces never share a key
and several deployments can share a server under different prefixes. A SET
is atomic: concurrent writers of one key leave one complete blob.

Reads are bounded: a lookup first fetches the value's length and its first
``HEADER_PROBE`` bytes (one pipelined round trip), checks the length against
the header's claim and ``max_entry_bytes``, and only then GETs the value (a
second round trip), so a hostile value is rejected before it is allocated.

The store is a cache, so an unreachable server is a miss, never an error::

    up ──(connection error / timeout)──► down: warn once, every call returns
     ▲                                   MISS / no-op without touching the network
     └────(first call after retry_after_s succeeds: log "reachable again")
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Callable, Iterator, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

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
from blend.store.record_logs import MAX_LOG_BYTES
from blend.store.redis_logs import OversizedLogError, read_log, rewrite_log, trim_log

REFUSAL_LOG_S = 600  # a refusal (a full server) is logged again after this long, once per cause
log = logging.getLogger(__name__)

T = TypeVar("T")
HEADER_PROBE = 4096  # bytes fetched with the length; a real header is ~1 KB


def redacted_url(url: str) -> str:
    """``url`` with its password replaced by ``***``: the ``user:PASS@`` part and a ``?password=`` argument
    (redis-py logs in with either).

    Args:
        url: a Redis URL.

    Returns:
        The URL as logs and messages may show it.
    """
    try:
        parts = urlsplit(url)
        out = url
        if parts.password is not None:
            host = parts.hostname or ""
            host = f"[{host}]" if ":" in host else host  # an IPv6 address keeps its brackets
            netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port is not None else "")
            out = urlunsplit(parts._replace(netloc=netloc))
        if parts.query:  # the rest of the URL as written (urlunsplit would respell unix:///path as unix:/path)
            query = "&".join(f"{pair.partition('=')[0]}=***" if pair.partition("=")[0].lower() == "password"
                             else pair for pair in parts.query.split("&"))
            out = out.replace("?" + parts.query, "?" + query, 1)
        return out
    except ValueError:  # a port that is not a number, brackets: show nothing of it rather than a secret
        return "redis://<unparsable url>"


_HEX_DIGITS = frozenset(b"0123456789abcdef")  # key_hex's digits (bytes iterate as ints)


def _glob_escape(s: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in s)


class RedisStore:
    """Entries in Redis under ``prefix``.

    Args:
        url: ``redis://HOST:PORT/DB`` (any URL redis-py accepts).
        prefix: first component of every key.
        ttl_s: expiry of each entry in seconds (None: no expiry).
        connect_timeout_s: TCP connect timeout; a dead host costs at most this.
        socket_timeout_s: per-read/write timeout on an established connection.
        retry_after_s: after a failure, calls skip the server for this long.
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
        connect_timeout_s: float = 0.2,
        socket_timeout_s: float = 2.0,
        retry_after_s: float = 5.0,
        max_entry_bytes: int = MAX_ENTRY_BYTES,
    ) -> None:
        if ttl_s is not None and ttl_s < 1:  # Redis refuses SET ... EX 0 (and below): every put would fail
            raise ValueError(f"ttl_s must be at least 1 second (or None: no expiry), got {ttl_s}")
        self.url = redacted_url(url)  # what logs and messages show: the password never leaves the process
        self.max_entry_bytes = max_entry_bytes
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.retry_after_s = retry_after_s
        self._client = redis.Redis.from_url(
            url,
            socket_connect_timeout=connect_timeout_s,
            socket_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
            health_check_interval=0,
            protocol=2,  # RESP2: no HELLO handshake, so Redis < 6 and other Redis-compatible servers work
            socket_read_size=1 << 20,  # entries are tens of MB: fewer, larger reads
        )
        self._stats = StoreStats()
        self._lock = threading.Lock()
        self._down_until = 0.0  # time.monotonic() before which the server is skipped
        self._outage = False
        self._failed_calls = 0  # calls that failed or were skipped since the last check_reachable()
        # (call, error kind) the server refused -> when it was last logged: once per cause every REFUSAL_LOG_S
        self._refusals: dict[tuple[str, str], float] = {}

    # -- availability ---------------------------------------------------------

    @property
    def available(self) -> bool:
        """False while in the back-off window after a failure."""
        with self._lock:
            return time.monotonic() >= self._down_until

    def _call(self, what: str, fn: Callable[[], T], default: T) -> T:
        """Run ``fn`` against the server; on an outage warn once and return ``default``."""
        if not self.available:
            with self._lock:
                self._stats.extra["skipped_calls"] = self._stats.extra.get("skipped_calls", 0) + 1
                self._failed_calls += 1
            return default
        try:
            result = fn()
        except OversizedLogError:  # the server answered; the data is refused, not the server
            raise
        except redis.ResponseError as e:  # the server answered with an error: not an outage
            cause = (what, str(e).split(" ", 1)[0])  # e.g. ("put", "OOM"): at maxmemory every put is refused
            now = time.monotonic()
            with self._lock:
                self._stats.extra["refused_calls"] = self._stats.extra.get("refused_calls", 0) + 1
                first = now - self._refusals.get(cause, -math.inf) >= REFUSAL_LOG_S
                if first:
                    self._refusals[cause] = now
            if first:  # once per cause and period: a full server would log one line per chunk
                log.warning("redis store %s: %s failed: %s (calls refused the same way in the next %d s are "
                            "counted in refused_calls, not logged)", self.url, what, e, REFUSAL_LOG_S)
            else:
                log.debug("redis store %s: %s failed: %s", self.url, what, e)
            return default
        except Exception as e:  # noqa: BLE001 -- connection loss, timeouts, or a server redis-py cannot parse
            with self._lock:
                self._down_until = time.monotonic() + self.retry_after_s
                self._failed_calls += 1
                first = not self._outage
                self._outage = True
                self._stats.extra["outages"] = self._stats.extra.get("outages", 0) + (1 if first else 0)
            if first:
                log.warning(
                    "redis store %s unreachable during %s (%s: %s); serving misses, retrying every %.1fs",
                    self.url, what, type(e).__name__, e, self.retry_after_s,
                )
            return default
        with self._lock:
            recovered, self._outage = self._outage, False
        if recovered:
            log.warning("redis store %s reachable again", self.url)
        return result

    # -- KVStore --------------------------------------------------------------

    def append_record(self, log_name: str, line: bytes) -> None:
        """Append one record to the list ``<prefix>:log:<name>`` (RPUSH; no TTL: logs are tiny)."""
        self._call("append_record", lambda: self._client.rpush(self._log_key(log_name), line), None)

    def _log_key(self, log_name: str) -> bytes:
        return f"{self.prefix}:log:{log_name}".encode()

    def rewrite_records(self, log_name: str, expected: list[bytes], lines: list[bytes]) -> bool:
        """Replace the list with ``lines`` if it still holds exactly ``expected``
        (WATCH + MULTI: a concurrent RPUSH aborts the swap). Returns whether it was replaced."""
        name = self._log_key(log_name)
        return bool(self._call("rewrite_records", lambda: rewrite_log(self._client, name, expected, lines), False))

    def read_records(self, log_name: str) -> list[bytes]:
        """Every record of the list (empty when absent or the server is down; see
        :func:`blend.store.redis_logs.read_log`). A list holding more than ``MAX_LOG_BYTES`` is trimmed to
        its newest records (:func:`blend.store.redis_logs.trim_log`), with a warning that older records
        were dropped, and those are returned."""
        name = self._log_key(log_name)
        try:
            return self._call("read_records", lambda: read_log(self._client, name), [])
        except OversizedLogError as e:
            kept = self._call("read_records", lambda: trim_log(self._client, name), [])
            log.warning("redis store %s: log %s holds %d bytes, over %d: kept its newest %d records; older records "
                        "were dropped", self.url, log_name, e.size, MAX_LOG_BYTES, len(kept))
            return kept

    def has_records(self, log_name: str) -> bool:
        """Whether the list ``<prefix>:log:<name>`` exists (False while the server is down)."""
        return bool(self._call("has_records", lambda: self._client.exists(self._log_key(log_name)), 0))

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
            pipe = self._client.pipeline(transaction=False)
            pipe.exists(rk)
            pipe.strlen(rk)
            pipe.getrange(rk, 0, HEADER_PROBE - 1)
            return pipe.execute(raise_on_error=False)

        got = self._call(what, probe, None)
        if got is None or not got[0]:
            return None
        if isinstance(got[1], Exception) or isinstance(got[2], Exception):  # e.g. WRONGTYPE: a list at the key
            raise EntryError(EntryErrorKind.NOT_A_BLOB, f"the value is not a string ({got[1] if isinstance(got[1], Exception) else got[2]})")
        size, head = int(got[1]), bytes(got[2])
        start = header_length(head)
        if start > len(head) and size >= start:  # a header longer than the probe (never written by put)
            head += bytes(self._call(what, lambda: self._client.getrange(rk, len(head), start - 1), b"") or b"")
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
        blob = self._call("get", lambda: self._client.getrange(rk, 0, want), None)
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
        ok = self._call("put", lambda: self._client.set(self.rkey(ns, key), blob, ex=self.ttl_s), None)
        if ok:
            self._count("puts")
        else:
            with self._lock:
                self._stats.extra["put_errors"] = self._stats.extra.get("put_errors", 0) + 1

    def put_raw(self, ns: Namespace, key: StoreKey, blob: bytes) -> None:
        """Store arbitrary bytes under (ns, key): for tests and repair tools only."""
        self._call("put", lambda: self._client.set(self.rkey(ns, key), blob, ex=self.ttl_s), None)

    def contains(self, ns: Namespace, key: StoreKey) -> bool:
        return bool(self._call("exists", lambda: self._client.exists(self.rkey(ns, key)), 0))

    def presence(self, ns: Namespace, key: StoreKey) -> Presence:
        """PRESENT or ABSENT as the server answers; UNKNOWN while it is down (``contains`` says False then)."""
        found = self._call("exists", lambda: self._client.exists(self.rkey(ns, key)), None)
        return Presence.UNKNOWN if found is None else Presence.PRESENT if found else Presence.ABSENT

    def delete(self, ns: Namespace, key: StoreKey) -> bool:
        return bool(self._call("delete", lambda: self._client.delete(self.rkey(ns, key)), 0))

    def _rkeys(self, ns: Namespace) -> list[bytes]:
        """The namespace's entry keys: exactly ``<prefix>:<ns>:`` and 64 lowercase hex digits (the glob also
        matches another deployment's keys whose prefix extends this one's, e.g. ``team:exact:exact:<hex>``)."""
        head = f"{self.prefix}:{ns.value}:".encode()  # bytes: a non-ASCII prefix is longer in bytes than in characters
        pattern = _glob_escape(f"{self.prefix}:{ns.value}:") + "*"
        found = self._call("scan", lambda: list(self._client.scan_iter(match=pattern, count=1000)), [])
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
                pipe = self._client.pipeline(transaction=False)
                for rk in rks:
                    pipe.strlen(rk)
                # a key holding another type (WRONGTYPE) answers with an error: skip it, not the namespace
                return [n for n in pipe.execute(raise_on_error=False) if isinstance(n, int)]

            lengths = self._call("stats", sizes, [])
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
        with self._lock:
            failed, self._failed_calls = self._failed_calls, 0
        try:
            self._client.ping()
        except Exception as e:  # noqa: BLE001 -- any failure to talk to the server
            return f"{self.url} unreachable ({type(e).__name__}: {e})"
        if failed:
            return f"{self.url}: {failed} call(s) failed or were skipped during the run (the server was down)"
        return ""

    def clear(self, ns: Namespace | None = None) -> int:
        n = 0
        for space in [ns] if ns is not None else list(Namespace):
            rks = self._rkeys(space)
            for i in range(0, len(rks), 1000):
                batch = rks[i : i + 1000]
                n += int(self._call("clear", lambda b=batch: self._client.delete(*b), 0))
        if ns is None:  # everything: the record logs too (they only point at entries)
            pattern = _glob_escape(f"{self.prefix}:log:") + "*"
            logs = self._call("scan", lambda: list(self._client.scan_iter(match=pattern, count=1000)), [])
            if logs:
                self._call("clear", lambda: self._client.delete(*logs), 0)
        return n

    def close(self) -> None:
        self._client.close()
