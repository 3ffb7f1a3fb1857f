"""Method specs of the harness and their reuse policies.

Grammar (``--methods`` is a comma list of these; commas inside ``check=``
belong to the check list)::

    full                         full prefill, no reuse (always run: the reference)
    prefix                       exact prefix reuse: only the preamble is shared
    reuse                        full KV reuse (blend at ratio 0, no near-tie guard)
    blend@R[:SELECTOR][:check=L1,L2,...][:auto[=T]][:probe=bf16|compute|auto][:cand=F|cand=off][:temp=T]
          [:guard=M@G|guard=off][:gmode=restart|widen][:attn=P][:lin=P]
                                 selective recompute of a fraction R in [0, 1]; with ``auto``
                                 the budget is chosen per prompt (adaptive), R is its cap;
                                 ``probe=`` the dtype of the query probe's GEMMs; ``guard=``
                                 the near-tie guard (the blend's first-token top-2 gap < M
                                 nats: recomputed at ratio G, default the engine's 0.3), ``guard=off`` none;
                                 ``cand=F`` (probe selectors) the probe runs first and only F x
                                 budget candidate rows are computed up to the check layer
                                 (``cand=off``: every row, the behaviour before candidates);
                                 ``temp=T`` the reused rows' attention temperature (1: off);
                                 ``gmode=`` how the guard's second pass runs (``GuardMode``);
                                 ``attn=`` / ``lin=`` the dtype (compute, bf16, auto) of the
                                 recomputed rows' attention / linear layers above the last
                                 check layer (``RecomputePrecision``). A part the blend would
                                 not read is refused, as ReusePolicy refuses it: ``gmode=``
                                 with ``guard=off``; ``cand=`` or ``probe=`` with a selector
                                 that runs no probe (only probe and probe_attn do)

e.g. ``blend@0.15:v``, ``blend@0.1:query``, ``blend@0.15:v:check=1,2``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable

from blend.defaults import DEFAULT_SELECTOR
from blend.errors import InvalidPolicyError
from blend.policy import (
    GUARD_MODE_NAMES, PROBE_PRECISION_NAMES, PROBE_SELECTORS, RECOMPUTE_PRECISION_NAMES, SELECTOR_NAMES, BudgetMode,
    GuardMode, ProbePrecision, RecomputePrecision, ReusePolicy,
)
# the shipped default selector at three budgets, against CacheBlend's V deviation at the middle one
DEFAULT_METHODS = "full,prefix,reuse,blend@0.05:probe,blend@0.15:probe,blend@0.3:probe,blend@0.15:combo,blend@0.15:v"
REFERENCE = "full"


class MethodError(ValueError):
    """A method spec that does not parse."""


class MethodKind(Enum):
    """What a method reuses."""

    FULL = "full"
    PREFIX = "prefix"
    REUSE = "reuse"
    BLEND = "blend"


def known_selectors() -> tuple[str, ...]:
    """Selector names (:data:`blend.policy.SELECTOR_NAMES`, sorted)."""
    return tuple(sorted(SELECTOR_NAMES))


@dataclass(frozen=True)
class Method:
    """One parsed method.

    Attributes:
        name: the spec as written (e.g. ``blend@0.15:v:check=1,2``); key in the results.
        canonical: normalised spec (``blend@1.0`` -> ``blend@1``), for spotting duplicates.
        kind: what is reused.
        ratio: recompute fraction (0.0 for reuse, 1.0 for full, None for prefix).
        selector: token selector name for blend (None: the engine's default).
        check_layers: check layers for blend (empty: the engine's default).
        auto: adaptive budget per prompt, ``ratio`` is its cap (issue 14).
        auto_target: ``auto=T``: the adaptive budget's stopping target (None: the default).
        probe_precision: ``ProbePrecision`` value of the query probe's GEMMs (None: the default).
        guard: the near-tie guard as (margin, ratio); (None, None) switches it off; None: the default.
        attention_precision: ``RecomputePrecision`` value of the recomputed rows' attention (None: the default).
        linear_precision: the same for their linear layers.
    """

    name: str
    kind: MethodKind
    canonical: str = ""
    ratio: float | None = None
    selector: str | None = None
    check_layers: tuple[int, ...] = ()
    auto: bool = False
    auto_target: float | None = None
    probe_precision: str | None = None
    guard: tuple[float | None, float | None] | None = None
    candidates: float | None = None  # the candidate factor (None: the default)
    candidates_off: bool = False  # cand=off: every row up to the check layer
    temperature: float | None = None  # temp=T: the reused rows' attention temperature (None: the default)
    guard_mode: str | None = None  # gmode=: a GuardMode value (None: the default)
    attention_precision: str | None = None  # attn=: a RecomputePrecision value (None: the default)
    linear_precision: str | None = None  # lin=: a RecomputePrecision value (None: the default)

    def policy(self) -> Any:
        """The engine's :class:`blend.policy.ReusePolicy` for this method."""
        if self.kind is MethodKind.FULL:
            return ReusePolicy.one_pass()  # the fastest full prefill: every ratio's reference
        if self.kind is MethodKind.PREFIX:
            return ReusePolicy.exact(prefix_limit=1)
        if self.kind is MethodKind.REUSE:
            return ReusePolicy.blend(ratio=0.0, guard_margin=None)  # the no-recompute floor: never guarded
        kwargs: dict[str, Any] = {"ratio": self.ratio}
        if self.selector is not None:
            kwargs["selector"] = self.selector
        if self.check_layers:
            kwargs["check_layers"] = self.check_layers
        if self.auto:
            kwargs.update(budget=BudgetMode.AUTO, max_ratio=self.ratio)
            if self.auto_target is not None:
                kwargs["auto_target"] = self.auto_target
        if self.probe_precision is not None:
            kwargs["probe_precision"] = ProbePrecision(self.probe_precision)
        if self.candidates is not None or self.candidates_off:
            kwargs["candidates"] = self.candidates
        if self.temperature is not None:
            kwargs["reused_temperature"] = self.temperature
        if self.guard_mode is not None:
            kwargs["guard_mode"] = GuardMode(self.guard_mode)
        if self.attention_precision is not None:
            kwargs["attention_precision"] = RecomputePrecision(self.attention_precision)
        if self.linear_precision is not None:
            kwargs["linear_precision"] = RecomputePrecision(self.linear_precision)
        if self.guard is not None:
            kwargs["guard_margin"] = self.guard[0]
            if self.guard[1] is not None:
                kwargs["guard_ratio"] = self.guard[1]
        return ReusePolicy.blend(**kwargs)

    def series(self) -> str:
        """Plot series label: one line per selector (and check layers) over ratios."""
        if self.kind is not MethodKind.BLEND:
            return self.kind.value
        label = (self.selector or "default") + (" auto" if self.auto else "")
        label += f"={self.auto_target:g}" if self.auto_target is not None else ""
        label += f" probe={self.probe_precision}" if self.probe_precision else ""
        label += f" cand={self.candidates:g}" if self.candidates is not None else ""
        label += " cand=off" if self.candidates_off else ""
        label += f" temp={self.temperature:g}" if self.temperature is not None else ""
        label += f" guard={_fmt_guard(self.guard)}" if self.guard is not None else ""
        label += f" gmode={self.guard_mode}" if self.guard_mode is not None else ""
        label += f" attn={self.attention_precision}" if self.attention_precision is not None else ""
        label += f" lin={self.linear_precision}" if self.linear_precision is not None else ""
        return f"{label} check={','.join(map(str, self.check_layers))}" if self.check_layers else label

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "kind": self.kind.value,
            "ratio": self.ratio,
            "selector": self.selector,
            "check_layers": list(self.check_layers),
            "auto": self.auto,
            "auto_target": self.auto_target,
            "probe_precision": self.probe_precision,
            "guard": None if self.guard is None else list(self.guard),
            "candidates": "off" if self.candidates_off else self.candidates,
            "temperature": self.temperature,
            "guard_mode": self.guard_mode,
            "attention_precision": self.attention_precision,
            "linear_precision": self.linear_precision,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], name: str = "") -> "Method":
        """The method a :meth:`to_dict` JSON describes (a spec written before an option existed lacks it:
        the default).

        Args:
            d: the JSON object.
            name: the method's name (specs do not hold it).

        Returns:
            The method.

        Raises:
            MethodError: an unknown kind.
        """
        try:
            kind = MethodKind(d.get("kind"))
        except ValueError:
            raise MethodError(f"unknown method kind {d.get('kind')!r:.40}") from None
        cand, guard = d.get("candidates"), d.get("guard")
        return cls(name=name, kind=kind, ratio=d.get("ratio"), selector=d.get("selector"),
                   check_layers=tuple(d.get("check_layers") or ()), auto=bool(d.get("auto")),
                   auto_target=d.get("auto_target"), probe_precision=d.get("probe_precision"),
                   guard=None if guard is None else tuple(guard), candidates=None if cand == "off" else cand,
                   candidates_off=cand == "off", temperature=d.get("temperature"), guard_mode=d.get("guard_mode"),
                   attention_precision=d.get("attention_precision"), linear_precision=d.get("linear_precision"))


