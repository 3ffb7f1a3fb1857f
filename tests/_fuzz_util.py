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
import os
import signal
import tracemalloc
from typing import Any, Iterator

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

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


def replace_at(value: Any, path: list[int], new: Any) -> Any:
    """``value`` with the node reached by following ``path`` (indices mod the children) replaced by ``new``."""
    if not path or not isinstance(value, (dict, list)) or not value:
        return new
    if isinstance(value, dict):
        keys = sorted(value, key=str)
        k = keys[path[0] % len(keys)]
        return {**value, k: replace_at(value[k], path[1:], new)}
    i = path[0] % len(value)
    return [*value[:i], replace_at(value[i], path[1:], new), *value[i + 1 :]]


def drop_at(value: Any, path: list[int]) -> Any:
    """``value`` with one member (a dict key or list item) along ``path`` removed."""
    if not isinstance(value, (dict, list)) or not value:
        return value
    if isinstance(value, dict):
        keys = sorted(value, key=str)
        k = keys[path[0] % len(keys)] if path else keys[0]
        if len(path) <= 1:
            return {kk: v for kk, v in value.items() if kk != k}
        return {**value, k: drop_at(value[k], path[1:])}
    i = path[0] % len(value) if path else 0
    if len(path) <= 1:
        return value[:i] + value[i + 1 :]
    return [*value[:i], drop_at(value[i], path[1:]), *value[i + 1 :]]


def mutate_json(value: Any, data: st.DataObject) -> Any:
    """One structural rewrite that keeps valid JSON: replace a node, drop a member, or rename a key."""
    path = data.draw(st.lists(st.integers(0, 50), max_size=5), label="path")
    how = data.draw(st.sampled_from(["replace", "drop", "rename"]), label="how")
    if how == "replace":
        return replace_at(value, path, data.draw(json_values, label="new value"))
    if how == "drop":
        return drop_at(value, path)
    if isinstance(value, dict) and value:  # rename a top-level key (one of the bit flips)
        keys = sorted(value, key=str)
        k = keys[(path[0] if path else 0) % len(keys)]
        return {(k[:-1] + chr(ord(k[-1]) ^ 1) if k else "x") if kk == k else kk: v for kk, v in value.items()}
    return value


def mutate_bytes(blob: bytes, data: st.DataObject, header_end: int | None = None) -> bytes:
    """Bit flips, a truncation and/or an extension (each drawn)."""
    out = bytearray(blob)
    hi = len(out) if header_end is None or not data.draw(st.booleans(), label="header only") else header_end
    for pos in data.draw(st.lists(st.integers(0, max(hi - 1, 0)), max_size=4), label="flips"):
        if out:
            out[pos % len(out)] ^= 1 << data.draw(st.integers(0, 7), label="bit")
    if data.draw(st.booleans(), label="truncate"):
        out = out[: data.draw(st.integers(0, len(out)), label="cut")]
    if data.draw(st.booleans(), label="extend"):
        out += data.draw(st.binary(max_size=64), label="tail")
    return bytes(out)
