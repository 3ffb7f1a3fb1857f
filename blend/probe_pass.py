"""The query probe's pass: the question's rows alone, from the check layer to the top.

At the first check layer c every row's fresh K/V is in the request's cache.
The probe runs the question's rows through layers c..L-1 (the model's one
``layer_forward``, through :class:`ProbeRows`): at c over that fresh layer, above
c over the re-positioned cached KV of every document (what a ratio-0 blend
reads), recording the question's attention to each document row at every
layer. It costs the question's rows through L-c layers (a few percent of a
full prefill). It re-positions every document's cached rows of layers > c in the
cache as it goes (:meth:`BlendPlan.prepare`: once per layer per request), so the
blend's own pass only writes the rows it recomputes there.

With candidate pre-selection (``ReusePolicy.candidates``) the probe runs first
instead (:func:`run_probe_first`): the question's rows from layer 0, over the
re-positioned cached KV at every layer (a ratio-0 blend), before any document row
is computed; the layers it records from the first check layer up are the weights.

Rows are relative to e, the first re-positioned row::

    rows   0 ........ nb-1 | nb ...... n-1
           document rows    | question rows
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from blend.cpu_features import native_on_cpu, this_cpu_flags
from blend.kernels import attention_probs, hidden_keys
from blend.kvcache import KVCache
from blend.model import ModelRunner, layer_attention_only
from blend.policy import RECOMPUTE_PRECISION_FIELDS, ProbePrecision, RecomputePrecision, ReusePolicy
from blend.probe import entropy
from blend.rope import apply_rope

if TYPE_CHECKING:
    from blend.blend_plan import BlendPlan


def bf16_pays(compute: torch.dtype, device: torch.device | None = None,
              flags: frozenset[str] | None = None) -> bool:
    """Whether an AUTO precision picks bf16: a float32 engine on a CPU with native bf16 arithmetic
    (AVX-512 BF16 or AMX: there bf16 GEMMs and attention run ~2.5-3x faster; elsewhere bf16 would be
    emulated and slower).

    Args:
        compute: the engine's compute dtype.
        device: the engine's device (None: a CPU).
        flags: CPU flags (default: this machine's).

    Returns:
        True only for a float32 engine on a CPU whose flags give native bf16.
    """
    if compute != torch.float32 or (device is not None and device.type != "cpu"):
        return False
    return bool(native_on_cpu(torch.bfloat16, this_cpu_flags() if flags is None else flags))


def resolve_probe_precision(precision: ProbePrecision, compute: torch.dtype, device: torch.device | None = None,
                            flags: frozenset[str] | None = None) -> ProbePrecision:
    """What ``precision`` means on this engine: AUTO becomes BF16 or COMPUTE (:func:`bf16_pays`).

    Args:
        precision: the policy's :class:`ProbePrecision`.
        compute: the engine's compute dtype.
        device: the engine's device (AUTO picks bf16 on CPUs only).
        flags: CPU flags for AUTO (default: this machine's).

    Returns:
        The precision, AUTO resolved.
    """
    if precision is not ProbePrecision.AUTO:
        return precision
    return ProbePrecision.BF16 if bf16_pays(compute, device, flags) else ProbePrecision.COMPUTE


def resolve_recompute_precision(precision: RecomputePrecision, compute: torch.dtype,
                                device: torch.device | None = None,
                                flags: frozenset[str] | None = None) -> RecomputePrecision:
    """What a blend's ``attention_precision`` or ``linear_precision`` means on this engine: AUTO becomes
    BF16 or COMPUTE (:func:`bf16_pays`); BF16 on a bf16 engine is COMPUTE (nothing to cast).

    Args:
        precision: the policy's :class:`RecomputePrecision`.
        compute: the engine's compute dtype.
        device: the engine's device (AUTO picks bf16 on CPUs only).
        flags: CPU flags for AUTO (default: this machine's).

    Returns:
        BF16 or COMPUTE.
    """
    if precision is RecomputePrecision.AUTO:
        return RecomputePrecision.BF16 if bf16_pays(compute, device, flags) else RecomputePrecision.COMPUTE
    if precision is RecomputePrecision.BF16 and compute == torch.bfloat16:
        return RecomputePrecision.COMPUTE
    return precision


def resolve_precisions(policy: ReusePolicy, compute: torch.dtype, device: torch.device | None = None,
                       flags: frozenset[str] | None = None) -> ReusePolicy:
    """A blend policy with every precision it names resolved for this engine, so that the report says
    what ran: AUTO becomes BF16 or COMPUTE (:func:`resolve_probe_precision`,
    :func:`resolve_recompute_precision`), and the recomputed rows' precisions are COMPUTE under full
    reuse, which recomputes no document row above a check layer. A policy that runs no probe keeps its
    probe precision as it is.

    Args:
        policy: a blend policy.
        compute, device, flags: as for :func:`resolve_probe_precision`.

    Returns:
        The policy with its precisions resolved.
    """
    recompute = {name: RecomputePrecision.COMPUTE if policy.full_reuse
                 else resolve_recompute_precision(getattr(policy, name), compute, device, flags)
                 for name, _ in RECOMPUTE_PRECISION_FIELDS}
    if not policy.needs_probe:  # no probe runs: its precision stays the default (ReusePolicy refuses another)
        return replace(policy, **recompute)
    return replace(policy, probe_precision=resolve_probe_precision(policy.probe_precision, compute, device, flags),
                   **recompute)


def recompute_dtype(precision: RecomputePrecision, compute: torch.dtype) -> torch.dtype:
    """The dtype a blend's recomputed rows attend in (or run their linear layers in) above its last check
    layer (``precision`` resolved).

    Args:
        precision: the resolved precision (:func:`resolve_recompute_precision`).
        compute: the engine's compute dtype.

    Returns:
        ``torch.bfloat16`` for BF16, else ``compute``.
    """
    return torch.bfloat16 if precision is RecomputePrecision.BF16 else compute


def probe_gemm_dtype(precision: ProbePrecision, compute: torch.dtype, device: torch.device | None = None,
                     flags: frozenset[str] | None = None) -> torch.dtype:
    """The dtype the probe's GEMMs run in (args as for :func:`resolve_probe_precision`).

    Args:
        precision: the policy's :class:`ProbePrecision`.
        compute: the engine's compute dtype.
        device: the engine's device (AUTO picks bf16 on CPUs only).
        flags: CPU flags for AUTO (default: this machine's).

    Returns:
        ``torch.bfloat16`` where the precision resolves to BF16, else ``compute``.
    """
    if resolve_probe_precision(precision, compute, device, flags) is ProbePrecision.BF16:
        return torch.bfloat16
    return compute


@dataclass(frozen=True)
class ProbeResult:
    """What the probe saw."""

    attn: torch.Tensor  # (L - c, nb) float32 question's attention to each document row, per layer
    entropy: float | None  # entropy (nats) of the probe's own first-token distribution (a ratio-0
    # blend's); None when not asked for (only the adaptive budget reads it: the LM head costs a GEMV)

    @property
    def weight(self) -> torch.Tensor:
        """(nb,) mean attention over the probed layers (the ``probe`` selector's weight)."""
        return self.attn.mean(dim=0)


class ProbeRows:
    """:class:`~blend.model.LayerRows` of the probe: question rows over re-positioned cached KV."""

    gemm_tile = None

    def __init__(self, plan: "BlendPlan", cache: KVCache, check: int, scale: float) -> None:
        self.plan, self.cache, self.check, self.scale = plan, cache, check, scale
        self.q_rows = torch.arange(plan.nb, plan.n)  # (Nq,)
        self.k_pos = cache.pos[: plan.e + plan.n]  # (T,)
        # the same at every layer: the question's positions, RoPE tables and causal mask
        self.q_pos = plan.pos[self.q_rows]  # (Nq,)
        self.cos, self.sin = plan.cos[self.q_rows], plan.sin[self.q_rows]  # (Nq, R) each
        self.hidden = hidden_keys(self.q_pos, self.k_pos)
        self.mass: list[torch.Tensor] = []  # (nb,) per probed layer

    def store_kv(self, layer, q, k, v, h):
        if layer > self.check:  # layer c already holds every row's fresh K/V (check -1: none does)
            self.plan.prepare(layer, self.cache)  # every document's cached rows, re-positioned (once)
            self.plan.write_fresh(layer, self.cache, self.q_rows, k, v)  # the question's fresh rows
        return q, h

    def attend(self, layer, q):
        plan = self.plan
        k_all, v_all = self.cache.view(layer, plan.e + plan.n)  # (Hkv, T, D)
        q_rot = apply_rope(q, self.cos, self.sin)  # (Hq, Nq, D)
        out, probs = attention_probs(q_rot, self.q_pos, k_all, v_all, self.k_pos, self.scale, self.hidden)
        self.mass.append(probs.mean(dim=(0, 1))[plan.e:plan.e + plan.nb])  # (nb,)
        return out.transpose(0, 1).reshape(q.shape[1], -1)  # (Nq, Hq D)


def run_probe(model: ModelRunner, plan: "BlendPlan", cache: KVCache, check: int, h_q: torch.Tensor,
              gemm_dtype: torch.dtype | None = None, want_entropy: bool = True) -> ProbeResult:
    """The question's attention to every document row at layers check..L-1.

    The question's fresh K/V the probe writes above the check layer are overwritten by the
    blend's own pass (the question's rows are recomputed at every layer), so a lower-precision
    probe changes which rows are selected, never the numbers of the rows the answer reads.

    Args:
        model: the model runner.
        plan: the request's re-positioned rows.
        cache: the request's cache; layer ``check`` holds fresh K/V of every row [e, e+n).
        check: the first check layer.
        h_q: (Nq, C) the question's hidden rows at the check layer's input.
        gemm_dtype: dtype of the probe's GEMMs (None: the engine's).
        want_entropy: also run the LM head for the entropy of the probe's first-token distribution.

    Returns:
        Per-layer attention and (if asked) the entropy of the probe's first-token distribution.
    """
    return _probe(model, ProbeRows(plan, cache, check, model.dims.scale), h_q, check, 0, gemm_dtype, want_entropy)


def run_probe_first(model: ModelRunner, plan: "BlendPlan", cache: KVCache, check: int,
                    gemm_dtype: torch.dtype | None = None, want_entropy: bool = True) -> ProbeResult:
    """The probe before any document row is computed: the question's rows from layer 0 over the
    re-positioned cached KV of every layer (what a ratio-0 blend reads). Leaves every layer of the
    cache holding each document's re-positioned rows, so the blend's pass only writes its own rows.

    Args:
        model: the model runner.
        plan: the request's re-positioned rows.
        cache: the request's cache, rows [e, e+n) not yet written.
        check: the first check layer: the weights average the layers check..L-1 (as :func:`run_probe`).
        gemm_dtype: dtype of the probe's GEMMs (None: the engine's).
        want_entropy: also run the LM head for the entropy of the probe's first-token distribution.

    Returns:
        The question's attention at layers check..L-1 and (if asked) the entropy.
    """
    h_q = model.embed(plan.ids[plan.nb:])  # (Nq, C) the question's rows at layer 0's input
    return _probe(model, ProbeRows(plan, cache, -1, model.dims.scale), h_q, 0, check, gemm_dtype, want_entropy)


def _probe(model: ModelRunner, rows: ProbeRows, h_q: torch.Tensor, start: int, skip: int,
           gemm_dtype: torch.dtype | None, want_entropy: bool) -> ProbeResult:
    """Run the question's rows ``h_q`` (Nq, C) from layer ``start`` through ``rows``; the result keeps
    the attention of the probed layers after the first ``skip``."""
    layers = model.layers_in(gemm_dtype or model.dtype)
    if want_entropy:  # the LM head reads the top layer's output
        h = model.run_layers(h_q, rows, start=start, layers=layers)  # (Nq, C)
        return ProbeResult(torch.stack(rows.mass[skip:]), entropy(model.logits(h[-1:])[0]))
    # only the attention is read: the top layer stops after it (no output projection, no MLP)
    top = len(layers) - 1
    h = model.run_layers(h_q, rows, start=start, layers=layers[:top])  # (Nq, C) the top layer's input
    layer_attention_only(layers[top], model.dims, top, h, rows)
    return ProbeResult(torch.stack(rows.mass[skip:]), None)