_BLEND = re.compile(r"^blend@([^:]+)((?::[^:]+)*)$")
PROBE_PRECISIONS = PROBE_PRECISION_NAMES


def _fmt_ratio(r: float) -> str:
    return f"{r:g}"


def _fmt_guard(guard: tuple[float | None, float | None]) -> str:
    if guard[0] is None:
        return "off"
    return f"{guard[0]:g}" + ("" if guard[1] is None else f"@{guard[1]:g}")


def _parse_number(spec: str, part: str, wants: str, valid: Callable[[float], bool]) -> float:
    """The finite number of a ``key=X`` part of a method spec, checked by ``valid``.

    Raises:
        MethodError: X is not a finite number that ``valid`` accepts (the message says ``wants``).
    """
    key, _, text = part.partition("=")
    try:
        x = float(text)
    except ValueError:
        x = math.nan
    if not math.isfinite(x) or not valid(x):
        raise MethodError(f"method '{spec}': {key}= takes {wants}, got '{part}'")
    return x


def _parse_choice(spec: str, part: str, names: tuple[str, ...], given: str | None) -> str:
    """The NAME of a ``key=NAME`` part of a method spec.

    Raises:
        MethodError: the key was ``given`` already, or NAME is not one of ``names``.
    """
    key, _, name = part.partition("=")
    if given is not None:
        raise MethodError(f"method '{spec}': {key}= given twice")
    if name not in names:
        raise MethodError(f"method '{spec}': {key}= must be one of {', '.join(names)}")
    return name


