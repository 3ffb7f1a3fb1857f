"""Environment variables that choose a kernel path: one parser, one error message."""

from __future__ import annotations

import enum
import os
from typing import TypeVar

E = TypeVar("E", bound=enum.Enum)


def env_choice(name: str, choices: type[E], default: E) -> E:
    """The member of ``choices`` whose value the variable ``name`` holds (case and spaces ignored).

    Args:
        name: the environment variable.
        choices: an Enum with string values.
        default: when the variable is unset or empty.

    Returns:
        The chosen member.

    Raises:
        ValueError: a value outside ``choices``, naming the variable and the allowed values.
    """
    raw = os.environ.get(name, default.value).strip().lower() or default.value
    try:
        return choices(raw)
    except ValueError:
        allowed = "|".join(c.value for c in choices)
        raise ValueError(f"{name}={raw!r} is not one of {allowed}") from None
