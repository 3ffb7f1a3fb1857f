"""The refusal rules of a :class:`~blend.policy.ReusePolicy`: settings its mode or budget never reads.

A setting the request's path would never read is refused (:class:`~blend.errors.InvalidPolicyError`,
a 400 in the server, exit 2 in the CLI), not dropped without a word:

- under ``exact`` or ``none``, every blend setting away from its default;
- in a blend: ``prefix_limit``; a fixed ratio beside an adaptive budget, a threshold or other
  ``layer_ratios``; ``max_ratio`` beside a fixed ratio; ``auto_target`` beside any budget but ``auto``;
  a selector other than ``probe`` under the adaptive budget; a K/V-deviation ranking at check layer 0;
- the near-tie guard's ``guard_ratio`` and ``guard_mode`` while the guard is off (``guard_margin`` None);
- the query probe's ``candidates`` and ``probe_precision`` with a selector that never runs the probe.

Each setting is compared with the dataclass's own default, so the rules and the fields cannot drift; kvblend
serve refuses its blend options under exact or none with the same list and comparison (:data:`BLEND_OPTIONS`,
:func:`setting_changed`), so the server and the policy cannot drift either.
The policy checks each value on its own (types, ranges) before these rules run.
"""

from __future__ import annotations

from dataclasses import fields
from enum import Enum
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Mapping

from blend.errors import InvalidPolicyError
from blend.policy_types import DEVIATION_SELECTORS, PROBE_SELECTORS, RECOMPUTE_PRECISION_FIELDS, BudgetMode, ReuseMode

if TYPE_CHECKING:
    from blend.policy import ReusePolicy

# settings only a blend reads, refused away from their defaults elsewhere (semantic, take_exact and the precisions
# have messages of their own; force only permits, and forces nothing outside a blend)
BLEND_ONLY_FIELDS = ("ratio", "selector", "check_layers", "layer_ratios", "min_prompt_tokens", "threshold", "max_ratio",
                     "seed", "budget", "auto_target", "probe_precision", "guard_margin", "guard_ratio", "candidates",
                     "guard_mode", "reused_temperature")
# every setting only a blend reads, each refused away from its default under exact or none: BLEND_ONLY_FIELDS here,
# semantic, take_exact and the precisions by ReusePolicy. A surface that takes settings by name before it builds
# a policy (kvblend serve's ``kvblend`` options) refuses the same ones with this list (setting_changed)
BLEND_OPTIONS = (*BLEND_ONLY_FIELDS, "semantic", "take_exact", *(name for name, _ in RECOMPUTE_PRECISION_FIELDS))
# settings only the near-tie guard reads (a guarded blend's second pass): refused while the guard is off
GUARD_FIELDS = ("guard_ratio", "guard_mode")
# settings only the query probe reads (the selectors in PROBE_SELECTORS; the adaptive budget needs one)
PROBE_FIELDS = ("candidates", "probe_precision")


@lru_cache(maxsize=None)
def field_defaults(cls: type) -> dict[str, Any]:
    """Each field's default as the dataclass ``cls`` declares it (what the rules compare settings with).

    Args:
        cls: a dataclass type (:class:`~blend.policy.ReusePolicy`, ...).

    Returns:
        Field name to default (``dataclasses.MISSING`` for a field without one, or with a default factory).
    """
    return {f.name: f.default for f in fields(cls)}


def setting_changed(name: str, value: Any, defaults: Mapping[str, Any]) -> bool:
    """Whether ``value`` of the setting ``name`` is away from its default.

    Args:
        name: a :class:`~blend.policy.ReusePolicy` field.
        value: its value; a list compares as a tuple (check_layers=[1] is the default (1,)), and an enum's
            value as the enum (``"restart"`` is the default ``GuardMode.RESTART``, as a client names it).
        defaults: every field's default (:func:`field_defaults`).

    Returns:
        True where the value differs from the default.
    """
    default = defaults[name]
    if isinstance(value, list):
        value = tuple(value)
    if isinstance(default, Enum) and not isinstance(value, Enum):
        default = default.value
    return value != default


def _changed(p: "ReusePolicy", name: str) -> bool:
    """Whether ``p``'s setting ``name`` is away from its default."""
    return setting_changed(name, getattr(p, name), field_defaults(type(p)))


def check_no_blend_settings(p: "ReusePolicy") -> None:
    """An exact or no-reuse policy: a blend setting away from its default is refused, not ignored.

    Args:
        p: a policy whose mode is not ``blend``.

    Raises:
        InvalidPolicyError: naming the first such setting.
    """
    for name in BLEND_ONLY_FIELDS:
        if _changed(p, name):
            raise InvalidPolicyError(f"{name} is a blend setting: it would be ignored under mode "
                                     f"{p.mode.value!r} (use ReusePolicy.blend(...))",
                                     (name, "mode"))