def _parse_guard(spec: str, text: str) -> tuple[float | None, float | None]:
    """``M``, ``M@G`` or ``off`` -> (margin, ratio)."""
    if text == "off":
        return None, None
    margin, _, ratio = text.partition("@")
    try:
        m = float(margin)
        g = float(ratio) if ratio else None
    except ValueError:
        raise MethodError(f"method '{spec}': guard= takes M, M@G or off, got '{text}'") from None
    if not math.isfinite(m) or m < 0 or (g is not None and (not math.isfinite(g) or not 0.0 <= g <= 1.0)):
        raise MethodError(f"method '{spec}': guard margin must be >= 0 and its ratio in [0, 1], got '{text}'")
    return m, g


def parse_method(spec: str) -> Method:
    """Parse one method spec.

    Args:
        spec: e.g. ``full``, ``prefix``, ``reuse``, ``blend@0.15:v:check=1,2``.

    Returns:
        The method (``name`` is the stripped spec, ``canonical`` its normal form).

    Raises:
        MethodError: naming the spec and what is wrong with it.
    """
    s = spec.strip()
    for kind, ratio in ((MethodKind.FULL, 1.0), (MethodKind.PREFIX, None), (MethodKind.REUSE, 0.0)):
        if s == kind.value:
            return Method(name=s, kind=kind, canonical=s, ratio=ratio)
    m = _BLEND.match(s)
    if not m:
        raise MethodError(
            f"unknown method '{spec}': expected full, prefix, reuse or blend@R[:selector][:check=L,...]"
        )
    try:
        ratio = float(m.group(1))
    except ValueError:
        raise MethodError(f"method '{spec}': ratio '{m.group(1)}' is not a number") from None
    if not math.isfinite(ratio) or not 0.0 <= ratio <= 1.0:
        raise MethodError(f"method '{spec}': ratio must be in [0, 1], got {m.group(1)}")
    selector: str | None = None
    checks: tuple[int, ...] = ()
    auto = False
    auto_target: float | None = None
    probe: str | None = None
    guard: tuple[float | None, float | None] | None = None
    cand: float | None = None
    cand_off = False
    temp: float | None = None
    gmode: str | None = None
    attn: str | None = None
    lin: str | None = None
    for part in [p for p in m.group(2).split(":") if p]:
        if part.startswith("gmode="):
            gmode = _parse_choice(spec, part, GUARD_MODE_NAMES, gmode)
        elif part.startswith("attn="):
            attn = _parse_choice(spec, part, RECOMPUTE_PRECISION_NAMES, attn)
        elif part.startswith("lin="):
            lin = _parse_choice(spec, part, RECOMPUTE_PRECISION_NAMES, lin)
        elif part.startswith("temp="):
            if temp is not None:
                raise MethodError(f"method '{spec}': temp= given twice")
            temp = _parse_number(spec, part, "a number > 0", lambda x: x > 0)
        elif part.startswith("cand="):
            if cand is not None or cand_off:
                raise MethodError(f"method '{spec}': cand= given twice")
            if part == "cand=off":
                cand_off = True
                continue
            cand = _parse_number(spec, part, "a factor >= 1", lambda x: x >= 1)
        elif part.startswith("guard="):
            if guard is not None:
                raise MethodError(f"method '{spec}': guard= given twice")
            guard = _parse_guard(spec, part[len("guard="):])
        elif part.startswith("probe="):
            probe = _parse_choice(spec, part, PROBE_PRECISIONS, probe)
        elif part == "auto" or part.startswith("auto="):
            if auto:
                raise MethodError(f"method '{spec}': auto given twice")
            auto = True
            if part != "auto":
                auto_target = _parse_number(spec, part, "a target > 0", lambda x: x > 0)
        elif part.startswith("check="):
            if checks:
                raise MethodError(f"method '{spec}': check= given twice")
            try:
                checks = tuple(int(x) for x in part[len("check="):].split(","))
            except ValueError:
                raise MethodError(f"method '{spec}': check layers must be integers, got '{part}'") from None
            if any(c < 0 for c in checks) or len(set(checks)) != len(checks):
                raise MethodError(f"method '{spec}': check layers must be distinct and >= 0")
        else:
            if selector is not None:
                raise MethodError(f"method '{spec}': more than one selector ('{selector}', '{part}')")
            names = known_selectors()
            if part not in names:
                raise MethodError(f"method '{spec}': unknown selector '{part}' (known: {', '.join(names)})")
            selector = part
    canonical = f"blend@{_fmt_ratio(ratio)}"
    if selector is not None:
        canonical += f":{selector}"
    if checks:
        canonical += f":check={','.join(map(str, checks))}"
    if auto:
        canonical += ":auto" if auto_target is None else f":auto={auto_target:g}"
    if probe is not None:
        canonical += f":probe={probe}"
    if cand is not None:
        canonical += f":cand={cand:g}"
    if cand_off:
        canonical += ":cand=off"
    if temp is not None:
        canonical += f":temp={temp:g}"
    if guard is not None:
        canonical += f":guard={_fmt_guard(guard)}"
    if gmode is not None:
        canonical += f":gmode={gmode}"
    if attn is not None:
        canonical += f":attn={attn}"
    if lin is not None:
        canonical += f":lin={lin}"
    method = Method(
        name=s, kind=MethodKind.BLEND, canonical=canonical, ratio=ratio, selector=selector, check_layers=checks,
        auto=auto, auto_target=auto_target, probe_precision=probe, guard=guard, candidates=cand, candidates_off=cand_off,
        temperature=temp, guard_mode=gmode, attention_precision=attn, linear_precision=lin,
    )
    _check_read(method)
    return method


