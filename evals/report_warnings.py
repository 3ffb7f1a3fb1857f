"""Warnings results.md prints under its table: figures that mix thread counts, or rows that ran another path
than their method's."""

from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

from blend.evals.methods import MethodKind
from blend.evals.paths import ran_own_path
from blend.evals.rows import ItemRow, MethodRow
from blend.policy import ReuseMode

# the mode a method's rows ask for (``evals.paths.ran_own_path`` holds which paths are its own): a full prefill
# asks none (it runs the exact schedule in one pass); a prefix method exact; reuse and blends blend (a blend's
# near-tie guard may recompute it on the exact path: its own too). A blend's row that ran ``none`` was refused
# (quality gate, length, dynamic NTK) and computed in full; one that ran ``exact`` unguarded had nothing to
# re-position.
ASKED = {MethodKind.FULL: ReuseMode.NONE, MethodKind.PREFIX: ReuseMode.EXACT,
         MethodKind.REUSE: ReuseMode.BLEND, MethodKind.BLEND: ReuseMode.BLEND}


def asked_mode(spec: dict[str, Any] | None) -> ReuseMode | None:
    """The mode a method's rows ask for, from its recorded spec (None: unknown, only mixed paths checked)."""
    try:
        return ASKED[MethodKind((spec or {}).get("kind"))]
    except ValueError:
        return None


def _own(asked: ReuseMode, row: MethodRow) -> bool:
    try:
        applied = ReuseMode(row.applied)
    except ValueError:  # a path this version does not know: not the method's
        return False
    return ran_own_path(asked, applied, row.guarded)


def _label(row: MethodRow) -> str:
    return f"{row.applied} (guarded)" if row.guarded and row.applied == ReuseMode.EXACT.value else str(row.applied)


def applied_lines(rows: Sequence[ItemRow], order: Sequence[str],
                  methods: dict[str, dict[str, Any]] | None = None) -> list[str]:
    """A warning naming each method with a row that ran a path that is not its own (from its spec in
    ``methods``; :func:`blend.evals.paths.ran_own_path`), or, for a method without a spec, whose rows did not
    all run one path: a blend refused on every item ran ``none`` (a full prefill) there, and its figures are a
    full prefill's, not a blend's.

    Args:
        rows: the run's item rows.
        order: the methods, in table order.
        methods: the ``methods`` object of results.json (each with its ``spec``); None: mixed paths only.

    Returns:
        Markdown lines (none when every method ran its own path, or rows predate the field).
    """
    lines = []
    for name in order:
        mine = [r.methods[name] for r in rows if name in r.methods and r.methods[name].applied is not None]
        asked = asked_mode((methods or {}).get(name, {}).get("spec"))
        if asked is None:
            bad = len({m.applied for m in mine}) > 1
        else:
            bad = not all(_own(asked, m) for m in mine)
        if bad:
            paths = Counter(_label(m) for m in mine)
            lines.append(f"`{name}`: " + ", ".join(f"{p or 'unrecorded'} on {n}" for p, n in sorted(paths.items())))
    if not lines:
        return []
    return ["", "Methods that did not run the same path on every item, or not their own (the reports' `applied`: "
            "a blend refused ran `none`, a full prefill; one with nothing to re-position, `exact`; one its "
            "near-tie guard recomputed on the exact path, `exact (guarded)`, is its own; their figures are not "
            "all the method's): " + "; ".join(lines) + "."]


def thread_lines(methods: dict[str, dict[str, Any]], order: Sequence[str]) -> list[str]:
    """A warning when methods' TTFTs were timed with different thread counts (a resumed run)."""
    groups: dict[tuple[int, ...], list[str]] = {}
    for name in order:
        groups.setdefault(tuple(methods[name].get("threads") or ()), []).append(name)
    if len(groups) < 2:
        return []
    parts = [f"{'/'.join(map(str, t)) if t else 'unrecorded'}: " + ", ".join(f"`{n}`" for n in names)
             for t, names in groups.items()]
    return ["", "TTFT seconds were timed with different thread counts, so compare them only within a group; "
            "every TTFT ratio is against full prefill timed beside it, so ratios compare across groups. "
            "Threads: " + "; ".join(parts) + "."]