def check_blend_rules(p: "ReusePolicy") -> None:
    """Combinations a blend would run without doing what they say: refused.

    Args:
        p: a blend policy whose values were each checked.

    Raises:
        InvalidPolicyError: naming the combination.
    """
    ranks_deviation = p.selector in DEVIATION_SELECTORS or p.budget is BudgetMode.AUTO or p.threshold is not None
    if 0 in p.check_layers and ranks_deviation:
        raise InvalidPolicyError(
            "check layer 0 cannot rank by K/V deviation: layer 0's K/V depend on the token alone, so fresh "
            "and cached rows are equal there and every deviation is 0; use check_layers >= 1, or selector "
            "probe_attn, query, lead or random at a fixed ratio", ("selector",))
    if p.budget is BudgetMode.AUTO and p.selector != "probe":
        raise InvalidPolicyError(f"the adaptive budget ranks rows by the probe score (selector probe); "
                                 f"selector {p.selector!r} would be ignored", ("selector",))
    if p.budget is BudgetMode.AUTO and p.threshold is not None:
        raise InvalidPolicyError("budget auto and threshold are two stopping rules: give one", ("budget", "threshold"))
    if p.prefix_limit is not None:
        raise InvalidPolicyError("prefix_limit is an exact-reuse setting: a blend looks up every document "
                                 "(use ReusePolicy.exact(prefix_limit=...))")
    _check_budget_settings(p)


def _check_budget_settings(p: "ReusePolicy") -> None:
    """Each budget reads its own settings (a fixed ``ratio`` or ``layer_ratios``; an adaptive budget's or a
    threshold's cap ``max_ratio``; the adaptive budget's ``auto_target``): one set for another is refused."""
    defaults = field_defaults(type(p))
    per_prompt = p.budget is BudgetMode.AUTO or p.threshold is not None
    rule = "an adaptive budget" if p.budget is BudgetMode.AUTO else "a threshold"
    if per_prompt and p.ratio not in (defaults["ratio"], p.max_ratio):
        raise InvalidPolicyError(
            f"ratio={p.ratio:g} is a fixed budget: {rule} picks each prompt's share itself, up to "
            f"max_ratio={p.max_ratio:g}, and would ignore it (to cap the share at {p.ratio:g}, set "
            f"max_ratio={p.ratio:g} instead)", ("ratio",))
    if p.layer_ratios is not None and p.ratio not in (defaults["ratio"], p.layer_ratios[0]):
        raise InvalidPolicyError(f"ratio={p.ratio:g} beside layer_ratios {tuple(p.layer_ratios)}: the first "
                                 f"check layer recomputes layer_ratios[0] and would ignore it", ("ratio",))
    if not per_prompt and p.max_ratio != defaults["max_ratio"]:
        raise InvalidPolicyError(
            f"max_ratio caps an adaptive budget or a threshold; a fixed ratio ({p.ratio:g}) is its own "
            f"budget and would ignore max_ratio={p.max_ratio:g}")
    if p.budget is not BudgetMode.AUTO and p.auto_target != defaults["auto_target"]:
        raise InvalidPolicyError(f"auto_target is the stopping target of budget auto: budget {p.budget.value} "
                                 f"would ignore it", ("budget",))


def check_guard_and_probe_settings(p: "ReusePolicy") -> None:
    """A blend: the near-tie guard's settings while it is off, and the query probe's with a selector that never
    runs it, are refused (each would be ignored).

    Args:
        p: a blend policy whose values (``guard_mode`` and ``probe_precision`` enums included) were each checked.

    Raises:
        InvalidPolicyError: naming the first such setting.
    """
    if p.mode is not ReuseMode.BLEND:
        return
    if p.guard_margin is None:
        for name in GUARD_FIELDS:
            if _changed(p, name):
                raise InvalidPolicyError(f"{name} is a setting of the near-tie guard, which is off (guard_margin "
                                         f"off): it would be ignored (give guard_margin to guard the blend)")
    if p.selector not in PROBE_SELECTORS:  # (the adaptive budget needs the probe selector: checked before)
        for name in PROBE_FIELDS:
            if _changed(p, name):
                raise InvalidPolicyError(f"{name} is a setting of the query probe, which selector {p.selector!r} "
                                         f"never runs (only {' and '.join(PROBE_SELECTORS)} do): it would be "
                                         f"ignored", (name, "selector"))
