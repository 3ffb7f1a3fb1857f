"""The scheduler's decode loop: one thread, every step ONE batched forward over all active sequences.

    wait for work ─► prefilled requests join the batch (their caches into decode-pool slots)
                  ─► a prefill here (nothing to decode, or within its prefill share; every worker busy)
                  ─► or one decode step: one token each ─► sinks; finished requests leave

Each sequence keeps its own KV cache (the one its prefill filled, or a slot of the decode pool it
moved into when it joined), so no copy or paging happens at admission; see
:mod:`blend.batch_decode` for the step.

Decode shares. A prefill worker with nothing to prefill would leave its core
idle while the decode loop's GEMMs run on one. So a large enough step hands
part of its sequences to an idle worker (a :class:`~blend.serve.decode_share.DecodeShare`), runs the
rest itself, and joins the two row blocks::

    decode loop:  post share (rows m..B) ─► decode rows 0..m ─► share taken? wait : run it here ─► cat
    idle worker:  ─────────────── take share ─► decode rows m..B ─► done

Prefills come first: the decode loop posts no share while requests wait for
a prefill, a worker takes a waiting request before a share, and a worker that
is running a share when a request arrives stops at the next layer boundary
and hands the rest of the share back (a :class:`~blend.batch_decode.DecodeStep`
runs a layer at a time), so a share delays a prefill by one layer of one
decode step (~10 ms), not by a whole step. If no worker picked the share up by
the time the decode loop is done with its own rows, the decode loop takes it
back and runs it itself; a share handed back mid-way it finishes itself.

The other way round, a decode loop with nothing to decode (no active
sequence) takes a waiting prefill while every worker is busy, so a burst of
requests into an idle server prefills on both cores. A request whose prefill
finishes meanwhile waits for the decode loop's prefill to end before its
second token (its first one was sent already). With
``decode_loop_prefill_share`` the decode loop does so with sequences to decode
as well, while prefills took less than that share of its recent time
(:class:`~blend.serve.decode_share.LoopTime`): under a queue both cores prefill, and the batch's streams
pause while the loop prefills.

Threads: the decode loop runs torch with its own intra-op thread count
(``torch_threads``: the cores divided among the loop and the prefill workers, so
they never oversubscribe). Optionally it takes more while no
prefill runs (``idle_decode_threads``, THROUGHPUT mode only): that changes a
decode step's numbers by float rounding at most, which THROUGHPUT mode allows
anyway; prefills keep their thread count fixed (their logits are the ones
reported bit for bit).
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import nullcontext
from typing import Callable

import torch

from blend.batch_decode import decode_batch
from blend.decode_pool import DecodePool, PoolSlotCache
from blend.model import ModelRunner
from blend.serve.config import LOOP_SHARE_WINDOW_S, SchedulerConfig
from blend.serve.decode_share import LoopTime, ShareDesk
from blend.serve.jobs import Ending, Event, EventKind, SchedulerJob, ShuttingDownError
from blend.serve.loop_threads import LoopThreads
from blend.serve.metrics import ServeMetrics
from blend.serve.request_book import RequestBook

log = logging.getLogger("blend.serve.scheduler")  # the scheduler's records keep one logger name


class DecodeLoop:
    """The decode loop of one scheduler (its thread runs :meth:`run`).

    Args:
        book: the scheduler's requests and shared counts.
        shares: the desk where the loop posts decode shares for idle workers.
        runner: the model.
        config: the scheduler's settings.
        metrics: where to report (optional).
        pool: the decode pool joining requests' caches move into (None: each keeps its own).
        exclusive: held around every forward (dynamic-NTK RoPE; None: no lock).
        run_prefill: runs one request's prefill (the scheduler's), for the prefills the loop takes.
    """

    def __init__(self, book: RequestBook, shares: ShareDesk, runner: ModelRunner, config: SchedulerConfig,
                 metrics: ServeMetrics | None, pool: DecodePool | None, exclusive: threading.Lock | None,
                 run_prefill: Callable[[SchedulerJob], None]) -> None:
        self.book, self.shares, self.runner, self.config, self.metrics = book, shares, runner, config, metrics
        self.pool, self.exclusive, self.run_prefill = pool, exclusive, run_prefill
        self.threads = LoopThreads(config)  # the loop's thread count
        self.time = LoopTime(LOOP_SHARE_WINDOW_S)  # the loop's recent decode / prefill seconds
        self.steps = 0
        self.prefills = 0  # prefills the loop ran (idle, or within its prefill share)

    def run(self) -> None:
        """The loop's thread: iterations until the scheduler stops (a failed iteration fails its batch)."""
        self.threads.setup()
        batch: list[SchedulerJob] = []  # changed in place, so that a failed iteration knows whom to fail
        while True:
            try:
                if not self._iteration(batch):
                    return
            except Exception as e:  # noqa: BLE001 - a bug here fails the batch, never the loop
                log.exception("decode loop iteration failed; its requests fail")
                for job in batch:
                    self.book.fail(job, e)
                batch.clear()

    def _iteration(self, batch: list[SchedulerJob]) -> bool:
        """Wait for work, then run one prefill or one decode step (``batch`` is updated in place).

        Returns:
            False once the scheduler stops (the batch's requests failed).
        """
        book = self.book
        job, joining = None, []
        with book.cond:
            book.cond.wait_for(lambda: not book.running or book.incoming or batch
                               or book.decode_loop_prefill_due())
            stopping = not book.running
            if not stopping:
                joining = list(book.incoming)
                batch.extend(joining)
                book.incoming.clear()
                if book.decode_loop_prefill_due() and (not batch or self._share_allows()):
                    job = book.take()
        if stopping:  # retired (slot back to the pool, counted), not only told: fail takes the lock itself
            for job in batch:
                book.fail(job, ShuttingDownError())
            batch.clear()
            return False
        if joining:  # before a prefill this iteration may run: the next iteration no longer knows them
            self._pool_joined(batch, joining)
        if job is not None:  # nothing to decode (or within its share) and every worker busy: prefill here
            self.prefills += 1
            self.threads.for_prefill()
            t0 = time.perf_counter()
            self.run_prefill(job)
            self.time.add(time.perf_counter() - t0, prefill=True)
            return True
        live = []
        for job in batch:
            if job.cancelled.is_set():
                book.retire(job, Ending.CANCELLED)
            else:
                live.append(job)
        batch[:] = live
        if batch:
            t0 = time.perf_counter()
            batch[:] = self.step(batch)
            self.time.add(time.perf_counter() - t0, prefill=False)
        return True

    def _share_allows(self) -> bool:
        """With sequences to decode, whether the loop may take a prefill: a share is set and
        prefills took less than it of the loop's recent time."""
        share = self.config.decode_loop_prefill_share
        return share is not None and self.time.prefill_share() < share

    def _pool_joined(self, batch: list[SchedulerJob], joining: list[SchedulerJob]) -> None:
        """Move the caches of requests that just joined the batch into free pool slots, and keep
        the batch in slot order, so a step's halves (decode shares) read disjoint slot ranges."""
        pool = self.pool
        if pool is None:
            return
        for job in joining:
            if job.cache is not None and not job.retired:
                try:
                    job.cache = pool.adopt(job.cache)
                except Exception as e:  # noqa: BLE001 - this request fails, the batch goes on
                    log.exception("request %d: moving its cache into the decode pool failed", job.id)
                    self.book.fail(job, e)
        batch[:] = [j for j in batch if not j.retired]
        batch.sort(key=lambda j: j.cache.slot if isinstance(j.cache, PoolSlotCache) else pool.slots)

    def step(self, batch: list[SchedulerJob]) -> list[SchedulerJob]:
        """One batched decode step.

        Args:
            batch: the requests decoding, in slot order.

        Returns:
            The requests still decoding.
        """
        self.threads.for_decode(self.book.prefilling)
        caches, tokens = [j.cache for j in batch], [j.stream.next_input for j in batch]
        share = None
        try:
            share = self.shares.offer(caches, tokens, self.book.worker_free)
            own = len(caches) - (share.step.b if share is not None else 0)
            with self.exclusive or nullcontext():
                logits = decode_batch(self.runner, caches[:own], tokens[:own], self.config.batching)  # (m, V)
            if share is not None:
                logits = torch.cat([logits, self.shares.collect(share)])  # (B, V)
        except BaseException as e:  # noqa: BLE001 - fail this batch's requests, keep serving
            if share is not None:
                self.shares.abandon(share)
            log.exception("decode step failed")
            for job in batch:
                self.book.fail(job, e)
            return []
        self.steps += 1
        if self.metrics is not None:
            self.metrics.on_batch(len(batch))
        still = []
        for i, job in enumerate(batch):
            try:
                if self._advance(job, logits[i]):
                    still.append(job)
            except Exception as e:  # noqa: BLE001 - sampling failed for this request only
                log.exception("request %d: sampling failed", job.id)
                self.book.fail(job, e)
        return still

    def _advance(self, job: SchedulerJob, logits: torch.Tensor) -> bool:
        """Sample one request's next token from its logits row (V,) and send what it adds.

        Returns:
            Whether the request goes on decoding (False: it completed).
        """
        before = job.stream.generated
        text = job.stream.step(logits)
        if self.metrics is not None:
            self.metrics.on_tokens(job.stream.generated - before)
        if text:
            self.book.emit(job, Event(EventKind.TEXT, text=text, logprobs=job.stream.take_logprobs()))
        if job.stream.finished:
            self.book.complete(job)
            return False
        return True
