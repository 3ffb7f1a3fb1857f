"""The fuzz suite's budget and bounds (tests/test_fuzz_*.py).

Every property is "a valid result or the declared error, within a time and a
memory bound". The bounds are enforced per example, not on average:

- time: a SIGALRM timer raises :class:`ExampleHung` inside whatever the example
  is blocked on (a read from a FIFO, a loop), so a hang fails the example instead
  of stalling the run; ``ExampleHung`` is a BaseException, so no decoder's
  ``except Exception`` can swallow it.
- memory: tracemalloc's peak over the example (bytes, bytearrays, numpy arrays,
  every Python object) must stay under the example's cap.

Example budget: ``CI_EXAMPLES`` per property by default (derandomized: CI runs
the same examples every time); ``KVBLEND_FUZZ_EXAMPLES=5000`` runs a longer,
randomized search.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import tracemalloc
from typing import Any, Iterator

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from blend.store.codec import EntryError, decode

CI_EXAMPLES = 200
EXAMPLES = int(os.environ.get("KVBLEND_FUZZ_EXAMPLES", CI_EXAMPLES))
EXAMPLE_TIMEOUT_S = 10.0  # one example (one decode, one lookup, one index open) never takes this long
MAX_ALLOC_BYTES = 32 << 20  # default per-example allocation cap

FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,  # the SIGALRM bound below is the per-example timeout (and survives a blocking syscall)
    derandomize=EXAMPLES == CI_EXAMPLES,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)


def fuzz_budget(ci_examples: int) -> settings:
    """:data:`FUZZ` with ``ci_examples`` examples in CI, for a property whose example costs more than most
    (``KVBLEND_FUZZ_EXAMPLES`` still sets a longer search's count)."""
    return settings(FUZZ, max_examples=ci_examples if EXAMPLES == CI_EXAMPLES else EXAMPLES)


class ExampleHung(BaseException):
    """An example ran past EXAMPLE_TIMEOUT_S."""


@contextlib.contextmanager
def bounded(max_bytes: int = MAX_ALLOC_BYTES, seconds: float = EXAMPLE_TIMEOUT_S) -> Iterator[None]:
    """Fail the example if its body runs longer than ``seconds`` or allocates more than ``max_bytes`` at once."""

    def on_alarm(signum: int, frame: Any) -> None:
        raise ExampleHung(f"example still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    tracemalloc.start()
    try:
        yield
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        tracemalloc.stop()
    assert peak <= max_bytes, f"example allocated {peak} bytes at its peak, over the cap of {max_bytes}"


# JSON values of every type, including what Python's json emits beyond the standard (NaN, Infinity).
json_scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20)
                | st.sampled_from([0, 1, -1, 2**63, "", "gen-000001", "float32", "F32", "exact", "canonical"]))
json_values = st.recursive(json_scalars, lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=12), c,
                                                                                            max_size=5), max_leaves=20)


def node_paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """The path (dict keys and list indices) of every node of a JSON value, the root first."""
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += node_paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += node_paths(v, prefix + (i,))
    return out


def _edit(value: Any, path: tuple, fn: Any) -> Any:
    """``value`` with ``fn(parent, last key)`` applied where ``path`` ends (a copy along the path)."""
    if len(path) == 1:
        return fn(value, path[0])
    k = path[0]
    child = _edit(value[k], path[1:], fn)
    return {**value, k: child} if isinstance(value, dict) else [*value[:k], child, *value[k + 1 :]]


def _flip_char(k: str, i: int, bit: int) -> str:
    if not k:
        return "x"
    i %= len(k)
    return k[:i] + chr(ord(k[i]) ^ (1 << bit)) + k[i + 1 :]


def mutate_json(value: Any, data: st.DataObject) -> Any:
    """One structural rewrite that keeps valid JSON, at a node drawn uniformly from the whole tree:
    replace it by any JSON value, drop it, or flip one bit of its key (the issue's bit flip
    inside ``"data_offsets"``)."""
    path = data.draw(st.sampled_from(node_paths(value)), label="node")
    how = data.draw(st.sampled_from(["replace", "replace", "drop", "rename"]), label="how")
    if not path:
        return data.draw(json_values, label="new root") if how == "replace" else value
    if how == "replace":
        new = data.draw(json_values, label="new value")
        return _edit(value, path, lambda parent, k: {**parent, k: new} if isinstance(parent, dict)
                     else [*parent[:k], new, *parent[k + 1 :]])
    if how == "drop":
        return _edit(value, path, lambda parent, k: {kk: v for kk, v in parent.items() if kk != k}
                     if isinstance(parent, dict) else parent[:k] + parent[k + 1 :])
    i, bit = data.draw(st.integers(0, 40), label="char"), data.draw(st.integers(0, 6), label="bit")
    return _edit(value, path, lambda parent, k: {(_flip_char(kk, i, bit) if kk == k else kk): v
                                                 for kk, v in parent.items()} if isinstance(parent, dict) else parent)


