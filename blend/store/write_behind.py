"""Write-behind for a store chain's persistent tiers: one background writer thread.

A request that computes a chunk puts it into every tier. The memory tier takes
it at once (this process hits it from then on); disk and Redis writes (encode,
checksum, file or network I/O: ~80 ms for a 600-row fp32 chunk on disk) go to
this writer, so they overlap the request's remaining prefill and its decoding
instead of adding to its time to first token::

    request:  compute d1 ─ put d1 (memory) ─ compute d2 ─ put d2 (memory) ─ ... first token ─ decode ─ flush ─► done
    writer:                 └─ disk d1 ──────────────────└─ disk d2 ─────────────────────────────┘

``flush`` is the barrier: it waits for every write submitted before it. The
engine's request paths call it before a request finishes (its answer
returned, its last chunk streamed), so once a request is done its chunks are
in every tier, as with write-through, and another process or replica finds
them. A process that exits with writes pending finishes them first (atexit;
a Ctrl-C while it waits gives up the rest, with one warning).
The queue is bounded: a producer faster than the disk waits for room rather
than holding unbounded KV in memory. A failed write is logged and counted,
never raised: the store is a cache, and a lost write is a later miss. The
writer runs at the lowest CPU priority: at normal priority its encoding and
copying competed with the prefill's torch threads for both cores and the
cold TTFT did not move at all (``evals/bench_cold.py``, BENCHMARKS.md).
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import weakref
from typing import Callable

log = logging.getLogger(__name__)

Write = Callable[[], None]
WRITER_NICE = 19  # the lowest priority: the writer yields the cores to the request's compute


class BackgroundWriter:
    """Runs writes in submission order on one daemon thread, started on the first write.

    Args:
        name: for the thread's name and log lines.
        max_pending: writes queued before :meth:`submit` blocks for room.
    """

    def __init__(self, name: str, max_pending: int) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.name = name
        self._queue: queue.Queue[Write | None] = queue.Queue(maxsize=max_pending)
        self._submit = threading.Lock()  # producers and close: queue order, the closed flag
        self._cond = threading.Condition()  # the counters (the writer thread takes only this one)
        self._submitted = 0  # writes handed in
        self._finished = 0  # writes done (or failed)
        self.failures = 0
        self._thread: threading.Thread | None = None
        self._closed = False
        atexit.register(_flush_at_exit, weakref.ref(self))

    def submit(self, write: Write) -> None:
        """Queue ``write`` (blocks while ``max_pending`` writes are waiting); after :meth:`close`,
        runs it inline."""
        with self._submit:  # held while waiting for room: the writer thread never takes it
            if not self._closed:
                with self._cond:
                    self._submitted += 1
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name=f"kvblend-{self.name}-writer",
                                                    daemon=True)
                    self._thread.start()
                try:
                    self._queue.put(write)  # before close's stop mark, which waits for this lock
                except BaseException:  # Ctrl-C while waiting for room: nothing was queued, so nothing is
                    with self._cond:  # counted (a write counted and never queued held every later flush forever)
                        self._submitted -= 1
                        self._cond.notify_all()
                    raise
                return
        if not self._call(write):
            with self._cond:
                self.failures += 1

    def pending(self) -> int:
        """Writes submitted and not yet finished."""
        with self._cond:
            return self._submitted - self._finished

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every write submitted before this call has finished.

        Args:
            timeout: seconds; None waits as long as it takes.

        Returns:
            True when they finished, False on timeout.
        """
        with self._cond:
            target = self._submitted
            return self._cond.wait_for(lambda: self._finished >= target, timeout)

    def close(self) -> None:
        """Finish every pending write and stop the thread (later writes run inline)."""
        with self._submit:
            first = not self._closed
            self._closed = True
            thread = self._thread
            if thread is not None and first:
                self._queue.put(None)  # after every queued write
        if thread is not None:
            thread.join()  # every caller, the second of two concurrent ones too, returns after the writes

    def _call(self, write: Write) -> bool:
        try:
            write()
            return True
        except Exception:  # noqa: BLE001 - a cache write never takes the writer (or a request) down
            log.exception("%s: background store write failed", self.name)
            return False

    def _run(self) -> None:
        _lowest_priority()
        while True:
            write = self._queue.get()
            if write is None:
                return
            ok = self._call(write)
            with self._cond:
                self._finished += 1
                self.failures += 0 if ok else 1
                self._cond.notify_all()


def _lowest_priority() -> None:
    """Run this thread at the lowest CPU priority (nice 19, Linux: per thread): a prefill's torch
    threads fill every core, and a writer competing with them stalls the whole parallel region,
    so it takes the cores when they idle (I/O waits, decoding, between requests). Its I/O is
    unaffected; a flush that waits for it gets the cores the waiting request no longer uses."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
    except (AttributeError, OSError):  # not Linux, or not allowed: normal priority
        pass


def _flush_at_exit(ref: "weakref.ref[BackgroundWriter]") -> None:
    writer = ref()
    if writer is None:
        return
    try:
        writer.close()
    except KeyboardInterrupt:  # a second Ctrl-C while the queued writes finish: they are given up (each write is
        # a temp file renamed over its entry, so an entry is whole or absent; a temp file left is collected),
        # told in one line instead of Python's "Exception ignored in atexit callback" traceback
        log.warning("%s: interrupted at exit: %d queued store write(s) given up", writer.name, writer.pending())
