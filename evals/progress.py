"""A tiny progress bar with an estimate of time left, on stderr."""

from __future__ import annotations

import sys
import time
from typing import Callable, TextIO


def format_duration(seconds: float | None) -> str:
    """``h:mm:ss`` or ``m:ss``; ``?`` when unknown."""
    if seconds is None or seconds != seconds or seconds < 0:
        return "?"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


class Progress:
    """Progress over a fixed number of units (items), with an ETA.

    The ETA extrapolates the mean time per unit done in this process; units
    skipped on ``--resume`` count as done but not towards the rate.

    Args:
        total: number of units.
        done: units already done before this process started.
        stream: where to draw (stderr by default); None draws nothing.
        width: bar width in characters.
        clock: monotonic clock (injectable for tests).
        label: unit name shown after the counts.
    """

    def __init__(
        self,
        total: int,
        done: int = 0,
        stream: TextIO | None = sys.stderr,
        width: int = 24,
        clock: Callable[[], float] = time.monotonic,
        label: str = "items",
    ) -> None:
        self.total = max(total, 0)
        self.done = min(done, self.total)
        self._skipped = self.done
        self.stream = stream
        self.width = width
        self.clock = clock
        self.label = label
        self._t0 = clock()
        self.note = ""

    def eta_s(self) -> float | None:
        """Seconds left, None before the first unit of this process is done."""
        ran = self.done - self._skipped
        if ran <= 0:
            return None
        return (self.clock() - self._t0) / ran * (self.total - self.done)

    def line(self) -> str:
        """The current bar as text."""
        frac = self.done / self.total if self.total else 1.0
        fill = int(round(frac * self.width))
        bar = "#" * fill + "." * (self.width - fill)
        elapsed = format_duration(self.clock() - self._t0)
        eta = format_duration(self.eta_s()) if self.done < self.total else "0:00"
        note = f"  {self.note}" if self.note else ""
        return f"[{bar}] {self.done}/{self.total} {self.label}  elapsed {elapsed}  left {eta}{note}"

    def draw(self) -> None:
        """Redraw in place."""
        if self.stream is not None:
            self.stream.write("\r" + self.line())
            self.stream.flush()

    def skip(self, n: int) -> None:
        """Count ``n`` units as done before this process (resumed): not part of the rate."""
        self.done = self._skipped = min(n, self.total)
        self._t0 = self.clock()
        self.draw()

    def update(self, n: int = 1, note: str = "") -> None:
        """Mark ``n`` more units done and redraw."""
        self.done = min(self.done + n, self.total)
        self.note = note
        self.draw()

    def close(self) -> None:
        """Finish the line."""
        if self.stream is not None:
            self.draw()
            self.stream.write("\n")
            self.stream.flush()
