"""JSON that kvblend prints (``--json``) and serves: always valid JSON (RFC 8259).

Python's ``json.dumps`` writes ``NaN``, ``Infinity`` and ``-Infinity`` for non-finite floats,
which no strict JSON parser reads (JavaScript's ``JSON.parse``, ``jq``, Go, serde); Starlette's
``JSONResponse`` refuses them outright (a 500). A figure that does not exist (the retrieval
score of a caller's ``--doc`` document) or could not be measured (a NaN from a model that
overflowed) is written as ``null`` instead.
"""

from __future__ import annotations

import json
import math
from typing import Any


def finite(obj: Any, keep_tuples: bool = False) -> Any:
    """``obj`` with every non-finite float, at any depth of dicts, lists and tuples, replaced by None.

    Args:
        obj: a JSON-able value (dicts, lists, tuples, strings, numbers, bools, None).
        keep_tuples: a tuple that held such a float is copied as a tuple (a frozen dataclass's field, as
            the eval rows keep them), not as the list JSON writes.

    Returns:
        The same value when it holds no non-finite float (not copied); else a copy with those
        floats as None (tuples become lists, as JSON writes them, unless ``keep_tuples``).
    """
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        items = {k: finite(v, keep_tuples) for k, v in obj.items()}
        return obj if all(items[k] is v for k, v in obj.items()) else items
    if isinstance(obj, (list, tuple)):
        seq = [finite(v, keep_tuples) for v in obj]
        if all(a is b for a, b in zip(seq, obj)):
            return obj
        return tuple(seq) if keep_tuples and isinstance(obj, tuple) else seq
    return obj


def dumps(obj: Any, **kwargs: Any) -> str:
    """``json.dumps`` that never writes NaN or Infinity: non-finite floats are written as null.

    Args:
        obj: the value to write.
        **kwargs: ``json.dumps``'s options (indent, separators, ensure_ascii...); not ``allow_nan``.

    Returns:
        The JSON text.
    """
    try:
        return json.dumps(obj, allow_nan=False, **kwargs)  # the common case: nothing to replace, no copy
    except ValueError:
        return json.dumps(finite(obj), allow_nan=False, **kwargs)
