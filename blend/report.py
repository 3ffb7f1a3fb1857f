"""ReuseReport: what every answer says about how its prompt was produced."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum

from blend.policy_types import ReuseMode
from blend.prompt import SegmentKind


class ReuseClass(Enum):
    EXACT = "exact"  # prefix hit: bit-identical to a cold computation
    BLENDED = "blended"  # identical tokens at another position, selectively recomputed
    SEMANTIC = "semantic"  # donor KV from non-identical tokens (experimental)
    COMPUTED = "computed"  # miss: computed for this request
    REJECTED = "rejected"  # found but unusable (provenance mismatch, corrupt): computed
    FALLBACK = "fallback"  # reuse refused (quality gate, dynamic-NTK past its length): computed fully


REUSED_CLASSES = frozenset({ReuseClass.EXACT, ReuseClass.BLENDED, ReuseClass.SEMANTIC})  # KV from the store

@dataclass(frozen=True)
class SegmentReport:
    kind: SegmentKind
    reuse_class: ReuseClass
    tokens: int
    start: int  # absolute position of the segment's first token
    key: str = ""  # hex store key ("" when not keyed)
    recomputed: int = 0  # rows of this segment recomputed above the check layer
    note: str = ""  # why (rejection reason, donor key, ...)
    recomputed_offsets: tuple[int, ...] = ()  # which rows: token offsets inside the segment, sorted
    forced: int = 0  # a semantic document's rows computed at every layer (edited, inserted or next to an
    # edit: their donor KV, where they had any, is not used); counted in ``recomputed`` too

    @property
    def reused(self) -> int:
        """Rows whose KV came from the store (a semantic document's forced rows did not)."""
        return self.tokens - self.forced if self.reuse_class in REUSED_CLASSES else 0

    def to_dict(self) -> dict:
        return {
            "kind": self.kind.value, "class": self.reuse_class.value, "tokens": self.tokens,
            "start": self.start, "key": self.key, "recomputed": self.recomputed, "note": self.note,
            "recomputed_offsets": list(self.recomputed_offsets), "forced": self.forced,
        }


@dataclass(frozen=True)
class DeviationStats:
    """Deviation of cached vs fresh V at the first check layer, over the rows compared there: every
    blended row the selector may choose, or, with candidate pre-selection (the default), only the
    candidates (the rows the question attends to most; the others are not computed up to the check)."""

    layer: int
    mean: float
    p50: float
    p90: float
    max: float
    selected_min: float | None  # smallest deviation among selected rows (None: no row was selected)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Timings:
    lookup_s: float = 0.0  # store lookups and loads
    compute_s: float = 0.0  # model compute up to the first token's logits
    ttft_s: float = 0.0  # the prefill, the quality gate's run excluded
    gate_s: float = 0.0  # the quality gate ran before this request for this long (0: it did not run)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class ReuseReport:
    """Built once by the engine when the prefill is done.

    ``policy`` is what the request asked for (``asked``, its mode) and ``applied`` what produced its KV: a
    refused reuse (``gate`` says why) ran ``none``, a blend with nothing to re-position (no document, or
    every document exact at its place) ran the exact path, ``exact``.
    """

    # the request's policy (:meth:`~blend.policy.ReusePolicy.describe`), its ``auto`` precisions resolved; where
    # reuse ran, a blend's precisions and temperature only where a pass above a check layer read them
    policy: str
    # the reuse mode that produced the request's KV: ``none`` (nothing looked up or stored: asked for, or
    # reuse refused), ``exact`` (the exact path, segment by segment) or ``blend`` (documents re-positioned)
    applied: ReuseMode
    asked: ReuseMode  # the policy's mode (``policy``'s first word), what ``applied`` differs from where it does
    segments: tuple[SegmentReport, ...] = ()
    selector: str = ""
    ratio: float | None = None
    deviation: DeviationStats | None = None
    gate: str = ""  # why reuse was refused, if it was (quality gate, length, dynamic NTK)
    timings: Timings = field(default_factory=Timings)
    first_token_margin: float | None = None  # a blend's first-token top-2 log-prob gap (nats): a small
    # gap is a near tie, where a small KV error can change the first token (the guard's signal)
    guard: str = ""  # why the near-tie guard recomputed this request ("" if it did not)
    spent: float | None = None  # share of the document rows recomputed over every pass: ``ratio``, plus the
    # first blend's share when the near-tie guard recomputed the request (its exact path counts 1.0)
    # a blend's document rows recomputed above each of its check layers, in order: ``ratio`` and the segments'
    # ``recomputed`` count the first check's selection; a later check layer (gradual filtering) narrows it
    check_rows: tuple[int, ...] = ()

    @property
    def gate_ran(self) -> bool:
        """Whether the blend quality gate ran (once per model) before this request."""
        return self.timings.gate_s > 0.0

    @property
    def prompt_tokens(self) -> int:
        return sum(s.tokens for s in self.segments)

    @property
    def reused_tokens(self) -> int:
        """Rows whose KV came from the store (exact, blended or semantic; not a semantic document's
        forced rows)."""
        return sum(s.reused for s in self.segments)

    @property
    def recomputed_tokens(self) -> int:
        """Reused rows that were recomputed above the check layer."""
        return sum(s.recomputed for s in self.segments)

    @property
    def computed_tokens(self) -> int:
        """Rows computed in full for this request (misses, fallbacks, the question)."""
        return self.prompt_tokens - self.reused_tokens

    def to_dict(self) -> dict:
        return {
            "policy": self.policy,
            "applied": self.applied.value,
            "asked": self.asked.value,
            "segments": [s.to_dict() for s in self.segments],
            "prompt_tokens": self.prompt_tokens,
            "reused_tokens": self.reused_tokens,
            "recomputed_tokens": self.recomputed_tokens,
            "computed_tokens": self.computed_tokens,
            "selector": self.selector,
            "ratio": self.ratio,
            "deviation": self.deviation.to_dict() if self.deviation else None,
            "gate": self.gate,
            "gate_ran": self.gate_ran,
            "timings": self.timings.to_dict(),
            "first_token_margin": self.first_token_margin,
            "guard": self.guard,
            "spent": self.spent,
            "check_rows": list(self.check_rows),
        }
