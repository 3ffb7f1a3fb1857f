"""The vocabulary of a :class:`~blend.policy.ReusePolicy`: its modes, selectors, budgets, precisions and guard
modes, and the names the CLI, the server and the eval method specs accept for them.

Nothing here imports the rest of kvblend beyond its defaults, so the policy, its refusal rules
(:mod:`blend.policy_rules`) and every surface that names a setting can share one list.
"""

from __future__ import annotations

from enum import Enum

from blend.defaults import DEFAULT_ATTENTION_PRECISION, DEFAULT_LINEAR_PRECISION

SELECTOR_NAMES = ("v", "k", "kv", "lead", "query", "random", "combo", "split", "probe", "probe_attn")
PROBE_SELECTORS = ("probe", "probe_attn")  # selectors that need the query probe (issue 14)
# selectors that rank by fresh-vs-cached K/V deviation: meaningless at check layer 0, where a row's K/V
# depend on its token alone, so fresh and cached rows are the same numbers and every score is 0
DEVIATION_SELECTORS = ("v", "k", "kv", "combo", "split", "probe")


class BudgetMode(Enum):
    """How many rows a blend recomputes: a fixed ratio, or per prompt up to max_ratio (issue 14)."""

    FIXED = "fixed"
    AUTO = "auto"


class ProbePrecision(Enum):
    """The dtype of the query probe's GEMMs. The probe's numbers only rank rows: the blend's
    own pass (the KV and logits the answer uses) runs in the engine's dtype (its attention and linear
    layers above the last check layer in :class:`RecomputePrecision`'s)."""

    COMPUTE = "compute"  # the engine's compute dtype
    BF16 = "bf16"  # bfloat16 weights and activations at the GEMMs; attention and norms in the compute dtype
    AUTO = "auto"  # BF16 for a float32 engine on a CPU with native bf16 (AVX-512 BF16 or AMX), else COMPUTE


PROBE_PRECISION_NAMES = tuple(p.value for p in ProbePrecision)


class RecomputePrecision(Enum):
    """The dtype of part of a blend's work on its recomputed rows above its last check layer: their
    attention (``ReusePolicy.attention_precision``: q, K and V read in it; the flash kernel keeps its
    softmax and sums in float32) or their linear layers (``linear_precision``: QKV, output and MLP GEMMs
    on a bf16 copy of the weights; the residual stream stays in the engine's dtype). Below that layer,
    the check layer, the probe, the KV the cache keeps, the LM head and decoding stay in the engine's
    dtype, so the rows a blend recomputes are the same either way; only the numbers of the layers above
    move (by bf16 rounding)."""

    COMPUTE = "compute"  # the engine's compute dtype
    BF16 = "bf16"  # bfloat16 (a float32 engine's cache is cast per layer for the attention)
    AUTO = "auto"  # BF16 for a float32 engine on a CPU with native bf16 (AVX-512 BF16 or AMX), else COMPUTE


RECOMPUTE_PRECISION_NAMES = tuple(p.value for p in RecomputePrecision)
# the policy's RecomputePrecision fields and their defaults
RECOMPUTE_PRECISION_FIELDS = (("attention_precision", DEFAULT_ATTENTION_PRECISION),
                              ("linear_precision", DEFAULT_LINEAR_PRECISION))


class GuardMode(Enum):
    """How the near-tie guard's second pass (a blend at ``guard_ratio`` < 1) is computed."""

    # a second blend from the start: fetch, re-position, probe, candidates, check, every layer
    RESTART = "restart"
    # the first pass's rows entering its first check layer go on at the guard ratio: the rows the
    # selector keeps there among the first pass's candidates (every row the first pass recomputed
    # among them) through the layers above. (Recomputing only the rows the first pass had not, keeping
    # its KV for the rest, measured no better than no guard in KL: BENCHMARKS.md, 2026-12-06 (15).)
    WIDEN = "widen"


GUARD_MODE_NAMES = tuple(m.value for m in GuardMode)


class ReuseMode(Enum):
    """What a request may reuse: nothing, an exact prefix (the default), or blended chunk KV."""

    NONE = "none"
    EXACT = "exact"
    BLEND = "blend"

