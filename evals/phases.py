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

It also counts the request's *work* (:class:`Work`), whatever phase it falls in:
attention pairs (a query and a key it can see, summed over the attention calls
of every layer, the query probe's included; heads not counted) and layer rows
(rows through a layer's QKV projection, summed over layers). Against a full
prefill of the same prompt (``T (T + 1) / 2`` pairs and ``T`` rows per layer)
these say how much of the full prefill's arithmetic a method still does, and so
what it would cost at the full prefill's own speed per pair and per row
(:func:`work_floor`): the floor a faster kernel alone cannot lower.

The clock is for benchmarks only: it patches module attributes while it is
active and restores them on exit; the engine never imports it. A wrapper
costs about a microsecond per call (a few hundred calls per prefill); counting
a blend's or the probe's pairs sorts the key positions once per call.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable

import torch

import blend.blend_fetch as blend_fetch
import blend.blend_plan as blend_plan
import blend.blending as blending
import blend.model as model
import blend.probe_pass as probe_pass
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


@dataclass
class Work:
    """What a request computed, counted while a clock ran (see the module docstring)."""

    attention_pairs: int = 0  # (query, visible key) pairs over every attention call of every layer
    layer_rows: int = 0  # rows through a layer's QKV projection, summed over layers

    def share_of(self, full: "Work") -> tuple[float, float]:
        """(attention pairs, layer rows) as shares of ``full``'s (a full prefill of the same prompt)."""
        return (self.attention_pairs / max(full.attention_pairs, 1), self.layer_rows / max(full.layer_rows, 1))


def work_floor(pairs_share: float, rows_share: float, full_attention_share: float) -> float:
    """What a method's work costs at the full prefill's own speed, as a share of the full prefill's TTFT.

    Args:
        pairs_share, rows_share: the method's attention pairs and layer rows over the full prefill's
            (:meth:`Work.share_of`).
        full_attention_share: the full prefill's attention time over its TTFT; the rest of its time is
            charged per layer row.

    Returns:
        ``pairs_share * a + rows_share * (1 - a)``: below it only a method that does less work, or runs
        its work faster than the full prefill runs the same work, can go.
    """
    return pairs_share * full_attention_share + rows_share * (1.0 - full_attention_share)


def causal_pairs(queries: int, keys: int) -> int:
    """Pairs of ``queries`` rows that are the last of ``keys`` rows, causal: each sees every earlier key and
    itself."""
    return queries * (keys - queries) + queries * (queries + 1) // 2


def visible_pairs(q_pos: torch.Tensor, k_pos: torch.Tensor) -> int:
    """Pairs of queries at ``q_pos`` (S,) and keys at ``k_pos`` (T,) with the key's position <= the query's."""
    return int(torch.searchsorted(torch.sort(k_pos).values, q_pos, right=True).sum())


def _mask_pairs(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, causal: bool) -> int:
    """Pairs of :func:`blend.model.attend`: causal, an additive (S, T) mask's finite entries, or all."""
    if causal:
        return causal_pairs(q.shape[1], k.shape[1])
    if mask is None:
        return q.shape[1] * k.shape[1]
    return int(torch.isfinite(mask).sum())


class PhaseClock(AbstractContextManager):
    """Times the engine's steps by phase while active (see the module docstring).

    Args:
        check_layer: layers below it count as ``EARLY_LAYERS`` (None: no check layer).
    """

    def __init__(self, check_layer: int | None) -> None:
        self.check_layer = check_layer
        self.times = PhaseTimes()
        self.work = Work()
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

    def _wrap(self, owner: Any, name: str, wrapper: Callable[[Callable], Callable]) -> None:
        """Replace ``owner.name`` with ``wrapper(original)`` until the clock exits."""
        fn = getattr(owner, name)
        self._saved.append((owner, name, fn))
        setattr(owner, name, wrapper(fn))

    def _patch(self, owner: Any, name: str, phase: Phase, when: Callable[..., bool] | None = None) -> None:
        self._wrap(owner, name, lambda fn: self._timed(phase, fn, when))

    def _counted(self, owner: Any, name: str, pairs: Callable[..., int] | None = None,
                 rows: Callable[..., int] | None = None) -> None:
        """Wrap ``owner.name`` to add its call's attention pairs and layer rows to :attr:`work`."""
        def counting(fn: Callable) -> Callable:
            def counter(*args, **kwargs):
                if pairs is not None:
                    self.work.attention_pairs += pairs(*args, **kwargs)
                if rows is not None:
                    self.work.layer_rows += rows(*args, **kwargs)
                return fn(*args, **kwargs)
            return counter
        self._wrap(owner, name, counting)

    def __enter__(self) -> "PhaseClock":
        if self.check_layer is not None:
            self._patch(model, "layer_forward", Phase.EARLY_LAYERS,
                        lambda w, dims, layer, h, rows: layer < self.check_layer)
        for owner, name, phase in [
            (segments.SegmentCache, "lookup", Phase.LOOKUP),
            (blend_fetch, "fetch_chunks", Phase.LOOKUP),
            (model.ModelRunner, "load", Phase.LOOKUP),
            (model.ModelRunner, "load_many", Phase.LOOKUP),  # stored runs (exact prefixes, exact documents)
            (blending.Checker, "select", Phase.CHECK),
            (blending, "run_probe", Phase.CHECK),
            (blending, "run_probe_first", Phase.CHECK),
            (blend_plan, "rope_rows", Phase.ROPE),
            (blend_plan.BlendPlan, "prepare", Phase.ROPE),
            (blending, "apply_rope", Phase.ROPE),
            (model, "apply_rope", Phase.ROPE),
            (model, "project_qkv", Phase.PROJECTIONS),
            (model, "attn_out", Phase.PROJECTIONS),
            (model, "attend", Phase.ATTENTION),
            (model, "attend_suffix", Phase.ATTENTION),
            (model, "causal_suffix_attention_parts", Phase.ATTENTION),
            (blending, "sparse_query_attention", Phase.ATTENTION),
            (model, "mlp_block", Phase.MLP),
            (model.ModelRunner, "logits", Phase.LOGITS),
        ]:
            self._patch(owner, name, phase)
        # the counters wrap the timers (installed after them): counting is not the counted step's phase
        self._counted(model, "project_qkv", rows=lambda w, dims, x: x.shape[0])
        self._counted(model, "attend",
                      pairs=lambda q, k, v, scale, mask, causal=False: _mask_pairs(q, k, mask, causal))
        self._counted(model, "attend_suffix", pairs=lambda q, k, v, scale: causal_pairs(q.shape[1], k.shape[1]))
        self._counted(model, "causal_suffix_attention_parts",
                      pairs=lambda q, k_pre, v_pre, k_own, v_own, scale: causal_pairs(q.shape[1],
                                                                                     k_pre.shape[1] + q.shape[1]))
        self._counted(blending, "sparse_query_attention",
                      pairs=lambda q, q_pos, k, v, k_pos, *a, **kw: visible_pairs(q_pos, k_pos))
        self._counted(probe_pass, "attention_probs",
                      pairs=lambda q, q_pos, k, v, k_pos, *a, **kw: visible_pairs(q_pos, k_pos))
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, fn in reversed(self._saved):
            setattr(owner, name, fn)
        self._saved.clear()
