"""Warnings results.md prints under its table: figures that mix thread counts, or rows that ran another path
than their method's."""

from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

from blend.evals.methods import MethodKind
from blend.evals.rows import ItemRow

# the paths (a report's ``applied``) a method's own rows run: a full prefill runs the exact schedule in one
# pass (``none`` in runs from before the one-pass reference); reuse and blends re-position documents. A
# blend's row that ran ``none`` was refused (quality gate, length, dynamic NTK) and computed in full; one that
# ran ``exact`` had nothing to re-position, or its near-tie guard recomputed it on the exact path.
OWN_PATHS = {MethodKind.FULL: frozenset({"exact", "none"}), MethodKind.PREFIX: frozenset({"exact"}),
             MethodKind.REUSE: frozenset({"blend"}), MethodKind.BLEND: frozenset({"blend"})}


def own_paths(spec: dict[str, Any] | None) -> frozenset[str] | None:
    """The paths a method's rows should run, from its recorded spec (None: unknown, nothing checked)."""
    try:
        return OWN_PATHS[MethodKind((spec or {}).get("kind"))]
    except ValueError:
        return None


def applied_lines(rows: Sequence[ItemRow], order: Sequence[str],
                  methods: dict[str, dict[str, Any]] | None = None) -> list[str]:
    """A warning naming each method whose rows did not all run one path, or (from its spec in ``methods``)
    ran a path that is not its own on any item: a blend refused on every item ran ``none`` (a full
    prefill) there, and its figures are a full prefill's, not a blend's.

    Args:
        rows: the run's item rows.
        order: the methods, in table order.
        methods: the ``methods`` object of results.json (each with its ``spec``); None: mixed paths only.

    Returns:
        Markdown lines (none when every method ran its own path, or rows predate the field).
    """
    lines = []
    for name in order:
        paths = Counter(r.methods[name].applied for r in rows if name in r.methods)
        paths.pop(None, None)  # rows from before the field
        own = own_paths((methods or {}).get(name, {}).get("spec"))
        if len(paths) > 1 or (own is not None and paths and not set(paths) <= own):
            lines.append(f"`{name}`: " + ", ".join(f"{p or 'unrecorded'} on {n}" for p, n in sorted(paths.items())))
    if not lines:
        return []
    return ["", "Methods that did not run the same path on every item, or not their own (the reports' `applied`: "
            "a blend refused ran `none`, a full prefill; one guarded, or with nothing to re-position, `exact`; "
            "their figures are not all the method's): " + "; ".join(lines) + "."]


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
