"""Whole-call deadlines for the Redis tier: a server that answers, but too slowly, is down.

redis-py's socket timeout bounds each wait for bytes, not a call: a server (or a proxy before it) that
sends a reply a few bytes at a time, each within the timeout, held a lookup, and the request waiting for
it, for as long as it liked (a 280 KB entry dripped at 40 KB/s took 17 s under a 0.5 s timeout). A call
through :class:`~blend.store.redis_link.RedisLink` therefore arms an alarm here; one watchdog thread,
shared by every link, runs the alarm's action when its deadline passes (the link disconnects its
client's connections, so the blocked read fails at once and the server is treated as down)::

    call:      arm(deadline) ── fn() ──────────────── disarm      (done in time: the alarm never fires)
    watchdog:                       deadline ─► fire: disconnect  (late: fn() fails, the link goes down)
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
from typing import Callable

log = logging.getLogger("blend.store.redis_store")


class Alarm:
    """One armed deadline: ``fired`` once the watchdog ran its action."""

    __slots__ = ("at", "action", "fired", "cancelled")

    def __init__(self, at: float, action: Callable[[], None]) -> None:
        self.at = at
        self.action = action
        self.fired = False
        self.cancelled = False


class Watchdog:
    """Runs each armed alarm's action at its deadline (``time.monotonic()``), unless disarmed first.

    One daemon thread, started on the first alarm, serves every alarm of the process; an action runs
    outside the watchdog's lock and must not block for long (a pool disconnect does not).
    """

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)  # a forked child has no watchdog thread (and a fresh lock)

    def _reset(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Alarm]] = []
        self._seq = itertools.count()  # orders alarms of one deadline (an Alarm does not compare)
        self._thread: threading.Thread | None = None

    def arm(self, seconds: float, action: Callable[[], None]) -> Alarm:
        """Run ``action`` in ``seconds`` unless :meth:`disarm` comes first.

        Args:
            seconds: from now.
            action: what to run at the deadline (exceptions are logged, never raised).

        Returns:
            The alarm, for :meth:`disarm`.
        """
        alarm = Alarm(time.monotonic() + seconds, action)
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="redis-deadlines", daemon=True)
                self._thread.start()
            heapq.heappush(self._heap, (alarm.at, next(self._seq), alarm))
            if self._heap[0][2] is alarm:  # the earliest now: the thread sleeps until an older deadline
                self._cond.notify()
        return alarm

    def disarm(self, alarm: Alarm) -> bool:
        """Cancel ``alarm``; returns whether it had fired already."""
        with self._cond:
            alarm.cancelled = True
            return alarm.fired

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap:
                    self._cond.wait()
                at, _, alarm = self._heap[0]
                if alarm.cancelled:
                    heapq.heappop(self._heap)
                    continue
                wait = at - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                heapq.heappop(self._heap)
                alarm.fired = True
            try:
                alarm.action()
            except Exception as e:  # noqa: BLE001 -- the watchdog outlives any one action
                log.warning("redis store: a deadline's action failed: %s: %s", type(e).__name__, e)


WATCHDOG = Watchdog()
