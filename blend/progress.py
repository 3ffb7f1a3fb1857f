"""One progress bar for long work (ingest, evals): counts, rate, elapsed and time left.

On a terminal the bar redraws in place (``\\r``); on a pipe or file it prints a
line at most every ``min_interval_s`` seconds and a final line on close, so
logs stay short. The estimate of time left uses only units done by this
process: units skipped on ``--resume`` count as done but not towards the rate.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, TextIO


def format_duration(seconds: float | None) -> str:
    """``h:mm:ss`` or ``m:ss``; ``?`` when unknown, negative or infinite.

    Args:
        seconds: the duration (None, NaN, negative or infinite: unknown).

    Returns:
        The duration rounded to whole seconds, or ``?``.
    """
    if seconds is None or seconds != seconds or seconds < 0 or seconds == float("inf"):
        return "?"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


class Progress:
    """Progress over a known total that may grow while running.

    Args:
        total: units expected (raise it with :meth:`add_total`).
        done: units already done before this process started.
        desc: label printed before the bar.
        unit: name of one unit, e.g. "items" or "chunks".
        stream: where to draw (stderr by default); None draws nothing.
        enabled: draw nothing when False.
        width: bar width in characters.
        clock: monotonic clock (injectable for tests).
        min_interval_s: minimum seconds between redraws (default: 0 on a
            terminal or StringIO-like stream, 5 s on a pipe or file).
    """

    def __init__(self, total: int, done: int = 0, desc: str = "", unit: str = "items",
                 stream: TextIO | None = sys.stderr, enabled: bool = True, width: int = 24,
                 clock: Callable[[], float] = time.monotonic, min_interval_s: float | None = None) -> None:
        self.total = max(0, int(total))
        self.done = min(done, self.total)
        self._skipped = self.done
        self.desc, self.unit, self.width, self.clock = desc, unit, width, clock
        self.stream = stream if enabled else None
        self.note = ""
        self._tty = bool(getattr(stream, "isatty", lambda: False)())
        if min_interval_s is None:
            min_interval_s = 0.0 if self._tty or not hasattr(stream, "fileno") else 5.0
        self._interval = min_interval_s
        self._t0 = clock()
        self._last_draw = -1e18
        self._closed = False

    @property
    def n(self) -> int:
        return self.done

    def eta_s(self) -> float | None:
        """Seconds left; None before this process finished a unit."""
        ran = self.done - self._skipped
        if ran <= 0:
            return None
        return (self.clock() - self._t0) / ran * (max(self.total, self.done) - self.done)

    def line(self) -> str:
        """The current bar as one line of text (no newline)."""
        total = max(self.total, self.done)
        frac = self.done / total if total else 1.0
        fill = int(round(frac * self.width))
        bar = "#" * fill + "." * (self.width - fill)
        elapsed = self.clock() - self._t0
        rate = (self.done - self._skipped) / elapsed if elapsed > 0 else 0.0
        # slow units (an eval item takes minutes) read better as time per unit
        speed = f"{rate:.2f}/s" if rate >= 1 or rate == 0 else f"{format_duration(1 / rate)}/{self.unit.rstrip('s')}"
        left = format_duration(self.eta_s()) if self.done < total else "0:00"
        head = f"{self.desc} " if self.desc else ""
        note = f"  {self.note}" if self.note else ""
        return (f"{head}[{bar}] {self.done}/{total} {self.unit}  {speed}  "
                f"elapsed {format_duration(elapsed)}  left {left}{note}")

    def _draw(self, force: bool = False) -> None:
        if self.stream is None:
            return
        now = self.clock()
        if not force and now - self._last_draw < self._interval:
            return
        self._last_draw = now
        if self._tty:
            self.stream.write("\r" + self.line()[:160])
        else:
            self.stream.write(self.line() + "\n")
        self.stream.flush()

    def skip(self, n: int) -> None:
        """Count ``n`` units as done before this process (resumed): not part of the rate."""
        self.done = self._skipped = min(n, self.total)
        self._t0 = self.clock()
        self._draw(force=True)

    def add_total(self, n: int) -> None:
        """Raise the expected total by ``n`` units."""
        self.total += max(0, int(n))

    def update(self, n: int = 1, note: str | None = None) -> None:
        """Mark ``n`` more units done (``note``: short text after the bar) and redraw."""
        self.done += int(n)
        if note is not None:
            self.note = note
        self._draw()

    def close(self) -> None:
        """Draw the final state once and end the line."""
        if self._closed:
            return
        self._closed = True
        self._draw(force=True)
        if self.stream is not None and self._tty:
            self.stream.write("\n")
            self.stream.flush()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
