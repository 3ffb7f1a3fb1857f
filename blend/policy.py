"""ReusePolicy: what a request may reuse. Exact reuse is the default.

- ``ReusePolicy.none()``: no store: the exact path's segment schedule with the
  store switched off, so it is bit-identical to a cold (and a warm) exact run.
- ``ReusePolicy.exact()``: prefix reuse only; bit-identical to a cold run.
- ``ReusePolicy.blend(...)``: explicit opt-in to non-prefix reuse of canonical
  chunk KV with selective recompute.
- ``semantic=True`` on a blend policy additionally needs the engine's
  experimental flag (donor KV from non-identical tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from blend.defaults import (
    DEFAULT_ATTENTION_PRECISION, DEFAULT_AUTO_TARGET, DEFAULT_CANDIDATES, DEFAULT_CHECK_LAYERS, DEFAULT_GUARD_MARGIN,
    DEFAULT_GUARD_MODE, DEFAULT_GUARD_RATIO, DEFAULT_LINEAR_PRECISION, DEFAULT_MAX_RATIO, DEFAULT_MIN_PROMPT_TOKENS,
    DEFAULT_PROBE_PRECISION, DEFAULT_RATIO, DEFAULT_REUSED_TEMPERATURE, DEFAULT_SELECTOR, MAX_SEED,
    REUSED_TEMPERATURE_RANGE,
)
from blend.errors import InvalidPolicyError
from blend.numeric import finite_real, integral, shown
from blend.policy_rules import (
    check_blend_rules, check_guard_and_probe_settings, check_no_blend_settings, field_defaults,
)
from blend.policy_types import (
    GUARD_MODE_NAMES, PROBE_PRECISION_NAMES, PROBE_SELECTORS, RECOMPUTE_PRECISION_FIELDS, RECOMPUTE_PRECISION_NAMES,
    SELECTOR_NAMES, BudgetMode, GuardMode, ProbePrecision, RecomputePrecision, ReuseMode,
)
from blend.prompt import is_unicode

# the policy's vocabulary lives in blend.policy_types; importers take it from here with the policy
__all__ = ["GUARD_MODE_NAMES", "POLICY_DEFAULTS", "PROBE_PRECISION_NAMES", "PROBE_SELECTORS",
           "RECOMPUTE_PRECISION_FIELDS", "RECOMPUTE_PRECISION_NAMES", "SELECTOR_NAMES", "BudgetMode", "GuardMode",
           "ProbePrecision", "RecomputePrecision", "ReuseMode", "ReusePolicy"]


@dataclass(frozen=True)
class ReusePolicy:
    """Per-request reuse settings (immutable, validated on construction).

    Attributes:
        mode: none / exact / blend.
        prefix_limit: exact mode: only the first N segments may be looked up
            or stored (1 = share the preamble only); None = all but the question.
        ratio: blend: share of reused document tokens recomputed at the first check layer.
        selector: blend: which tokens to recompute (see :data:`SELECTOR_NAMES`).
        check_layers: blend: layers where fresh and cached KV are compared; later
            entries narrow the selection (gradual filtering).
        layer_ratios: ratios at each check layer (gradual filtering); default
            ``ratio`` at every check layer.
        min_prompt_tokens: blend: below this prompt length compute fully (``fallback``).
        threshold: blend: recompute every token whose relative deviation exceeds
            this bound (capped by ``max_ratio``) instead of a fixed ratio.
        max_ratio: cap for threshold mode.
        force: blend even if the model's quality gate failed or never ran.
        semantic: experimental donor reuse (needs the engine flag too).
        seed: RNG seed of the random selector.
        budget: fixed ratio, or ``auto``: per prompt, the fewest rows (ranked by the
            ``probe`` score) whose left-over estimated error is below ``auto_target``,
            at most ``max_ratio`` (issue 14).
        auto_target: the adaptive budget's stopping target.
        cache_salt: mixed into every store key the request derives (exact, canonical):
            requests with different salts share no KV; "" = no salt.
        probe_precision: dtype of the query probe's GEMMs (:class:`ProbePrecision`); probe selectors only
            (refused away from its default with another selector, which never runs the probe).
        attention_precision: blend: dtype of the recomputed rows' attention above the last check
            layer (:class:`RecomputePrecision`); ``bf16`` trades bf16 rounding there for a ~2.5x
            faster attention on CPUs with AMX (BENCHMARKS.md, "bf16 for the recomputed rows").
        linear_precision: blend: dtype of the recomputed rows' linear layers above the last check
            layer (:class:`RecomputePrecision`); ``bf16`` runs them on a bf16 copy of the weights.
        guard_margin: near-tie guard (on by default): when the blend's first-token distribution has
            its top two tokens within this many nats, the request is blended again at
            ``guard_ratio`` (the report says so; TTFT counts both passes). None: off.
        guard_ratio: the guarded requests' ratio; 1.0 runs the exact path over the preamble and the first
            document (both reused: exact there), the rest computed in one pass and not stored (within float
            rounding of exact reuse, ~1e-6; storing it would turn later blends of this order, another
            policy's included, into exact hits). A guard ratio at
            or below the ratio the blend ran at takes the exact path (see :meth:`guard_ratio_for`).
            Refused away from its default while the guard is off (``guard_margin`` None), as is guard_mode.
        guard_mode: how a guard ratio below 1 is computed (:class:`GuardMode`): from the start, or
            going on from the first pass's check layer where its candidates cover the guard ratio
            (cheaper; its selection only ranks the first pass's candidates).
        candidates: probe selectors only (refused away from its default with another selector): None
            computes the layers up to the first check for every document row (each row's V deviation is
            measured); a factor F >= 1 runs the query probe first, over the re-positioned cached KV of every
            layer, and computes those layers only for the F x budget rows the question attends to most (the
            candidates the selector then ranks by probe x V deviation): layer 0's cached KV is exact, so a
            candidate's rows are the same numbers either way, and the rest never needed computing.
        reused_temperature: blend: attention temperature T of the reused (not recomputed) document
            rows at the layers above the first check layer, for every query of the prefill and of
            decoding: their attention logits are divided by T (their K is stored divided by T in the
            request's cache). 1.0: off. APE's temperature for independently encoded context.
        take_exact: blend: documents after the first that this order's exact path stored before (an
            exact request, ``precompute`` under an exact policy, idle-time refinement) are loaded as they
            are (``exact``: no re-positioning, no recompute; a repeat of an exact prompt is then the exact
            path bit for bit). Off by default: the answer would then depend on what the store holds, not
            only on the request and the engine (DESIGN's cold-equals-warm invariant); the first document
            is exact at its canonical position either way.
    """

    mode: ReuseMode = ReuseMode.EXACT
    prefix_limit: int | None = None
    ratio: float = DEFAULT_RATIO
    selector: str = DEFAULT_SELECTOR
    check_layers: tuple[int, ...] = DEFAULT_CHECK_LAYERS
    layer_ratios: tuple[float, ...] | None = None
    min_prompt_tokens: int = DEFAULT_MIN_PROMPT_TOKENS
    threshold: float | None = None
    max_ratio: float = DEFAULT_MAX_RATIO
    force: bool = False
    semantic: bool = False
    seed: int = 0
    budget: BudgetMode = BudgetMode.FIXED
    auto_target: float = DEFAULT_AUTO_TARGET
    cache_salt: str = ""
    probe_precision: ProbePrecision = ProbePrecision(DEFAULT_PROBE_PRECISION)
    guard_margin: float | None = DEFAULT_GUARD_MARGIN
    guard_ratio: float = DEFAULT_GUARD_RATIO
    candidates: float | None = DEFAULT_CANDIDATES
    guard_mode: GuardMode = GuardMode(DEFAULT_GUARD_MODE)
    reused_temperature: float = DEFAULT_REUSED_TEMPERATURE
    take_exact: bool = False
    attention_precision: RecomputePrecision = RecomputePrecision(DEFAULT_ATTENTION_PRECISION)
    linear_precision: RecomputePrecision = RecomputePrecision(DEFAULT_LINEAR_PRECISION)

    def __post_init__(self) -> None:
        def bad_ratio(r: float) -> bool:
            return not finite_real(r) or not 0.0 <= r <= 1.0

        if not isinstance(self.mode, ReuseMode):  # a plain string would fall through to the blend path
            raise InvalidPolicyError(f"mode must be a ReuseMode, got {self.mode!r:.60}", ("mode",))
        if self.prefix_limit is not None and not integral(self.prefix_limit):
            raise InvalidPolicyError(f"prefix_limit must be an integer >= 0 or None, got {shown(self.prefix_limit)}")
        if not isinstance(self.check_layers, (tuple, list)) or not all(map(integral, self.check_layers)):
            raise InvalidPolicyError(f"check_layers must be a sequence of layer numbers, got {self.check_layers!r:.80}")
        if self.layer_ratios is not None and not isinstance(self.layer_ratios, (tuple, list)):
            raise InvalidPolicyError(f"layer_ratios must be a sequence or None, got {self.layer_ratios!r:.80}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < MAX_SEED:
            # torch.Generator.manual_seed (the random selector) takes a Python int, not numpy's
            raise InvalidPolicyError(f"seed must be an integer in [0, 2**63), got {shown(self.seed)}", ("seed",))
        for name in ("force", "semantic", "take_exact"):
            if not isinstance(getattr(self, name), bool):  # "false" is truthy: it would switch it on
                raise InvalidPolicyError(f"{name} must be true or false, got {getattr(self, name)!r:.40}", (name,))
        for name in ("ratio", "max_ratio", "guard_ratio", "auto_target", "reused_temperature"):
            if not finite_real(getattr(self, name)):
                raise InvalidPolicyError(f"{name} must be a finite number, got {shown(getattr(self, name))}", (name,))
        for name in ("threshold", "guard_margin", "candidates"):
            if getattr(self, name) is not None and not finite_real(getattr(self, name)):
                raise InvalidPolicyError(f"{name} must be a finite number or None, got {shown(getattr(self, name))}",
                                         (name,))
        if self.layer_ratios is not None and not all(map(finite_real, self.layer_ratios)):
            raise InvalidPolicyError(f"layer_ratios must be finite numbers, got {self.layer_ratios!r:.80}")

        if bad_ratio(self.ratio):
            raise InvalidPolicyError(f"ratio must be in [0, 1], got {self.ratio}", ("ratio",))
        if bad_ratio(self.max_ratio):
            raise InvalidPolicyError(f"max_ratio must be in [0, 1], got {self.max_ratio}")
        if self.selector not in SELECTOR_NAMES:
            raise InvalidPolicyError(f"unknown selector {self.selector!r}; known: {', '.join(SELECTOR_NAMES)}",
                                     ("selector",))
        if not self.check_layers or list(self.check_layers) != sorted(set(self.check_layers)):
            raise InvalidPolicyError(f"check_layers must be a non-empty increasing list, got {self.check_layers}")
        if any(c < 0 for c in self.check_layers):
            raise InvalidPolicyError(f"check_layers must be >= 0, got {self.check_layers}")
        if self.layer_ratios is not None:
            if len(self.layer_ratios) != len(self.check_layers) or any(map(bad_ratio, self.layer_ratios)):
                raise InvalidPolicyError("layer_ratios needs one ratio in [0, 1] per check layer")
            if list(self.layer_ratios) != sorted(self.layer_ratios, reverse=True):
                raise InvalidPolicyError("layer_ratios must not increase (gradual filtering narrows)")
        # (every number below was checked finite and real above)
        if self.guard_margin is not None and self.guard_margin < 0:
            raise InvalidPolicyError(f"guard_margin must be >= 0 or None, got {self.guard_margin}")
        if self.candidates is not None and self.candidates < 1:
            raise InvalidPolicyError(f"candidates must be a factor >= 1 or None, got {self.candidates}",
                                     ("candidates",))
        t = self.reused_temperature
        lo, hi = REUSED_TEMPERATURE_RANGE
        if not lo <= t <= hi:
            raise InvalidPolicyError(f"reused_temperature must be a number in [{lo:g}, {hi:g}], got {shown(t)}")
        if bad_ratio(self.guard_ratio):
            raise InvalidPolicyError(f"guard_ratio must be in [0, 1], got {self.guard_ratio}")
        if self.threshold is not None and self.threshold < 0:
            raise InvalidPolicyError(f"threshold must be >= 0, got {self.threshold}", ("threshold",))
        if not integral(self.min_prompt_tokens) or self.min_prompt_tokens < 0:
            raise InvalidPolicyError(f"min_prompt_tokens must be an integer >= 0, got {self.min_prompt_tokens}")
        if not isinstance(self.budget, BudgetMode):
            raise InvalidPolicyError(f"budget must be a BudgetMode, got {self.budget!r}", ("budget",))
        if self.auto_target < 0:
            raise InvalidPolicyError(f"auto_target must be >= 0, got {self.auto_target}")
        if self.layer_ratios is not None and (self.budget is BudgetMode.AUTO or self.threshold is not None):
            # each check layer of an adaptive budget or a threshold selects by its own rule: the ratios
            # would be dropped without a word
            raise InvalidPolicyError("layer_ratios are fixed shares per check layer: not with an adaptive "
                                     "budget or a threshold")
        if self.prefix_limit is not None and self.prefix_limit < 0:
            raise InvalidPolicyError("prefix_limit must be >= 0")
        if self.mode is ReuseMode.BLEND:
            check_blend_rules(self)
        if self.semantic and self.mode is not ReuseMode.BLEND:
            raise InvalidPolicyError("semantic reuse is a blend option: use ReusePolicy.blend(..., semantic=True)")
        if self.take_exact and self.mode is not ReuseMode.BLEND:
            raise InvalidPolicyError("take_exact is a blend option (the exact path takes what is stored anyway)")
        if not isinstance(self.guard_mode, GuardMode):
            raise InvalidPolicyError(f"guard_mode must be a GuardMode, got {self.guard_mode!r:.60}")
        if not isinstance(self.probe_precision, ProbePrecision):
            raise InvalidPolicyError(f"probe_precision must be a ProbePrecision, got {self.probe_precision!r}")
        for name, default in RECOMPUTE_PRECISION_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, RecomputePrecision):
                raise InvalidPolicyError(f"{name} must be a RecomputePrecision, got {value!r:.60}")
            if value is not RecomputePrecision(default) and self.mode is not ReuseMode.BLEND:
                raise InvalidPolicyError(f"{name} is a blend option (other modes compute every row in the "
                                         f"engine's dtype)")
        if not isinstance(self.cache_salt, str):
            raise InvalidPolicyError(f"cache_salt must be a string, got {type(self.cache_salt).__name__}")
        if not is_unicode(self.cache_salt):  # part of every store key, as UTF-8
            raise InvalidPolicyError("cache_salt must be valid Unicode text (it holds a lone surrogate)")
        if self.semantic and self.cache_salt:  # donors are shared across salts: that would leak KV
            raise InvalidPolicyError("semantic reuse cannot be combined with a cache_salt")
        if self.mode is not ReuseMode.BLEND:  # settings the request's path never reads (blend.policy_rules)
            check_no_blend_settings(self)
        check_guard_and_probe_settings(self)

    @classmethod
    def none(cls) -> "ReusePolicy":
        """No reuse: no lookup, no store (the exact schedule with the store off)."""
        return cls(mode=ReuseMode.NONE)

    @classmethod
    def one_pass(cls) -> "ReusePolicy":
        """Full prefill in one causal pass over the whole prompt, nothing looked up or stored: the fastest
        full prefill, the reference every benchmark's ratio divides by. :meth:`none` runs the exact path's
        segment-by-segment schedule instead (bit-identical to exact reuse), which reads the weights once per
        segment: 1.5x this at ~600 tokens, 1.1x at ~3k on the 2-core dev box (BENCHMARKS.md, session 22).
        Within float rounding of :meth:`none`."""
        return cls(mode=ReuseMode.EXACT, prefix_limit=0)

    @classmethod
    def exact(cls, prefix_limit: int | None = None, cache_salt: str = "") -> "ReusePolicy":
        """Exact prefix reuse (the default)."""
        return cls(mode=ReuseMode.EXACT, prefix_limit=prefix_limit, cache_salt=cache_salt)

    @classmethod
    def blend(cls, ratio: float = DEFAULT_RATIO, selector: str = DEFAULT_SELECTOR,
              check_layers=DEFAULT_CHECK_LAYERS, **kw) -> "ReusePolicy":
        """Blended reuse: canonical chunk KV re-positioned, ``ratio`` of it recomputed.

        Args:
            ratio: share of reused document tokens to recompute, in [0, 1].
            selector: one of :data:`SELECTOR_NAMES`.
            check_layers: an int or increasing sequence of check layers.
            **kw: any other :class:`ReusePolicy` field.
        """
        layers = (check_layers,) if isinstance(check_layers, int) else tuple(check_layers)
        return cls(mode=ReuseMode.BLEND, ratio=ratio, selector=selector, check_layers=layers, **kw)

    @property
    def needs_probe(self) -> bool:
        """Whether the check layer runs the query probe (the probe selector or the adaptive budget)."""
        return self.mode is ReuseMode.BLEND and (self.selector in PROBE_SELECTORS or self.budget is BudgetMode.AUTO)

    @property
    def guarded(self) -> bool:
        """Whether a near-tie first token sends this blend back for recompute."""
        return self.mode is ReuseMode.BLEND and self.guard_margin is not None

    def guard_ratio_for(self, ratio: float, rows: int | None = None) -> float:
        """The ratio a guarded request is recomputed at, after a blend that ran at ``ratio``.

        Args:
            ratio: the share the first blend recomputed (an adaptive budget's choice included).
            rows: the document rows both shares count (the blend's budget base); where given, the guard
                ratio must recompute more rows than the blend did (round(share x rows), as the check layer
                counts them), not only a larger share: 0.2998 and 0.3 of 824 rows are both 247 rows.

        Returns:
            ``guard_ratio`` when it recomputes more than the blend did, else 1.0 (the exact path):
            a guard never answers a near tie with the same or a smaller budget.
        """
        if rows:
            more = round(self.guard_ratio * rows) > round(ratio * rows)
        else:
            more = self.guard_ratio > ratio
        return self.guard_ratio if more else 1.0

    @property
    def candidate_share(self) -> float:
        """The share of the reused document rows a blend computes up to its first check layer: 1.0, or
        with candidate pre-selection (a probe selector and ``candidates``) F x the largest share that
        check may keep (``max_ratio`` for an adaptive budget or a threshold), at most 1.0."""
        if not (self.needs_probe and self.candidates is not None):
            return 1.0
        share = self.max_ratio if self.budget is BudgetMode.AUTO or self.threshold is not None else self.first_ratio
        return min(1.0, self.candidates * share)

    def guard_widens(self, target: float) -> bool:
        """Whether a guarded recompute at ``target`` goes on from the first pass's check layer (see
        :class:`GuardMode`) rather than blending from the start: its mode says so, ``target`` is a blend
        (below 1.0), the policy has one check layer and its candidates cover ``target``."""
        return (self.guard_mode is not GuardMode.RESTART and target < 1.0 and len(self.check_layers) == 1
                and target <= self.candidate_share)

    def ratio_at(self, i: int) -> float:
        """Recompute ratio at the i-th check layer."""
        return self.ratio if self.layer_ratios is None else self.layer_ratios[i]

    @property
    def full_reuse(self) -> bool:
        """A blend that recomputes no document row: a fixed ratio of 0 at the first check layer (an adaptive
        budget or a threshold decides at the check layer whatever the ratio says). Its pass has no check
        layer: every document row is re-positioned, only the question is computed."""
        return self.first_ratio == 0.0 and self.threshold is None and self.budget is BudgetMode.FIXED

    @property
    def first_ratio(self) -> float:
        """The fixed share the first check layer recomputes: ``layer_ratios[0]`` where given, else ``ratio``
        (what a fixed-ratio blend reports and what its guard compares the guard ratio with)."""
        return self.ratio_at(0)

    def at_guard_ratio(self, ratio: float) -> "ReusePolicy":
        """This blend as its near-tie guard recomputes it: a fixed ``ratio`` at every check layer (explicit
        ``layer_ratios`` dropped: they would narrow the guard's budget back down), unguarded.

        Args:
            ratio: the guard's ratio (:meth:`guard_ratio_for`), below 1.0.

        Returns:
            The second pass's policy.
        """
        # a fixed budget reads neither the cap nor the target, and an unguarded pass none of the guard's settings
        d = POLICY_DEFAULTS
        return replace(self, ratio=ratio, layer_ratios=None, budget=BudgetMode.FIXED, threshold=None,
                       max_ratio=d["max_ratio"], auto_target=d["auto_target"],
                       guard_margin=None, guard_ratio=d["guard_ratio"], guard_mode=d["guard_mode"])

    def _ratios(self) -> str:
        """The fixed ratio, or the explicit per-check-layer ratios, as :meth:`describe` shows them."""
        return f"{self.ratio:g}" if self.layer_ratios is None else ",".join(f"{r:g}" for r in self.layer_ratios)

    def describe(self) -> str:
        if self.mode is not ReuseMode.BLEND:
            return self.mode.value
        checks = ",".join(map(str, self.check_layers))
        what = f"threshold={self.threshold:g}<={self.max_ratio:g}" if self.threshold is not None else self._ratios()
        if self.budget is BudgetMode.AUTO:
            what = f"auto({self.auto_target:g})<={self.max_ratio:g}"
        probe = f":probe={self.probe_precision.value}" if self.needs_probe else ""
        guard = f":guard={self.guard_margin:g}@{self.guard_ratio:g}" if self.guarded else ""
        if self.guarded and self.guard_mode is not GuardMode(DEFAULT_GUARD_MODE):
            guard += f"/{self.guard_mode.value}"
        cand = f":cand={self.candidates:g}" if self.needs_probe and self.candidates is not None else ""
        temp = f":temp={self.reused_temperature:g}" if self.reused_temperature != 1.0 else ""
        # settings that change what runs: the random selector's seed, donor KV (experimental)
        seed = f":seed={self.seed}" if self.selector == "random" else ""
        semantic = ":semantic" if self.semantic else ""
        exact = ":take-exact" if self.take_exact else ""
        attn = f":attn={self.attention_precision.value}" \
            if self.attention_precision is not RecomputePrecision(DEFAULT_ATTENTION_PRECISION) else ""
        attn += f":lin={self.linear_precision.value}" \
            if self.linear_precision is not RecomputePrecision(DEFAULT_LINEAR_PRECISION) else ""
        return f"blend@{what}:{self.selector}{seed}:check={checks}{probe}{cand}{temp}{attn}{guard}{semantic}{exact}"


# every field's default, as the dataclass declares it (blend.policy_rules compares settings with these)
POLICY_DEFAULTS = field_defaults(ReusePolicy)
