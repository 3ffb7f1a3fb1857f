"""A tiny progress bar for stderr with rate and ETA (no tqdm dependency).

On a terminal the bar redraws in place (``\\r``); on a pipe or file it prints
one line at most every ``min_interval_s`` seconds and a final line on close,
so logs stay short.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


def format_seconds(seconds: float) -> str:
    """Render seconds as ``H:MM:SS`` or ``M:SS``.

    Args:
        seconds: a non-negative duration.

    Returns:
        The formatted duration ("?" for a negative or non-finite value).
    """
    if seconds != seconds or seconds < 0 or seconds == float("inf"):
        return "?"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


class Progress:
    """A progress bar over a known total that may grow while running.

    Args:
        total: number of units expected (may be raised with :meth:`add_total`).
        desc: label printed before the bar.
        unit: name of one unit, e.g. "chunks".
        stream: where to draw (default stderr).
        enabled: draw nothing when False.
        width: bar width in characters.
        min_interval_s: minimum seconds between redraws.
    """

    def __init__(
        self,
        total: int,
        desc: str = "",
        unit: str = "it",
        stream: TextIO | None = None,
        enabled: bool = True,
        width: int = 24,
        min_interval_s: float | None = None,
    ) -> None:
        self.total = max(0, int(total))
        self.desc = desc
        self.unit = unit
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.width = width
        self.n = 0
        self.postfix = ""
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._interval = min_interval_s if min_interval_s is not None else (0.1 if self._tty else 5.0)
        self._t0 = time.perf_counter()
        self._last_draw = -1e9
        self._closed = False

    def add_total(self, n: int) -> None:
        """Raise the expected total by ``n`` units."""
        self.total += max(0, int(n))

    def update(self, n: int = 1, postfix: str | None = None) -> None:
        """Advance by ``n`` units and redraw if enough time has passed.

        Args:
            n: units completed since the last call.
            postfix: short text shown after the bar (e.g. the current file).
        """
        self.n += int(n)
        if postfix is not None:
            self.postfix = postfix
        now = time.perf_counter()
        if now - self._last_draw >= self._interval:
            self._draw(now, final=False)

    def line(self, now: float | None = None) -> str:
        """The current bar as one line of text (no newline)."""
        now = time.perf_counter() if now is None else now
        elapsed = max(now - self._t0, 1e-9)
        rate = self.n / elapsed
        total = max(self.total, self.n)
        frac = self.n / total if total else 1.0
        filled = int(round(frac * self.width))
        bar = "#" * filled + "-" * (self.width - filled)
        eta = (total - self.n) / rate if rate > 0 else float("inf")
        head = f"{self.desc} " if self.desc else ""
        tail = f" {self.postfix}" if self.postfix else ""
        return (
            f"{head}[{bar}] {self.n}/{total} {self.unit} "
            f"{rate:.1f}/s elapsed {format_seconds(elapsed)} ETA {format_seconds(eta)}{tail}"
        )

    def _draw(self, now: float, final: bool) -> None:
        if not self.enabled:
            return
        self._last_draw = now
        text = self.line(now)
        if self._tty:
            self.stream.write("\r" + text[:160].ljust(80) + ("\n" if final else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Draw the final state once and end the line."""
        if self._closed:
            return
        self._closed = True
        self._draw(time.perf_counter(), final=True)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
