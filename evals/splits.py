"""Item ranges of an evaluation (``--items 30-99``): the tuning / validation split."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Sequence

from blend.evals.data import SYNTHETIC_PREFIX

TUNING = (0, 29)  # musique_dev items the selectors were tuned on
VALIDATION = (30, 99)  # held out: every quality claim is reported on these too
SPLIT_DATA = "musique_dev"  # the data set whose item indices TUNING / VALIDATION name

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


def item_range_arg(text: str) -> str:
    """An argparse ``type`` for a bench's ``--items``: the text, checked as one range or a comma list of them,
    so a bad value is argparse's usage error (exit 2), not a traceback after the model loaded.

    Args:
        text: e.g. ``30-99`` or ``0-9,30-39``.

    Returns:
        ``text`` unchanged.

    Raises:
        argparse.ArgumentTypeError: a part that :func:`parse_item_range` refuses.
    """
    try:
        for part in text.split(","):
            parse_item_range(part)
    except ItemRangeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def split_of(item: int) -> str:
    """``tuning``, ``validation`` or ``other`` for a musique_dev item index."""
    if TUNING[0] <= item <= TUNING[1]:
        return "tuning"
    return "validation" if VALIDATION[0] <= item <= VALIDATION[1] else "other"


def has_splits(data: str | None) -> bool:
    """Whether ``data``'s item indices are musique_dev's, which :data:`TUNING` / :data:`VALIDATION` name.

    Args:
        data: the data (``--data``); None: musique_dev indices assumed (research rows).

    Returns:
        False for a built-in synthetic set or any other file.
    """
    if data is None:
        return True
    return not data.startswith(SYNTHETIC_PREFIX) and SPLIT_DATA in Path(data).name.lower()


def range_split(first: int, last: int, data: str | None = None) -> str:
    """The split an item range ``first``-``last`` (inclusive) of ``data`` belongs to.

    Args:
        first: the range's first item index.
        last: its last.
        data: the data (``--data``); None: musique_dev indices assumed (research rows).

    Returns:
        ``tuning`` (within 0-29) or ``validation`` (within 30-99) for musique_dev, ``mixed`` where the
        range spans more than one of tuning / validation / beyond, ``other`` where it lies wholly past
        them or the data is another file, ``synthetic`` for a built-in synthetic set.
    """
    if not has_splits(data):
        return "synthetic" if data.startswith(SYNTHETIC_PREFIX) else "other"
    a, b = split_of(first), split_of(last)
    return a if a == b else "mixed"


def items_caption(data: str | None, indices: Sequence[int]) -> str:
    """A run's item range and its split, as results.md and the run's figures name them.

    Args:
        data: the run's data (``--data``).
        indices: the item indices the run holds.

    Returns:
        e.g. ``items 30-99 (70 items), validation split`` (``, 3 missing`` inside the brackets where the
        range has gaps); ``0 items`` for none.
    """
    idx = sorted(indices)
    if not idx:
        return "0 items"
    first, last = idx[0], idx[-1]
    gaps = "" if last - first + 1 == len(idx) else f", {last - first + 1 - len(idx)} missing"
    return f"items {first}-{last} ({len(idx)} items{gaps}), {range_split(first, last, data)} split"
