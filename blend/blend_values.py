"""The values a blended prefill answers with (:mod:`blend.blending`): its outcome, and what a second
pass over its cache (the near-tie guard's :func:`~blend.blending.widen_blend`) starts from: the rows
entering its first check layer, what the request fetched and the plan."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blend.blend_plan import BlendPlan
from blend.policy import ReuseMode, ReusePolicy
from blend.probe_pass import ProbeResult
from blend.prompt import Prompt
from blend.report import DeviationStats, SegmentReport
from blend.segment_values import ChunkKV


@dataclass(frozen=True)
class BlendOutcome:
    """What a blended prefill produced (the engine turns it into the report)."""

    logits: torch.Tensor | None  # (V,) float32 first-token logits (None: the question was left to the caller)
    segments: tuple[SegmentReport, ...]
    deviation: DeviationStats | None
    lookup_s: float  # store lookups and loads
    ratio: float | None = None  # the share an adaptive budget or a threshold selected (None: the policy's ratio)
    # whether any document row kept KV computed elsewhere (re-positioned chunk KV not recomputed): the same
    # on a cold request, whose chunks were computed canonically just before, as on a warm one
    approximate: bool = False
    # what a second pass over this cache needs (a guarded policy whose guard may widen it), else None
    resume: "BlendResume | None" = None
    check_rows: tuple[int, ...] = ()  # document rows recomputed above each check layer, in order
    # BLEND; EXACT where no document was re-positioned (every one exact at its place): the exact path ran
    applied: ReuseMode = ReuseMode.BLEND


@dataclass(frozen=True)
class CheckInput:
    """A blended pass's rows entering its first check layer: where a second selection (the near-tie
    guard's, :func:`~blend.blending.widen_blend`) starts again without redoing the probe or the layers below."""

    layer: int  # the first check layer
    active: torch.Tensor  # (A,) sorted rows relative to e active there: candidates, forced rows, the question
    h: torch.Tensor  # (A, C) their hidden rows entering that layer
    probe: ProbeResult | None  # the query probe's result (the same for any later selection)
    selected: torch.Tensor  # (S,) sorted document rows the pass kept there (recomputed above it)


@dataclass(frozen=True)
class BlendContext:
    """What a blended request fetched, for its report: the prompt, each document's KV (the exact ones
    first) and the rows before the documents'."""

    prompt: Prompt
    chunks: tuple[ChunkKV, ...]
    n_exact: int  # documents loaded as an exact prefix
    head: tuple[SegmentReport, ...]  # the preamble's report row


@dataclass(frozen=True)
class BlendResume:
    """A finished blend that a second pass may widen: its plan (the cache's re-positioned rows stay
    valid), its policy, its first check layer's input and what its report needs."""

    plan: "BlendPlan"
    policy: ReusePolicy
    at: CheckInput
    context: BlendContext
    # the cache's length when the pass finished: a widened pass refuses a cache that has grown since
    length: int