def _check_read(method: Method) -> None:
    """Refuse a blend spec naming a setting its blend never reads, as :class:`ReusePolicy` refuses it (the
    spec names and labels its results by every part, so a part that changes nothing is refused even at its
    default): ``gmode=`` beside ``guard=off``, ``cand=`` or ``probe=`` beside a selector that runs no probe,
    and whatever else the policy refuses (e.g. ``auto`` beside a selector other than ``probe``).

    Raises:
        MethodError: naming the spec and the setting.
    """
    spec = method.name
    if method.guard_mode is not None and method.guard == (None, None):
        raise MethodError(f"method '{spec}': gmode= says how the near-tie guard recomputes a near tie, and "
                          f"guard=off turns the guard off: it would be ignored (drop one)")
    selector = method.selector or DEFAULT_SELECTOR
    probe_parts = [p for p, given in (("cand=", method.candidates is not None or method.candidates_off),
                                      ("probe=", method.probe_precision is not None)) if given]
    if probe_parts and selector not in PROBE_SELECTORS:
        raise MethodError(f"method '{spec}': {' and '.join(probe_parts)} set the query probe, which selector "
                          f"'{selector}' never runs (only {' and '.join(PROBE_SELECTORS)} do): it would be ignored")
    try:
        method.policy()
    except InvalidPolicyError as e:
        raise MethodError(f"method '{spec}': {e}") from None


def split_specs(text: str) -> list[str]:
    """Split a ``--methods`` list on commas, keeping ``check=1,2`` together.

    A comma followed by an integer continues the previous ``check=`` list.
    """
    out: list[str] = []
    for tok in text.split(","):
        t = tok.strip()
        if not t:
            continue
        if out and t.isdigit() and re.search(r"check=[\d,]*$", out[-1]):
            out[-1] += f",{t}"
        else:
            out.append(t)
    return out


def parse_methods(text: str) -> list[Method]:
    """Parse a ``--methods`` list; ``full`` is always included, first.

    Args:
        text: comma list of specs.

    Returns:
        Unique methods in the given order, ``full`` first.

    Raises:
        MethodError: an empty list, a bad spec, or two specs with one canonical name.
    """
    specs = split_specs(text)
    if not specs:
        raise MethodError("--methods is empty")
    methods = [parse_method(s) for s in specs]
    seen: dict[str, str] = {}
    for spec, m in zip(specs, methods):
        if m.canonical in seen and m.canonical != REFERENCE:
            raise MethodError(f"methods '{seen[m.canonical]}' and '{spec}' are the same method ({m.canonical})")
        seen[m.canonical] = spec
    rest = [m for m in methods if m.name != REFERENCE]
    return [parse_method(REFERENCE)] + rest
