"""Item ranges of an evaluation (``--items 30-99``): the tuning / validation split."""

from __future__ import annotations

import re

TUNING = (0, 29)  # musique_dev items the selectors were tuned on
VALIDATION = (30, 99)  # held out: every quality claim is reported on these too

_RANGE = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")


class ItemRangeError(ValueError):
    """An ``--items`` value that does not parse."""


def parse_item_range(text: str) -> tuple[int, int]:
    """Parse ``A-B`` (inclusive, 0-based) or ``A`` (one item).

    Args:
        text: e.g. ``30-99``, ``0-29``, ``7``.

    Returns:
        (first, last), both inclusive, first <= last.

    Raises:
        ItemRangeError: not of that form, or first > last.
    """
    m = _RANGE.match(text)
    if not m:
        raise ItemRangeError(f"--items must be A-B or A (0-based, inclusive), got {text!r}")
    lo = int(m.group(1))
    hi = int(m.group(2)) if m.group(2) is not None else lo
    if lo > hi:
        raise ItemRangeError(f"--items {text!r}: first item {lo} is after the last {hi}")
    return lo, hi
