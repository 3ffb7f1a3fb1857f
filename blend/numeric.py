"""Numbers that come from users (request fields, policy arguments): whether one is a usable real
number, and how to show one in an error without printing thousands of digits.

An integer too large for a float (``10**400`` from JSON) makes ``math.isfinite`` and ``float`` raise
``OverflowError``; these checks say no instead, so a validator raises its own error type.
"""

from __future__ import annotations

import math
import numbers

HUGE_INT_SHOWN = 10**30  # integers above this are shown by their size, not their digits


def finite_real(x: object) -> bool:
    """Whether ``x`` is a real number (not a bool) whose float is finite.

    NaN, infinity and an integer too large for a float are not; numpy's scalars are real numbers too.

    Args:
        x: any value (untrusted input).

    Returns:
        Whether it is a finite real number.
    """
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        return False
    try:
        return math.isfinite(float(x))
    except (OverflowError, ValueError, TypeError):
        return False


def integral(x: object) -> bool:
    """Whether ``x`` is an integer (numpy's included), not a bool.

    Args:
        x: any value (untrusted input).

    Returns:
        Whether it is an integer.
    """
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def shown(x: object) -> str:
    """``repr`` of a rejected value, short (an integer of thousands of digits by its size).

    Args:
        x: the rejected value.

    Returns:
        Its ``repr`` cut to 60 characters, or ``an integer of N bits`` past :data:`HUGE_INT_SHOWN`.
    """
    if isinstance(x, int) and not isinstance(x, bool) and abs(x) > HUGE_INT_SHOWN:
        return f"an integer of {x.bit_length()} bits"
    return f"{x!r:.60}"
