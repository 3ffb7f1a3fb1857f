"""Where a prefill's time goes: a phase clock over the engine's own steps.

:class:`PhaseClock` wraps the functions one request passes through (store
lookups, re-positioning, the layer steps, the check, the logits) for the
duration of a ``with`` block, and adds each call's *exclusive* time (its own,
minus that of wrapped calls inside it) to its :class:`Phase`. Some phases
absorb what they call: a layer before the check layer counts whole as
``EARLY_LAYERS``, the check step (the query probe included) whole as
``CHECK``, a lookup whole as ``LOOKUP``. What the wrapped calls do not cover
(Python between them, small tensor ops, the report) is the remainder,
``OTHER = ttft - sum(phases)``.

The clock is for benchmarks only: it patches module attributes while it is
active and restores them on exit; the engine never imports it. A wrapper
costs about a microsecond per call (a few hundred calls per prefill).
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable

import blend.blending as blending
import blend.model as model
import blend.segments as segments


class Phase(Enum):
    """The phases of one prefill, in request order."""

    LOOKUP = "store lookup and load"
    EARLY_LAYERS = "layers before the check"
    CHECK = "check and select (probe included)"
    ROPE = "re-positioning and RoPE"
    PROJECTIONS = "QKV and output projections"
    ATTENTION = "attention"
    MLP = "MLP"
    LOGITS = "logits"
    OTHER = "Python and the rest"


ABSORBING = frozenset({Phase.LOOKUP, Phase.EARLY_LAYERS, Phase.CHECK})


@dataclass
class _Frame:
    phase: Phase
    children: float = 0.0


@dataclass
class PhaseTimes:
    """Seconds per phase of the calls made while a clock ran."""

    seconds: dict[Phase, float] = field(default_factory=lambda: {p: 0.0 for p in Phase})

    def add(self, phase: Phase, s: float) -> None:
        self.seconds[phase] += s

    def with_remainder(self, total_s: float) -> dict[Phase, float]:
        """The phases with ``OTHER`` set to ``total_s`` minus every measured phase."""
        out = dict(self.seconds)
        out[Phase.OTHER] = max(0.0, total_s - sum(v for p, v in out.items() if p is not Phase.OTHER))
        return out


class PhaseClock(AbstractContextManager):
    """Times the engine's steps by phase while active (see the module docstring).

    Args:
        check_layer: layers below it count as ``EARLY_LAYERS`` (None: no check layer).
    """

    def __init__(self, check_layer: int | None) -> None:
        self.check_layer = check_layer
        self.times = PhaseTimes()
        self._stack: list[_Frame] = []
        self._saved: list[tuple[Any, str, Any]] = []

    def _timed(self, phase: Phase, fn: Callable, when: Callable[..., bool] | None = None) -> Callable:
        def wrapper(*args, **kwargs):
            if (self._stack and self._stack[-1].phase in ABSORBING) or (when is not None and not when(*args)):
                return fn(*args, **kwargs)
            frame = _Frame(phase)
            self._stack.append(frame)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.perf_counter() - t0
                self._stack.pop()
                self.times.add(phase, spent - frame.children)
                if self._stack:
                    self._stack[-1].children += spent
        return wrapper

    def _patch(self, owner: Any, name: str, phase: Phase, when: Callable[..., bool] | None = None) -> None:
        fn = getattr(owner, name)
        self._saved.append((owner, name, fn))
        setattr(owner, name, self._timed(phase, fn, when))

    def __enter__(self) -> "PhaseClock":
        if self.check_layer is not None:
            self._patch(model, "layer_forward", Phase.EARLY_LAYERS,
                        lambda w, dims, layer, h, rows: layer < self.check_layer)
        for owner, name, phase in [
            (segments.SegmentCache, "lookup", Phase.LOOKUP),
            (segments.SegmentCache, "fetch_chunks", Phase.LOOKUP),
            (model.ModelRunner, "load", Phase.LOOKUP),
            (blending.Checker, "select", Phase.CHECK),
            (blending, "run_probe", Phase.CHECK),
            (blending, "run_probe_first", Phase.CHECK),
            (blending, "rope_rows", Phase.ROPE),
            (blending.BlendPlan, "prepare", Phase.ROPE),
            (blending, "apply_rope", Phase.ROPE),
            (model, "apply_rope", Phase.ROPE),
            (model, "project_qkv", Phase.PROJECTIONS),
            (model, "attn_out", Phase.PROJECTIONS),
            (model, "attend", Phase.ATTENTION),
            (model, "attend_suffix", Phase.ATTENTION),
            (blending, "sparse_query_attention", Phase.ATTENTION),
            (model, "mlp_block", Phase.MLP),
            (model.ModelRunner, "logits", Phase.LOGITS),
        ]:
            self._patch(owner, name, phase)
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, fn in reversed(self._saved):
            setattr(owner, name, fn)
        self._saved.clear()
