"""Whether a request's reuse is refused, decided before anything is timed.

:meth:`blend.engine.Engine.prefill` refuses a policy's reuse (the request then runs with none: its
report's ``applied`` is ``none`` and ``gate`` says why) where:

- dynamic-NTK or LongRoPE tables change past their trained length and the prompt is longer: its KV
  depends on the request's length, so nothing is reused or stored (any mode but ``none``);
- a blend's prompt is one segment (a lone question: nothing to blend, no preamble to key);
- a blend's prompt is shorter than its ``min_prompt_tokens``;
- the model has too few layers for the quality gate's blends to run (a blend that would consult it);
- the model's quality gate refuses blending. The engine asks the gate (:func:`consults_gate`) only for
  a blend that is not forced, that no rule above refused and that has a document to re-position: two
  documents or more, or one under semantic reuse (a donor's KV for it is approximate). Without one a
  blend is the exact path (the first document sits where its canonical KV was computed: that KV is its
  exact KV), which the gate has nothing to refuse: a refusal computed the same logits without reuse,
  reported a fallback and ran the gate's first run (seconds; minutes on a real model) for nothing.

The server's scheduler decides a request's refusal once, ahead of its prefill (:func:`refusal_for`, the gate's
first run outside the request's TTFT), and hands it to :meth:`~blend.engine.Engine.prefill`.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from blend.defaults import DEFAULT_CHECK_LAYERS
from blend.errors import InvalidPolicyError
from blend.model import ModelRunner
from blend.policy import ReuseMode, ReusePolicy
from blend.prefill_paths import length_dependent
from blend.prompt import Prompt, SegmentKind

if TYPE_CHECKING:  # the engine calls these with itself; they read its public attributes only
    from blend.engine import Engine

BLENDED_KINDS = frozenset({SegmentKind.DOCUMENT})  # what a refused blend reports as fallback
STORED_KINDS = frozenset({SegmentKind.PREAMBLE, SegmentKind.DOCUMENT})  # what any reuse would have read


@dataclass(frozen=True)
class Refusal:
    """Whether a request's reuse was refused, and what its report says about it."""

    reason: str = ""  # why ("": not refused)
    kinds: frozenset[SegmentKind] = BLENDED_KINDS  # the segment kinds reported as fallback when refused
    gate_s: float = 0.0  # seconds the quality gate ran before this request (0: it did not run)


def rule_refusal(runner: ModelRunner, prompt: Prompt, policy: ReusePolicy, semantic_enabled: bool) -> Refusal:
    """The refusals that need no quality gate.

    Args:
        runner: the engine's model (its RoPE tables and layer count).
        prompt: the request's prompt.
        policy: its policy.
        semantic_enabled: the engine enables experimental semantic reuse.

    Returns:
        The refusal (its ``reason`` "" where no rule refuses).

    Raises:
        InvalidPolicyError: semantic reuse the engine does not enable; check layers outside the model.
    """
    if policy.semantic and not semantic_enabled:  # whatever the prompt's length
        raise InvalidPolicyError(
            "semantic reuse is experimental: enable it in the engine (EngineConfig(experimental_semantic=True) "
            "or --experimental-semantic) as well as in the policy")
    rope = runner.rope
    if policy.mode is not ReuseMode.NONE and length_dependent(rope, prompt):
        name = "LongRoPE" if rope.rope_type == "longrope" else "dynamic-NTK RoPE"
        return Refusal(f"{name} changes past {rope.length_dependent_after} positions: KV depends on the "
                       f"request's length ({len(prompt)}), so nothing is reused or stored", STORED_KINDS)
    if policy.mode is not ReuseMode.BLEND:
        return Refusal()
    n = runner.dims.num_layers
    if policy.check_layers[-1] >= n:
        raise InvalidPolicyError(f"check_layers {policy.check_layers} outside the model's {n} layers (0..{n - 1})")
    if len(prompt.segments) < 2:  # a lone question (bos_prompt): nothing to blend, no preamble to key
        return Refusal("a prompt of one segment has no document to blend")
    if len(prompt) < policy.min_prompt_tokens:
        return Refusal(f"prompt of {len(prompt)} tokens < min_prompt_tokens={policy.min_prompt_tokens}")
    return Refusal()


def consults_gate(engine: "Engine", prompt: Prompt, policy: ReusePolicy) -> bool:
    """Whether the engine's prefill of ``prompt`` under ``policy`` asks its quality gate: a blend, not forced,
    on an engine with a gate, that no rule refuses first (:func:`rule_refusal`) and that has a document to
    re-position (see the module's docstring).

    Args:
        engine: the engine (its gate, model and configuration).
        prompt: the request's prompt.
        policy: its policy.

    Returns:
        True where :func:`refusal_for` asks the gate.

    Raises:
        InvalidPolicyError: a policy the engine refuses (as :func:`rule_refusal`).
    """
    return _gate_decides(engine, prompt, policy) and not gate_cannot_run(engine.runner) and \
        not rule_refusal(engine.runner, prompt, policy, engine.config.experimental_semantic).reason


def refusal_for(engine: "Engine", prompt: Prompt, policy: ReusePolicy,
                gate_lock: AbstractContextManager | None = None) -> Refusal:
    """Whether ``policy``'s reuse is refused for ``prompt``: the rules, then the quality gate where
    :func:`consults_gate` says it is asked (each decided once).

    Args:
        engine: the engine (its gate, model and configuration).
        prompt: the request's prompt.
        policy: its policy.
        gate_lock: held while the gate is asked (the server's scheduler serializes its questions); None: none.

    Returns:
        The refusal (``reason`` "" where reuse may run), with the seconds the gate ran for this request.

    Raises:
        InvalidPolicyError: as :func:`rule_refusal`.
    """
    refusal = rule_refusal(engine.runner, prompt, policy, engine.config.experimental_semantic)
    if refusal.reason or not _gate_decides(engine, prompt, policy):
        return refusal
    cannot = gate_cannot_run(engine.runner)
    if cannot:
        return replace(refusal, reason=cannot)
    with gate_lock or nullcontext():
        verdict = engine.gate.verdict(engine)
    return replace(refusal, reason=verdict.refused, gate_s=verdict.ran_s)


def gate_cannot_run(runner: ModelRunner) -> str:
    """Why the quality gate cannot run on this model ("" where it can): every blend it runs checks at the
    default check layers, which a model of fewer layers lacks (its run raised an error about check layers the
    request never asked for, on every blend request).

    Args:
        runner: the engine's model.

    Returns:
        The refusal's reason, or "".
    """
    n = runner.dims.num_layers
    if DEFAULT_CHECK_LAYERS[-1] < n:
        return ""
    return (f"the quality gate's blends check at layer(s) {DEFAULT_CHECK_LAYERS}, which a model of {n} layer(s) "
            f"(num_hidden_layers={n}) lacks: the gate cannot run; computed fully; force blending with "
            "--force-blend / ReusePolicy.blend(force=True)")


def _gate_decides(engine: "Engine", prompt: Prompt, policy: ReusePolicy) -> bool:
    """A blend, not forced, on an engine with a gate, with a document to re-position: two or more, or one under
    semantic reuse (a donor's KV). A lone document sits where its canonical KV was computed: the blend is the
    exact path, whatever the gate says (its refusal computed the same logits without reuse)."""
    if engine.gate is None or policy.mode is not ReuseMode.BLEND or policy.force:
        return False
    return len(prompt.documents) > 1 or (policy.semantic and bool(prompt.documents))