def mutate_bytes(blob: bytes, data: st.DataObject, header_end: int | None = None) -> bytes:
    """Bit flips, a truncation and/or an extension (each drawn; at least one bit always changes)."""
    out = bytearray(blob)
    hi = len(out) if header_end is None or not data.draw(st.booleans(), label="header only") else header_end
    for pos in data.draw(st.lists(st.integers(0, max(hi - 1, 0)), max_size=4), label="flips"):
        if out:
            out[pos % len(out)] ^= 1 << data.draw(st.integers(0, 7), label="bit")
    if data.draw(st.booleans(), label="truncate"):
        out = out[: data.draw(st.integers(0, len(out)), label="cut")]
    if data.draw(st.booleans(), label="extend"):
        out += data.draw(st.binary(min_size=1, max_size=64), label="tail")
    if bytes(out) == blob and blob:  # always some damage
        out[data.draw(st.integers(0, hi - 1 if hi else len(out) - 1), label="flip") % len(out)] ^= 1
    return bytes(out)


# JSON texts that json.dumps never writes but a file or a client may hold, each a trap for a decoder or for
# the code after it: more digits than int() converts (ValueError, not JSONDecodeError), integers and exponents
# no float holds, NaN and infinities, nesting past the decoder's recursion limit (RecursionError) and just
# under it, a lone surrogate escape (a str that cannot be encoded back to UTF-8).
HOSTILE_JSON_TEXTS = (
    "1" + "0" * 5000, "-" + "9" * 400, "1e999", "-1e999", "1E400", "4.9e-324", "-0", "NaN", "Infinity",
    "-Infinity", "[" * 100_000 + "]" * 100_000, '{"a": ' * 3000 + "0" + "}" * 3000, "[" * 900 + "]" * 900,
    '"\\ud800"', '"a\\u0000b"', '""', "[]", "{}", "null", "true",
)


def _dumps_at(value: Any, path: tuple, at: tuple, fn: Any) -> str:
    """``value``'s JSON text, the node at ``at`` written by ``fn(node)`` instead."""
    if path == at:
        return fn(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {_dumps_at(v, path + (k,), at, fn)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_dumps_at(v, path + (i,), at, fn) for i, v in enumerate(value)) + "]"
    return json.dumps(value)


def dumps_mutated(value: Any, data: st.DataObject) -> bytes:
    """``value`` as JSON text after one rewrite json.dumps cannot make, at a node drawn from the whole tree:
    the node's text replaced by one of :data:`HOSTILE_JSON_TEXTS`, or (an object) one of its keys written twice,
    the other value first or last (Python's json keeps the last; another decoder may keep the first)."""
    path = data.draw(st.sampled_from(node_paths(value)), label="node")
    hostile = st.sampled_from(HOSTILE_JSON_TEXTS)
    node = value
    for k in path:
        node = node[k]
    if isinstance(node, dict) and node and data.draw(st.booleans(), label="duplicate a key"):
        key = data.draw(st.sampled_from(sorted(node)), label="key")
        other = data.draw(hostile | json_values.map(json.dumps), label="other value")
        pairs = [f"{json.dumps(k)}: {json.dumps(v)}" for k, v in node.items()]
        extra = f"{json.dumps(key)}: {other}"
        pairs = [extra, *pairs] if data.draw(st.booleans(), label="first") else [*pairs, extra]
        text = _dumps_at(value, (), path, lambda _: "{" + ", ".join(pairs) + "}")
    else:
        new = data.draw(hostile, label="text")
        text = _dumps_at(value, (), path, lambda _: new)
    return text.encode("utf-8", "surrogatepass")


@st.composite
def json_texts_of(draw: st.DrawFn, value: Any) -> bytes:
    """A strategy: ``value``'s JSON text after one :func:`dumps_mutated` rewrite (for lists of lines)."""
    return dumps_mutated(value, draw(st.data()))


def still_the_entry(blob: bytes, pristine: bytes) -> bool:
    """Whether a damaged store blob decodes to the tensors (and provenance) the pristine one holds: damage
    that leaves the entry as stored (a flipped bit in the header's padding) may be reused."""
    try:
        got = decode(bytearray(blob))
    except EntryError:
        return False
    want = decode(bytearray(pristine))
    return got.provenance == want.provenance and torch.equal(got.k, want.k) and torch.equal(got.v, want.v)
