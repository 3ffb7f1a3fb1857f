"""Strict JSON reading for tests of what kvblend prints and serves."""

from __future__ import annotations

import json
from typing import Any


def _refuse(token: str) -> None:
    raise ValueError(f"{token} is not JSON")


def strict_loads(text: str) -> Any:
    """``json.loads`` that refuses NaN, Infinity and -Infinity (as RFC 8259 and every strict parser do)."""
    return json.loads(text, parse_constant=_refuse)
