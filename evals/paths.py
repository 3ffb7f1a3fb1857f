"""Which path a timed request ran, for benches that time a blend: a refused blend is a full prefill, and one
with nothing to re-position is the exact path; neither may be timed under the blend's name."""

from __future__ import annotations

from blend.policy import ReuseMode
from blend.report import ReuseReport


def check_blended(name: str, report: ReuseReport) -> None:
    """Raise unless a blend's report says it blended (``blend``), or that its near-tie guard recomputed it on
    the exact path (``exact`` with a guard note).

    Args:
        name: the method or mode, for the message.
        report: the timed request's report.

    Raises:
        RuntimeError: the request ran ``none`` (refused: quality gate, length, dynamic-NTK RoPE) or ``exact``
            unguarded (every document exact at its place): its TTFT is another path's.
    """
    if report.applied is ReuseMode.NONE or (report.applied is ReuseMode.EXACT and not report.guard):
        raise RuntimeError(f"{name} ran {report.applied.value}, not a blend "
                           f"({report.gate or 'nothing to re-position'}): its TTFT would be another path's")
