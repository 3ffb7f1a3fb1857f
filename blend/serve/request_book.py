"""The scheduler's book of requests: who waits, who runs, how each ended, and what its threads may do now.

    submit ─► waiting (≤ max_queue) ─► take: active ─► prefilled: incoming ─► the decode loop's batch
                 │                       │                                          │
                 └── cancel / drain ─────┴──────────── retire: completed / failed / cancelled (counted once)

Every field here is read and written under :attr:`RequestBook.cond`, the one condition variable the
scheduler's threads wait on (the :class:`~blend.serve.decode_share.ShareDesk` shares it). A request is
retired exactly once, whichever thread gets there first: its slot and KV are freed and one counter
moves.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections import deque
from contextlib import contextmanager
from typing import Iterator

from blend.decode_pool import DecodePool
from blend.errors import KVBlendError
from blend.policy import ReusePolicy
from blend.prompt import Prompt
from blend.sampling import GenerationConfig
from blend.serve.config import SchedulerConfig
from blend.serve.jobs import Ending, Event, EventKind, QueueFullError, SchedulerJob, ShuttingDownError, Sink
from blend.serve.metrics import ServeMetrics

log = logging.getLogger("blend.serve.scheduler")  # the scheduler's records keep one logger name


class RequestBook:
    """The requests one scheduler holds and its threads' shared counts, under one condition.

    Args:
        config: the scheduler's settings (its capacity).
        metrics: where the queue depth and active count go (optional).
        pool: the decode pool whose slots retired requests give back (None: no pool).
    """

    def __init__(self, config: SchedulerConfig, metrics: ServeMetrics | None, pool: DecodePool | None) -> None:
        self.config = config
        self.metrics = metrics
        self.pool = pool
        self.cond = threading.Condition()
        self.waiting: deque[SchedulerJob] = deque()
        self.incoming: list[SchedulerJob] = []  # prefilled, not yet in the decode loop's batch
        self.active = 0
        self.running = False
        self.draining = False  # stopping: no new request is taken (drain)
        self.prefilling = 0  # prefills running now (the decode loop takes every core when 0)
        self.idle_workers = 0  # prefill workers waiting for work (they may take a decode share)
        self.prefilling_jobs: set[SchedulerJob] = set()  # requests whose prefill runs now (close fails them at once)
        self.e2e_ewma_s = 1.0
        self.completed = 0
        self.cancelled = 0
        self.failed = 0
        self.interrupted = 0  # prefills stopped between layers: their request was cancelled while they ran
        self._ids = itertools.count(1)

    # ---- admission ------------------------------------------------------------------------

    def admit(self, prompt: Prompt, policy: ReusePolicy, config: GenerationConfig, sink: Sink) -> SchedulerJob:
        """Queue a request.

        Args:
            prompt, policy, config: what it asks for.
            sink: where its events go.

        Returns:
            Its job, waiting for a prefill.

        Raises:
            QueueFullError: no slot and no queue place.
            ShuttingDownError: the scheduler is not running.
        """
        cfg = self.config
        with self.cond:
            if not self.running or self.draining:
                raise ShuttingDownError("server not running (shutting down)")
            if self.active + len(self.waiting) >= cfg.max_concurrency + cfg.max_queue:
                raise QueueFullError(
                    f"server busy: {self.active} requests running and {len(self.waiting)} queued "
                    f"(max_concurrency={cfg.max_concurrency}, max_queue={cfg.max_queue})", self.retry_after_s())
            job = SchedulerJob(next(self._ids), prompt, policy, config, sink, time.perf_counter())
            self.waiting.append(job)
            self.gauges()
            self.cond.notify_all()
        return job

    def take(self) -> SchedulerJob:
        """The next waiting request, now active (the caller holds ``cond`` and saw a prefill due)."""
        job = self.waiting.popleft()
        self.active += 1
        self.gauges()
        self.cond.notify_all()  # a busy worker now: the decode loop may take the next one
        return job

    def cancel(self, job: SchedulerJob) -> None:
        """Mark a request cancelled; one still waiting leaves the queue now, retired as cancelled (no event:
        its client is gone).

        Args:
            job: the request.
        """
        with self.cond:
            job.cancelled.set()
            if not job.retired and job in self.waiting:
                self.waiting.remove(job)
                job.retired = True  # never active: no slot to give back
                self.cancelled += 1
                self.gauges()
            self.cond.notify_all()

    def drain(self) -> None:
        """Take no new request and fail the queued ones now (see :meth:`blend.serve.scheduler.Scheduler.drain`)."""
        with self.cond:
            self.draining = True
            left = self._drop_waiting()
            self.gauges()
            self.cond.notify_all()
        for job in left:
            self.emit(job, Event(EventKind.FAILED, error=ShuttingDownError()))

    def stop(self) -> tuple[list[SchedulerJob], list[SchedulerJob]]:
        """Stop the threads' loops: the queue is emptied (its requests counted as failed, not told yet).

        Returns:
            (the requests that waited, the prefilled ones that had not joined the batch).
        """
        with self.cond:
            self.running = False
            waiting, incoming = self._drop_waiting(), list(self.incoming)
            self.incoming.clear()
            self.gauges()
            self.cond.notify_all()
        return waiting, incoming

    def take_incoming(self) -> list[SchedulerJob]:
        """The prefilled requests that had not joined the batch (removed)."""
        with self.cond:
            incoming = list(self.incoming)
            self.incoming.clear()
        return incoming

    def _drop_waiting(self) -> list[SchedulerJob]:
        """Empty the queue, each request retired and counted as failed (the caller holds ``cond``)."""
        left = list(self.waiting)
        self.waiting.clear()
        for job in left:
            job.retired = True  # never active: no slot to give back
            self.failed += 1
        return left

    # ---- what may run now (read under ``cond``; a worker running a share also asks between layers) ----

    def prefill_due(self) -> bool:
        """A request waits for a prefill and a slot is free for it."""
        return bool(self.waiting) and self.active < self.config.max_concurrency

    def decode_loop_prefill_due(self) -> bool:
        """The decode loop may take a prefill: allowed, one is due and no worker is free for it
        (the caller checks that there is nothing to decode, or that its prefill share allows one)."""
        return self.config.decode_loop_prefills and self.idle_workers == 0 and self.prefill_due()

    def worker_free(self) -> bool:
        """A prefill worker is idle and no waiting request is about to take it: a share may be posted."""
        return self.idle_workers > 0 and not self.prefill_due()

    @contextmanager
    def prefill_running(self) -> Iterator[None]:
        """Count a prefill (or a refinement step) as running for the block's duration."""
        with self.cond:
            self.prefilling += 1
        try:
            yield
        finally:
            with self.cond:
                self.prefilling -= 1

    # ---- counts ---------------------------------------------------------------------------

    def gauges(self) -> None:
        """Publish the queue depth and the active count (the caller holds ``cond``)."""
        if self.metrics is not None:
            self.metrics.queue_depth.set(len(self.waiting))
            self.metrics.active.set(self.active)

    def retry_after_s(self) -> int:
        """Seconds until a slot is likely free (at least 1)."""
        waiting = len(self.waiting) + 1
        return max(1, math.ceil(self.e2e_ewma_s * waiting / self.config.max_concurrency))

    # ---- endings --------------------------------------------------------------------------

    def complete(self, job: SchedulerJob) -> None:
        """A request's answer is finished: retire it and send its completion."""
        e2e = time.perf_counter() - job.submitted
        completion = job.stream.completion(job.prompt, job.first_logits, job.report, job.ttft_s, e2e)
        if self.metrics is not None:
            self.metrics.on_finish(e2e)
        self.retire(job, Ending.COMPLETED, e2e)
        self.emit(job, Event(EventKind.DONE, completion=completion, logprobs=job.stream.take_logprobs()))

    @staticmethod
    def emit(job: SchedulerJob, event: Event) -> None:
        """Send an event to a request's sink (a sink that raises is logged, never the scheduler's problem)."""
        try:
            job.sink(event)
        except Exception:  # noqa: BLE001 - a consumer's bug must not stop the scheduler
            log.exception("request %d: event sink failed", job.id)

    def fail(self, job: SchedulerJob, error: BaseException) -> None:
        """Retire a request as failed and tell its client (once: one that ended already is only logged)."""
        if not self.retire(job, Ending.FAILED):  # it already ended; nothing more to tell its client
            log.error("request %d: error after it ended: %s", job.id, error)
            return
        if not isinstance(error, KVBlendError):
            log.error("request %d failed: %s: %s", job.id, type(error).__name__, error)
        self.emit(job, Event(EventKind.FAILED, error=error))

    def interrupted_prefill(self) -> None:
        """Count a prefill its request's cancellation stopped (the request is retired apart)."""
        with self.cond:
            self.interrupted += 1

    def retire(self, job: SchedulerJob, ending: Ending, e2e_s: float | None = None) -> bool:
        """Free an active request's slot and KV and count how it ended (under the lock: several
        threads retire requests).

        Returns:
            False when it had been retired already (nothing counted).
        """
        if self.pool is not None:
            self.pool.release(job.cache)  # a no-op for a cache that is not one of its slots
        job.cache = None  # frees the request's KV now, whoever still holds the job
        with self.cond:
            if job.retired:
                return False
            job.retired = True
            if ending is Ending.COMPLETED:
                self.completed += 1
                if e2e_s is not None:
                    self.e2e_ewma_s = 0.9 * self.e2e_ewma_s + 0.1 * e2e_s
            elif ending is Ending.FAILED:
                self.failed += 1
            else:
                self.cancelled += 1
            self.active -= 1
            self.gauges()
            self.cond.notify_all()
        return True
