"""Which path a timed request ran, for benches and reports that time or tabulate a method: a refused blend is
a full prefill, and one with nothing to re-position is the exact path; neither may be timed under the blend's
name. One predicate (:func:`ran_own_path`) decides it for every bench and report."""

from __future__ import annotations

from blend.policy import ReuseMode
from blend.report import ReuseReport


def ran_own_path(asked: ReuseMode, applied: ReuseMode, guarded: bool | None) -> bool:
    """Whether a request ran the path its method asked for, so that its TTFT is that method's.

    A blend's own path is ``blend``, or ``exact`` when its near-tie guard recomputed it there: the guard is
    part of the blend's policy, and its cost is what a user of that policy pays. A blend that ran ``exact``
    unguarded had nothing to re-position (every document exact at its place), and one that ran ``none`` was
    refused (quality gate, length, dynamic-NTK RoPE): both are another path's TTFT. A full prefill (asked
    ``none``) runs the exact schedule in one pass, so ``exact`` is its own path too.

    Args:
        asked: the mode the method asks for (``none`` for a full prefill, ``exact`` for a prefix method,
            ``blend`` for reuse and blends).
        applied: the path the request's report says produced its KV.
        guarded: whether the near-tie guard fired (None: a row recorded before the field: not fired).

    Returns:
        True when the request ran its method's own path.
    """
    if applied is asked:
        return True
    if asked is ReuseMode.NONE:
        return applied is ReuseMode.EXACT
    return asked is ReuseMode.BLEND and applied is ReuseMode.EXACT and bool(guarded)


def check_blended(name: str, report: ReuseReport) -> None:
    """Raise unless a blend's report says it ran a blend's own path (:func:`ran_own_path`): it blended, or its
    near-tie guard recomputed it on the exact path.

    Args:
        name: the method or mode, for the message.
        report: the timed request's report.

    Raises:
        RuntimeError: the request ran ``none`` (refused: quality gate, length, dynamic-NTK RoPE) or ``exact``
            unguarded (every document exact at its place): its TTFT is another path's.
    """
    if not ran_own_path(ReuseMode.BLEND, report.applied, bool(report.guard)):
        raise RuntimeError(f"{name} ran {report.applied.value}, not a blend "
                           f"({report.gate or 'nothing to re-position'}): its TTFT would be another path's")
