"""Decode shares: rows of one decode step that an idle prefill worker runs on its own core (see
:mod:`blend.serve.scheduler`), and the decode loop's recent time, decode steps and prefills apart."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

import torch

from blend.batch_decode import DecodeStep


class ShareState(Enum):
    PENDING = "pending"  # posted, nobody runs it yet
    TAKEN = "taken"  # a prefill worker (or the decode loop itself) runs it
    RETURNED = "returned"  # a worker stopped between layers for a prefill: the decode loop finishes it
    DONE = "done"  # logits or error set


@dataclass(eq=False)
class DecodeShare:
    """Rows of one decode step that an idle prefill worker runs on its own core."""

    step: DecodeStep  # the share's sequences, run layer by layer
    state: ShareState = ShareState.PENDING
    by_worker: bool = False
    logits: torch.Tensor | None = None  # (b, V) once DONE, unless error
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class LoopTime:
    """The decode loop's recent seconds, decode steps and prefills apart (a sliding window).

    Args:
        window_s: how far back events count.
    """

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._events: deque[tuple[float, float, bool]] = deque()  # (end, seconds, prefill)

    def add(self, seconds: float, prefill: bool) -> None:
        """Record one decode step or prefill that just ended.

        Args:
            seconds: how long it took.
            prefill: a prefill (not a decode step).
        """
        now = time.monotonic()
        self._events.append((now, seconds, prefill))
        while self._events and self._events[0][0] < now - self.window_s:
            self._events.popleft()

    def prefill_share(self) -> float:
        """Prefill seconds over all seconds in the window (0.0 when empty)."""
        total = sum(s for _, s, _ in self._events)
        return sum(s for _, s, p in self._events if p) / total if total > 0 else 0.0


def run_share(share: DecodeShare, prefill_due: Callable[[], bool] | None = None) -> None:
    """Run a share's layers on this thread; never raises (an error is the share's). With ``prefill_due``
    (a worker's run) it stops between layers once that says a request waits for a prefill, and hands
    the rest back (RETURNED: the decode loop finishes it).

    Args:
        share: the posted share, TAKEN by the caller.
        prefill_due: asked before every layer (None: run every layer).
    """
    try:
        step = share.step
        while not step.done:
            if prefill_due is not None and prefill_due():
                share.state = ShareState.RETURNED
                return
            step.advance()
        share.logits = step.finish()  # (b, V)
        share.state = ShareState.DONE
    except BaseException as e:  # noqa: BLE001 - handed to the decode loop, which fails the batch
        share.error = e
        share.state = ShareState.DONE
    finally:
        share.done.set()
