"""SIGTERM unwinds a command as Ctrl-C does.

Python's default SIGTERM ends the process at once: no ``finally`` block and no
``atexit`` hook runs, so a write-behind queue's pending store writes were lost
without a word (``docker stop`` of an ingest, a supervisor's stop). Under
:func:`sigterm_unwinds` the signal raises :class:`Terminated` in the main
thread instead: an ingest commits what it finished, the store's queued writes
are flushed at exit, and the command exits with ``ExitCode.TERMINATED``.
(``kvblend serve`` is stopped by uvicorn's own handlers, which drain requests
and run the app's shutdown.)
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
    Outside the main thread, or where handlers cannot be set, the block runs unchanged."""
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
