"""Decode shares: rows of one decode step that an idle prefill worker runs on its own core (see
:mod:`blend.serve.decode_loop`), the desk where the decode loop posts them, and the decode loop's recent
time, decode steps and prefills apart."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

import torch

from blend.batch_decode import INVARIANT_TILE, DecodeBatching, DecodeStep
from blend.kvcache import KVCache
from blend.serve.config import SchedulerConfig
from blend.serve.metrics import ServeMetrics


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


def share_rows(config: SchedulerConfig, b: int, exclusive: bool) -> int:
    """How many of a b-row decode step's sequences to hand to a worker.

    Args:
        config: the scheduler's settings (the minimum batch, batching mode, idle decode threads).
        b: the step's sequences.
        exclusive: the engine's steps run one at a time (dynamic-NTK RoPE): never share.

    Returns:
        The rows to share, the step's last ones (0: none).
    """
    if (config.share_decode_min_batch is None or b < config.share_decode_min_batch
            or config.idle_decode_threads is not None or exclusive):
        return 0
    if config.batching is DecodeBatching.INVARIANT:  # whole tiles only: every row keeps its numbers
        return (b // INVARIANT_TILE // 2) * INVARIANT_TILE
    return b // 2


class ShareDesk:
    """Where the decode loop posts the share of its step, one at a time, for an idle prefill worker.

    The decode loop offers a share (:meth:`offer`) before it runs its own rows and collects it after
    (:meth:`collect`, which runs it on the loop if no worker took it); an idle worker takes a pending one
    (:meth:`take`). ``posted`` is guarded by the scheduler's condition, which the desk shares with it.

    Args:
        cond: the scheduler's condition.
        runner: the engine's model runner (a share's :class:`DecodeStep` runs on it).
        config: the scheduler's settings.
        exclusive: the engine's steps run one at a time (no share is ever posted).
        metrics: where steps a worker helped with are counted (optional).
    """

    def __init__(self, cond: threading.Condition, runner, config: SchedulerConfig, exclusive: bool,
                 metrics: ServeMetrics | None = None) -> None:
        self._cond = cond
        self._runner = runner
        self._config = config
        self._exclusive = exclusive
        self._metrics = metrics
        self.posted: DecodeShare | None = None  # the decode step's posted share, if any
        self.shared_steps = 0  # decode steps whose share a prefill worker ran (in whole or in part)
        self.returned = 0  # shares a worker handed back between layers for a prefill

    def rows(self, b: int) -> int:
        """How many of a b-row step's sequences to hand to a worker (0: none)."""
        return share_rows(self._config, b, self._exclusive)

    def pending(self) -> bool:
        """A posted share waits for a worker (the caller holds the condition)."""
        return self.posted is not None and self.posted.state is ShareState.PENDING

    def take(self) -> DecodeShare:
        """A worker takes the pending share (the caller holds the condition and saw :meth:`pending`)."""
        share = self.posted
        share.state, share.by_worker = ShareState.TAKEN, True
        return share

    def offer(self, caches: list[KVCache], tokens: list[int], can_post: Callable[[], bool]) -> DecodeShare | None:
        """Post the tail of this step's sequences for an idle prefill worker.

        Args:
            caches: the step's caches, in batch order.
            tokens: their next input tokens.
            can_post: asked under the condition: a worker is idle and no prefill is about to take it.

        Returns:
            The posted share, or None (too few rows, or no free worker).
        """
        n = self.rows(len(caches))
        if n == 0:
            return None
        with self._cond:
            if not can_post():
                return None
            share = self.posted = DecodeShare(DecodeStep(self._runner, caches[-n:], tokens[-n:],
                                                         self._config.batching))
            self._cond.notify_all()
        return share

    def collect(self, share: DecodeShare) -> torch.Tensor:
        """The share's logits (b, V): run it here if no worker took it, else wait for the worker
        (and finish what it handed back).

        Raises:
            BaseException: the error the share's run raised.
        """
        with self._cond:
            mine = share.state is ShareState.PENDING
            if mine:
                share.state = ShareState.TAKEN
            self.posted = None
        if mine:
            run_share(share)
        share.done.wait()
        if share.error is not None:
            raise share.error
        if share.by_worker:
            self.shared_steps += 1
            if self._metrics is not None:
                self._metrics.shared_steps.inc()
        if share.state is ShareState.RETURNED:
            self.returned += 1
            return share.step.finish()
        return share.logits

    def abandon(self, share: DecodeShare) -> None:
        """The step failed: drop its share, and wait for a worker still running it (no thread may
        touch the batch's caches once its requests have failed)."""
        with self._cond:
            if share.state is ShareState.PENDING:
                share.state = ShareState.DONE
                share.done.set()
            self.posted = None
        share.done.wait()
