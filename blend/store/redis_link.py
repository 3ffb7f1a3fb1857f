"""The Redis tier's connection: a redis-py client behind an outage state machine.

The store is a cache, so an unreachable server is a miss, never an error::

    up ──(connection error / timeout / late)──► down: warn once, every call returns
     ▲                                          MISS / no-op without touching the network
     └────(first call after retry_after_s succeeds: log "reachable again")

A call is late when it is not done within ``socket_timeout_s`` plus the bytes it moves at
``min_rate`` (bytes/s): the socket timeout alone bounds each wait for bytes, not a call, so a
server that dripped its reply held the request for as long as it liked (``redis_deadline.py``).

A server that answers with an error (e.g. ``OOM`` at maxmemory) is not down:
the call is refused, counted in ``refused_calls`` and logged once per cause
every ``REFUSAL_LOG_S``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Callable, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from blend.defaults import (
    DEFAULT_REDIS_CONNECT_TIMEOUT_S,
    DEFAULT_REDIS_MIN_RATE,
    DEFAULT_REDIS_RETRY_AFTER_S,
    DEFAULT_REDIS_SOCKET_TIMEOUT_S,
)
from blend.store.base import StoreStats
from blend.store.redis_deadline import WATCHDOG, Alarm
from blend.store.redis_url import redacted_url

REFUSAL_LOG_S = 600  # a refusal (a full server) is logged again after this long, once per cause
log = logging.getLogger("blend.store.redis_store")  # the Redis tier logs under one name, whichever module speaks

T = TypeVar("T")


class RefusedData(Exception):
    """The server answered, but the caller refuses what it sent (e.g. a record log over its cap).

    Raised inside a call, it passes through :meth:`RedisLink.call` untouched: it is neither an
    outage nor a refusal by the server.
    """


class RedisLink:
    """A client that a connection failure takes offline for ``retry_after_s``.

    Args:
        url: ``redis://HOST:PORT/DB`` (any URL redis-py accepts).
        stats: the tier's counters; the link adds ``skipped_calls``, ``refused_calls`` and
            ``outages`` to their ``extra``.
        lock: the lock that guards ``stats`` (the tier's own).
        connect_timeout_s: TCP connect timeout; a dead host costs at most this.
        socket_timeout_s: per-read/write timeout on an established connection.
        retry_after_s: after a failure, calls skip the server for this long.
        min_rate: a call that moves n bytes is late (the server down) after ``socket_timeout_s`` plus
            n / ``min_rate`` seconds.
    """

    def __init__(self, url: str, stats: StoreStats, lock: threading.Lock, *,
                 connect_timeout_s: float = DEFAULT_REDIS_CONNECT_TIMEOUT_S,
                 socket_timeout_s: float = DEFAULT_REDIS_SOCKET_TIMEOUT_S,
                 retry_after_s: float = DEFAULT_REDIS_RETRY_AFTER_S,
                 min_rate: float = DEFAULT_REDIS_MIN_RATE) -> None:
        if not (socket_timeout_s > 0 and min_rate > 0):  # NaN refused too
            raise ValueError(f"socket_timeout_s and min_rate must be > 0, got {socket_timeout_s} and {min_rate}")
        self.url = redacted_url(url)  # what logs and messages show: the password never leaves the process
        self.retry_after_s = retry_after_s
        self.socket_timeout_s = socket_timeout_s
        self.min_rate = min_rate
        self.client = redis.Redis.from_url(
            url,
            socket_connect_timeout=connect_timeout_s,
            socket_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
            health_check_interval=0,
            protocol=2,  # RESP2: no HELLO handshake, so Redis < 6 and other Redis-compatible servers work
            socket_read_size=1 << 20,  # entries are tens of MB: fewer, larger reads
        )
        self._stats = stats
        self._lock = lock
        self._down_until = 0.0  # time.monotonic() before which the server is skipped
        self._outage = False
        self._failed_calls = 0  # calls that failed or were skipped since the last check_reachable()
        # (call, error kind) the server refused -> when it was last logged: once per cause every REFUSAL_LOG_S
        self._refusals: dict[tuple[str, str], float] = {}

    @property
    def available(self) -> bool:
        """False while in the back-off window after a failure."""
        with self._lock:
            return time.monotonic() >= self._down_until

    def deadline_s(self, nbytes: int) -> float:
        """Seconds a call that moves ``nbytes`` may take before it is late."""
        return self.socket_timeout_s + nbytes / self.min_rate

    def _cut(self) -> None:
        """A call is late: disconnect every connection, in use or idle, so its blocked read fails now."""
        self.client.connection_pool.disconnect(inuse_connections=True)

    def call(self, what: str, fn: Callable[[], T], default: T, nbytes: int | None = 0) -> T:
        """Run ``fn`` against the server; on an outage (or a late answer) warn once and return ``default``.

        Args:
            what: the operation, as logs name it (``get``, ``put``, ``scan``...).
            fn: the call; it uses :attr:`client`.
            default: the result when the server is down or refuses the call.
            nbytes: the most bytes the call moves, for its deadline (:meth:`deadline_s`); None: no deadline
                but the socket timeout's on each wait (a scan of every key, whose length nobody knows).

        Returns:
            ``fn()``'s result, or ``default``.

        Raises:
            RefusedData: whatever ``fn`` raised of it.
        """
        if not self.available:
            with self._lock:
                self._stats.extra["skipped_calls"] = self._stats.extra.get("skipped_calls", 0) + 1
                self._failed_calls += 1
            return default
        limit = None if nbytes is None else self.deadline_s(nbytes)
        alarm: Alarm | None = None if limit is None else WATCHDOG.arm(limit, self._cut)
        try:
            result = fn()
        except RefusedData:  # the server answered; the data is refused, not the server
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
            late = alarm is not None and alarm.fired
            with self._lock:
                self._down_until = time.monotonic() + self.retry_after_s
                self._failed_calls += 1
                first = not self._outage
                self._outage = True
                self._stats.extra["outages"] = self._stats.extra.get("outages", 0) + (1 if first else 0)
                if late:
                    self._stats.extra["late_calls"] = self._stats.extra.get("late_calls", 0) + 1
            if first:
                why = (f"no whole answer within {limit:.3g} s: the server is stalled or slower than "
                       f"{self.min_rate / 2**20:g} MiB/s" if late else f"{type(e).__name__}: {e}")
                log.warning("redis store %s unreachable during %s (%s); serving misses, retrying every %.1fs",
                            self.url, what, why, self.retry_after_s)
            return default
        finally:
            if alarm is not None:
                WATCHDOG.disarm(alarm)
        with self._lock:
            recovered, self._outage = self._outage, False
        if recovered:
            log.warning("redis store %s reachable again", self.url)
        return result

    def scan(self, head: str) -> list[bytes]:
        """Every key that starts with ``head`` (SCAN; a glob, so the caller still checks what it found).

        Args:
            head: the keys' leading text, matched literally (glob characters are escaped).

        Returns:
            The keys found; empty when the server is down.
        """
        pattern = "".join("\\" + c if c in "*?[]\\" else c for c in head) + "*"
        return self.call("scan", lambda: list(self.client.scan_iter(match=pattern, count=1000)), [], nbytes=None)

    def check_reachable(self) -> str:
        """'' if the server answers PING and no call failed since the last check, else why not."""
        with self._lock:
            failed, self._failed_calls = self._failed_calls, 0
        try:
            self.client.ping()
        except Exception as e:  # noqa: BLE001 -- any failure to talk to the server
            return f"{self.url} unreachable ({type(e).__name__}: {e})"
        if failed:
            return f"{self.url}: {failed} call(s) failed or were skipped during the run (the server was down)"
        return ""

    def close(self) -> None:
        """Close the client's connections."""
        self.client.close()
