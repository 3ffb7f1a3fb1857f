"""One prefill's result and the request's report built from it (the guard's rows and shares included)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import torch

from blend.blend_values import BlendResume
from blend.policy import ReuseMode, ReusePolicy
from blend.prompt import SegmentKind
from blend.report import DeviationStats, ReuseClass, ReuseReport, SegmentReport, Timings


@dataclass(frozen=True)
class Prefilled:
    """One prefill mode's result: logits and the rows of the report."""

    logits: torch.Tensor  # (V,) float32
    segments: tuple[SegmentReport, ...]
    applied: ReuseMode  # the reuse that produced the KV (see ReuseReport.applied)
    lookup_s: float = 0.0
    deviation: DeviationStats | None = None
    ratio: float | None = None  # the share an adaptive budget or a threshold selected, or the guard's
    spent: float | None = None  # a guarded request: its first blend's share plus the recompute's
    margin: float | None = None  # the blend's first-token top-2 gap (nats), before any guard
    guard: str = ""  # why the near-tie guard recomputed the request ("" if it did not)
    approximate: bool = False  # a blend kept re-positioned KV of some document rows (the guard's condition)
    resume: BlendResume | None = None  # a blend the guard may widen (see blending.widen_blend)
    check_rows: tuple[int, ...] = ()  # a blend's document rows recomputed above each check layer


def build_report(done: Prefilled, policy: ReusePolicy, blended: bool, refused: str, timings: Timings) -> ReuseReport:
    """The request's report.

    Args:
        done: the prefill that answers the request.
        policy: the request's policy.
        blended: a blend ran (not refused), so its selector, the share it recomputed (0 where nothing was
            re-positioned: every document exact, or the hot prefix), its first-token gap and its rows per
            check layer are reported.
        refused: why the policy's reuse was refused ("" if it was not).
        timings: the request's timings.

    Returns:
        The :class:`~blend.report.ReuseReport`.
    """
    # Python floats: a policy may carry numpy's (np.float32 is valid there), which json cannot write
    ratio = float(report_ratio(done, policy)) if blended else None
    spent = float(done.spent) if done.spent is not None else ratio
    return ReuseReport(
        policy=policy.describe(), applied=done.applied, asked=policy.mode, segments=done.segments,
        selector=policy.selector if blended else "", ratio=ratio, spent=spent, deviation=done.deviation,
        gate=refused, timings=timings, first_token_margin=done.margin if blended else None, guard=done.guard,
        check_rows=done.check_rows if blended else (),
    )


def keep_first_pass_misses(first: Sequence[SegmentReport], redo: Sequence[SegmentReport]
                           ) -> tuple[SegmentReport, ...]:
    """A guarded request's report rows: the recompute's, except that a segment the first pass missed
    (computed or rejected) says so, though the recompute then found the entry that pass stored.

    Args:
        first: the first (blended) pass's rows; redo: the guard's recompute's, in the same order.

    Returns:
        One row per segment.
    """
    missed = (ReuseClass.COMPUTED, ReuseClass.REJECTED)
    return tuple(replace(r, reuse_class=f.reuse_class, note=f.note)
                 if f.kind is r.kind and f.reuse_class in missed and r.reuse_class not in missed else r
                 for f, r in zip(first, redo, strict=True))


def report_ratio(done: Prefilled, policy: ReusePolicy) -> float:
    """The share a blend that ran recomputed.

    Args:
        done: the blend's prefill.
        policy: its policy.

    Returns:
        What its selection chose (an adaptive budget's, a threshold's, a capped one's), else the policy's
        ratio; with forced rows, the rows recomputed (:func:`with_forced`).
    """
    return with_forced(done.segments, done.ratio if done.ratio is not None else policy.first_ratio)


def with_forced(segments: Sequence[SegmentReport], ratio: float) -> float:
    """A blend's recomputed share, forced rows counted.

    Args:
        segments: the blend's report rows.
        ratio: the share its selection chose.

    Returns:
        ``ratio``, or where a semantic document's rows were forced (recomputed at every layer on top of the
        selection) the rows the pass recomputed over the document rows.
    """
    if not any(s.forced for s in segments if s.kind is SegmentKind.DOCUMENT):
        return ratio
    recomputed, rows = document_rows(segments)
    return recomputed / max(rows, 1)


def document_rows(segments: Sequence[SegmentReport]) -> tuple[int, int]:
    """A blend's document rows: those it recomputed, and all of them (the budget's base).

    Args:
        segments: the blend's report rows.

    Returns:
        (recomputed rows, document rows).
    """
    docs = [s for s in segments if s.kind is SegmentKind.DOCUMENT]
    return sum(s.recomputed for s in docs), sum(s.tokens for s in docs)
