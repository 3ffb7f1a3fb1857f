"""Stopping a running prefill between two layers once its request is cancelled.

A request whose client leaves while its prefill runs has no one to answer, and a chat's user who
presses Ctrl-C during one wants the prompt back: the rest of that prefill is compute for nobody
(seconds, for a long prompt on a CPU). The server's scheduler runs each request's prefill inside
:func:`cancellable` with the request's cancel flag, and the model's layer
loop, :meth:`blend.model.ModelRunner.run_layers` (which every prefill pass runs through: a segment's
compute, a chunk's canonical compute, the blend's pass, the probe), looks at it before each layer and
raises :class:`PrefillCancelled` once it is set::

    with cancellable(job.cancelled):
        engine.prefill(prompt, policy)   # layer 0, flag?, layer 1, flag?, ... -> PrefillCancelled

The check reads one flag per layer and touches no number, so a prefill that is not cancelled computes
the same bits at the same cost (its time measured the same to within noise on the tiny model, whose
layers are the cheapest there are). What an interrupted prefill leaves is what any failed prefill
leaves: its own cache (freed with it), and the segments it finished, each complete and stored under
its own key; a segment being computed is not stored (every store write follows its segment's last
layer, and the flag raises only in the layer loop, never inside a write or its write-behind queueing).
A hot prefix (:mod:`blend.prefix_cache`) is remembered only once its prefill finished, and one it
attached is read-only to it, so a conversation's next turn finds no half-written rows.

The flag travels as a context variable rather than an argument: it would otherwise go through every
prefill path's signature (engine, prefill paths, segment cache, blend, probe) to reach the layer loop.
It is per thread (a worker's scope is not another thread's). Two callers set it:

- the server's scheduler, around ``engine.prefill`` alone: the quality gate, whose verdict serves
  every later request, runs before it, so a client that leaves does not cost the next one the run;
- ``kvblend chat`` at a terminal, around its turn's prefill, with the flag a first Ctrl-C sets
  (:func:`blend.termination.ctrl_c_requests_stop`). A blend turn's prefill may run the gate's first
  run, and the user asked to stop: it stops too. That is safe because a run that raises leaves no
  verdict (:class:`blend.gate.QualityGate` keeps and records a result only once the run returned), so
  the next blend runs the gate again from the start.

The Python API, ``kvblend ask`` and the vLLM connector never set it: their prefills are never interrupted.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator

_FLAG: ContextVar[threading.Event | None] = ContextVar("kvblend_prefill_cancel", default=None)


class PrefillCancelled(Exception):
    """A prefill stopped between two layers: its request was cancelled (see :func:`cancellable`)."""


@contextmanager
def cancellable(flag: threading.Event | None) -> Iterator[None]:
    """Run a block whose layer loops stop once ``flag`` is set.

    Args:
        flag: the request's cancel flag (None: not cancellable, as outside any such block).

    Yields:
        Nothing; a layer loop in the block raises :class:`PrefillCancelled` before its next layer once
        the flag is set.
    """
    token = _FLAG.set(flag)
    try:
        yield
    finally:
        _FLAG.reset(token)


def cancel_flag() -> threading.Event | None:
    """The flag of the innermost :func:`cancellable` block this thread runs in (None outside any).

    Returns:
        The flag (set once the request is cancelled), or None outside any cancellable block.
    """
    return _FLAG.get()
