"""SIGTERM unwinds a command as Ctrl-C does; Ctrl-C can ask a chat's answer to stop instead.

Python's default SIGTERM ends the process at once: no ``finally`` block and no
``atexit`` hook runs, so a write-behind queue's pending store writes were lost
without a word (``docker stop`` of an ingest, a supervisor's stop). Under
:func:`sigterm_unwinds` the signal raises :class:`Terminated` in the main
thread instead: an ingest commits what it finished, the store's queued writes
are flushed at exit, and the command exits with ``ExitCode.TERMINATED``.
(``kvblend serve`` is stopped by uvicorn's own handlers, which drain requests
and run the app's shutdown.)

Under :func:`ctrl_c_requests_stop` a first Ctrl-C only sets a flag that the
work reads where it can stop cleanly (``kvblend chat`` stops its turn's prefill
before the next layer, or ends the answer being printed, and returns to its
prompt); a second one raises ``KeyboardInterrupt``.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class Terminated(BaseException):
    """SIGTERM arrived (a BaseException, as KeyboardInterrupt is: ``except Exception`` never swallows it)."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


@contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`Terminated` in the main thread; the previous handler is
    restored after it (a second SIGTERM while the process flushes at exit then ends it at once).
    Outside the main thread, or where handlers cannot be set, the block runs unchanged.

    Yields:
        Nothing; a SIGTERM during the block raises :class:`Terminated` where the main thread is.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    try:
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
    except (ValueError, OSError):
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class StopRequest:
    """What Ctrl-C asked of the work running under :func:`ctrl_c_requests_stop`.

    Attributes:
        requested: a first Ctrl-C arrived: the work stops at its next safe point (a chat's answer at its next
            piece of text) instead of being interrupted wherever it was.
        cancel: set with ``requested``: the flag a prefill runs under (:func:`blend.cancel.cancellable`), so
            that it stops before its next layer.
    """

    def __init__(self) -> None:
        self.requested = False
        self.cancel = threading.Event()


@contextmanager
def ctrl_c_requests_stop() -> Iterator[StopRequest]:
    """Within the block, a first Ctrl-C (SIGINT) sets ``requested`` (and ``cancel``) on the yielded
    :class:`StopRequest` instead of raising; a second one raises ``KeyboardInterrupt`` as Python's default
    handler does (the way out of work that reaches no safe point soon). llama.cpp's interactive mode reads
    Ctrl-C the same way.

    Raising ``KeyboardInterrupt`` at the first Ctrl-C would interrupt the engine anywhere: between a
    write-behind queue's count of a write and its queueing (every later flush then waited forever), or
    halfway through an LRU's bookkeeping. A flag, read where the caller can stop cleanly, cannot.

    Outside the main thread, where SIGINT is ignored (a job started in the background), or where handlers
    cannot be set, the block runs unchanged: nothing is ever requested.

    Yields:
        The block's stop request.
    """
    request = StopRequest()

    def _first_requests_stop(signum, frame) -> None:
        if request.requested:
            raise KeyboardInterrupt
        request.requested = True  # first: a second Ctrl-C during ``set`` (which takes the event's lock) raises
        request.cancel.set()  # instead of setting it again from inside the held lock (a deadlock)

    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        yield request
        return
    try:
        previous = signal.signal(signal.SIGINT, _first_requests_stop)
    except (ValueError, OSError):
        yield request
        return
    try:
        yield request
    finally:
        signal.signal(signal.SIGINT, previous)
