"""The scheduler: many requests over one engine, decode steps batched.

    submit ─► waiting (≤ max_queue) ─► prefill worker(s) ─► decode loop (one thread)
                                        engine.prefill        every step: ONE batched forward over
                                        (exact / blend)       all active sequences (decode_batch),
                                        first token ─► sink   one token each ─► sinks; finished leave,
                                                              prefilled requests join between steps

Why prefill workers beside the decode loop (and not a prefill slice inside
it): a blended prefill is one engine call whose layer loop spans the whole
prompt (check-layer selection needs every row), so it cannot be cut into
slices without reshaping the engine. On a separate thread it runs while the
decode loop keeps stepping (torch releases the GIL in its kernels), so a long
prefill slows the other streams' steps by the CPU it takes but never stops
them for its whole duration. A request joins the decode batch at the next
step boundary after its prefill. Cores are shared: two threads on two cores
each run slower than alone, which the benchmark measures.

Each sequence keeps its own KV cache (the one its prefill filled), so no copy
or paging happens at admission; see :mod:`blend.batch_decode` for the step.

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

Threads: each prefill worker and the decode loop run torch with their own
intra-op thread count (``torch_threads``: the cores divided among them, so
they never oversubscribe). Optionally the decode loop takes more while no
prefill runs (``idle_decode_threads``, THROUGHPUT mode only): that changes a
decode step's numbers by float rounding at most, which THROUGHPUT mode allows
anyway; prefills keep their thread count fixed (their logits are the ones
reported bit for bit).

Refinement (``refine_after``, off by default; :mod:`blend.serve.refine`): a worker with
no prefill and no decode share to run computes, a segment at a time, the exact KV of a
document order that blends keep seeing, so that later blends of it are exact. It checks
for waiting requests before every segment.

Capacity: at most ``max_concurrency`` requests prefill or decode at once; up
to ``max_queue`` more wait; a request beyond that is refused
(:class:`~blend.serve.jobs.QueueFullError`, the server's 429 with Retry-After).
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import replace

import torch

from blend.batch_decode import DecodeBatching, decode_batch
from blend.decode_pool import DecodePool, PoolSlotCache
from blend.errors import KVBlendError
from blend.generation import TokenStream
from blend.policy import ReuseMode, ReusePolicy
from blend.prefix_fill import PrefixFill
from blend.prompt import Prompt
from blend.sampling import GenerationConfig
from blend.serve.config import LOOP_SHARE_WINDOW_S, SchedulerConfig
from blend.serve.decode_share import LoopTime, ShareDesk, run_share
from blend.serve.flight import FlightStore, request_keys
from blend.serve.jobs import Ending, Event, EventKind, QueueFullError, SchedulerJob, ShuttingDownError, Sink, Ticket
from blend.serve.loop_threads import LoopThreads, set_worker_threads
from blend.serve.metrics import ServeMetrics
from blend.serve.refine import RefineQueue

log = logging.getLogger(__name__)


class Scheduler:
    """Runs requests over one engine.

    Args:
        engine: the engine (its store wrapped in a :class:`FlightStore` enables single-flight).
        config: concurrency settings.
        metrics: where to report (optional).
    """

    def __init__(self, engine, config: SchedulerConfig | None = None, metrics: ServeMetrics | None = None) -> None:
        self.engine = engine
        self.config = config or SchedulerConfig()
        self.metrics = metrics
        store = engine.store
        self.flight = store if isinstance(store, FlightStore) and self.config.single_flight else None
        self._cond = threading.Condition()
        self._waiting: deque[SchedulerJob] = deque()
        self._incoming: list[SchedulerJob] = []
        self._active = 0
        self._running = False
        self._draining = False  # stopping: no new request is taken (drain)
        self._prefilling_jobs: set[SchedulerJob] = set()  # requests whose prefill runs now (close fails them at once)
        self._closing = threading.Lock()  # one close at a time (a shutdown deadline's and the lifespan's)
        self._threads: list[threading.Thread] = []
        self._ids = itertools.count(1)
        # dynamic-NTK RoPE tables are rebuilt per call length (shared state): no overlap then
        self._exclusive = threading.Lock() if engine.runner.rope.dynamic else None
        self._gate_lock = threading.Lock()
        self._prefilling = 0  # prefills running now (the decode loop takes every core when 0)
        self._idle_workers = 0  # prefill workers waiting for work (they may take a decode share)
        self.shares = ShareDesk(self._cond, engine.runner, self.config, self._exclusive is not None, metrics)
        self._loop_threads = LoopThreads(self.config)  # the decode loop's thread count
        self._e2e_ewma_s = 1.0
        self.completed = 0
        self.cancelled = 0
        self.failed = 0
        self.steps = 0
        self.decode_loop_prefills = 0  # prefills the decode loop ran (idle, or within its prefill share)
        self._loop_time = LoopTime(LOOP_SHARE_WINDOW_S)  # the decode loop's recent decode / prefill seconds
        self.pool = self._make_pool()  # decoding sequences' caches (None: each keeps its own)
        cfg = self.config
        self.refine = (RefineQueue(engine.segments, cfg.refine_after, cfg.refine_max_pending, cfg.refine_max_tracked)
                       if cfg.refine_after is not None else None)
        if self.refine is not None and metrics is not None:
            metrics.refine_pending.set_function(lambda: self.refine.pending)  # read at scrape time

    def _make_pool(self) -> DecodePool | None:
        cfg, runner = self.config, self.engine.runner
        if cfg.decode_pool_tokens is None or cfg.batching is not DecodeBatching.THROUGHPUT:
            return None
        d = runner.dims
        return DecodePool(d.num_layers, d.num_kv_heads, d.head_dim, cfg.max_concurrency, cfg.decode_pool_tokens,
                          runner.dtype, runner.device)

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Start the prefill workers and the decode loop."""
        if self._running:
            return
        runner = self.engine.runner
        if not runner.rope.dynamic:  # grow the RoPE tables once, before threads share them
            runner.rope(torch.tensor([runner.dims.max_positions - 1]))
        self._running = True
        for i in range(self.config.prefill_workers):
            self._threads.append(threading.Thread(target=self._prefill_loop, name=f"kvblend-prefill-{i}", daemon=True))
        self._threads.append(threading.Thread(target=self._decode_loop, name="kvblend-decode", daemon=True))
        for t in self._threads:
            t.start()

    def drain(self) -> None:
        """Take no new request (``submit`` raises ShuttingDownError) and fail the queued ones now: they have
        not started, so a 503 at once lets a client or a balancer retry elsewhere instead of waiting out a
        stopping server's grace period. Running requests go on (:meth:`close` ends them)."""
        with self._cond:
            self._draining = True
            left = list(self._waiting)
            self._waiting.clear()
            for job in left:
                job.retired = True  # never active: no slot to give back
                self.failed += 1
            self._gauges()
            self._cond.notify_all()
        for job in left:
            self._emit(job, Event(EventKind.FAILED, error=ShuttingDownError()))

    def close(self, timeout: float = 10.0) -> None:
        """Stop the threads; requests still queued or running fail."""
        with self._closing:
            self._close(timeout)

    def _close(self, timeout: float) -> None:
        with self._cond:
            prefilling = list(self._prefilling_jobs)
        for job in prefilling:  # a prefill cannot be interrupted: its client gets the 503 now, not after it
            job.cancelled.set()
            self._fail(job, ShuttingDownError())
        with self._cond:
            self._running = False
            waiting, incoming = list(self._waiting), list(self._incoming)
            self._waiting.clear()
            self._incoming.clear()
            for job in waiting:
                job.retired = True  # never active: no slot to give back
                self.failed += 1
            self._gauges()
            self._cond.notify_all()
        if self.flight is not None:  # a prefill waiting on another request's chunk stops waiting
            self.flight.wake()
        for t in self._threads:
            t.join(timeout)
        self._threads.clear()
        with self._cond:  # a prefill that was running finished into the batch's queue after the snapshot
            incoming += list(self._incoming)
            self._incoming.clear()
        for job in waiting:
            self._emit(job, Event(EventKind.FAILED, error=ShuttingDownError()))
        for job in incoming:  # prefilled, active: retired (cache freed, counted); one failed already: no 2nd event
            self._fail(job, ShuttingDownError())

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def cancel(self, job: SchedulerJob) -> None:
        """Cancel a request: if it still waits for a prefill it leaves the queue now and is retired
        as cancelled (no event: its client is gone); otherwise its thread drops it at the next check.

        Args:
            job: the request (a :class:`Ticket`'s).
        """
        with self._cond:
            job.cancelled.set()
            if not job.retired and job in self._waiting:
                self._waiting.remove(job)
                job.retired = True  # never active: no slot to give back
                self.cancelled += 1
                self._gauges()
            self._cond.notify_all()
        if self.flight is not None:  # a prefill waiting on another request's chunk stops waiting
            self.flight.wake()

    def dead_threads(self) -> list[str]:
        """Names of the scheduler's threads that stopped while it runs (none while it is healthy).

        Returns:
            Thread names, empty when every prefill worker and the decode loop is alive (or the
            scheduler is not running).
        """
        if not self._running:
            return []
        return [t.name for t in list(self._threads) if not t.is_alive()]

    # ---- state ----------------------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def active(self) -> int:
        return self._active

    @property
    def shared_steps(self) -> int:
        """Decode steps whose share a prefill worker ran (in whole or in part)."""
        return self.shares.shared_steps

    @property
    def returned_shares(self) -> int:
        """Shares a worker handed back between layers for a prefill."""
        return self.shares.returned

    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.set(len(self._waiting))
            self.metrics.active.set(self._active)

    def retry_after_s(self) -> int:
        """Seconds until a slot is likely free (at least 1)."""
        waiting = len(self._waiting) + 1
        return max(1, math.ceil(self._e2e_ewma_s * waiting / self.config.max_concurrency))

    # ---- submit ---------------------------------------------------------------------------

    def submit(self, prompt: Prompt, policy: ReusePolicy, config: GenerationConfig, sink: Sink) -> Ticket:
        """Queue a request; its events go to ``sink``.

        Raises:
            QueueFullError: no slot and no queue place.
            ShuttingDownError: the scheduler is not running.
        """
        cfg = self.config
        with self._cond:
            if not self._running or self._draining:
                raise ShuttingDownError("server not running (shutting down)")
            if self._active + len(self._waiting) >= cfg.max_concurrency + cfg.max_queue:
                raise QueueFullError(
                    f"server busy: {self._active} requests running and {len(self._waiting)} queued "
                    f"(max_concurrency={cfg.max_concurrency}, max_queue={cfg.max_queue})", self.retry_after_s())
            job = SchedulerJob(next(self._ids), prompt, policy, config, sink, time.perf_counter())
            self._waiting.append(job)
            self._gauges()
            self._cond.notify_all()
        return Ticket(job, self.cancel)

    # ---- prefill --------------------------------------------------------------------------

    def _prefill_loop(self) -> None:
        set_worker_threads(self.config)
        while True:
            share = job = fill = None
            with self._cond:
                self._idle_workers += 1
                self._cond.wait_for(lambda: not self._running or self.shares.pending() or self._prefill_due()
                                    or self._refine_due())
                self._idle_workers -= 1
                if not self._running:
                    return
                if self._prefill_due():  # prefills first
                    job = self._take_job()
                elif self.shares.pending():  # then the decode step's share
                    share = self.shares.take()
                else:  # then one segment of an order's exact KV
                    fill = self.refine.take()
            try:
                if share is not None:  # a worker stops between layers when a request waits for a prefill
                    run_share(share, self._prefill_due)
                elif job is not None:
                    self._run_prefill(job)
                elif fill is not None:
                    self._run_refine(fill)
            except Exception:  # noqa: BLE001 - each of them handles its own errors; a bug must not stop the worker
                log.exception("prefill worker iteration failed")

    def _refine_due(self) -> bool:
        """An order waits for refinement (and no request for a prefill)."""
        return (self.refine is not None and self.refine.pending > 0 and not self._prefill_due()
                and not self._draining)  # a stopping server leaves the cores to the requests it finishes

    def _run_refine(self, fill: PrefixFill) -> None:
        """One step of a :class:`~blend.prefix_fill.PrefixFill` on this idle worker; never raises."""
        with self._cond:
            self._prefilling += 1
        computed_before, failed = fill.computed, False
        try:
            with self._exclusive or nullcontext():
                fill.step()
        except BaseException:  # noqa: BLE001 - a failed fill is dropped; serving goes on
            log.exception("refinement of a document order failed; dropped")
            failed = True
        finally:
            with self._cond:
                self._prefilling -= 1
        computed = fill.computed - computed_before
        if self.metrics is not None:  # before put_back, which publishes the fill's outcome
            self.metrics.refined_segments.inc(computed)
            if fill.done and not failed and fill.computed:  # an order found stored already gained nothing
                self.metrics.refined_orders.inc()
        self.refine.put_back(fill, computed, failed)

    def _take_job(self) -> SchedulerJob:
        """The next waiting request, now active (the caller holds ``_cond`` and saw a prefill due)."""
        job = self._waiting.popleft()
        self._active += 1
        self._gauges()
        self._cond.notify_all()  # a busy worker now: the decode loop may take the next one
        return job

    def _run_prefill(self, job: SchedulerJob) -> None:
        with self._cond:
            self._prefilling_jobs.add(job)
        try:
            self._prefill(job)
        except BaseException as e:  # noqa: BLE001 - a failed request must not kill the thread
            self._fail(job, e)
        finally:
            with self._cond:
                self._prefilling_jobs.discard(job)

    def _prefill(self, job: SchedulerJob) -> None:
        if job.cancelled.is_set():
            self._retire(job, Ending.CANCELLED)
            return
        engine = self.engine
        try:
            if self.flight is not None:
                busy = self.flight.claim(job.id, request_keys(engine, job.prompt, job.policy))
                self.flight.wait(busy, self.config.flight_timeout_s, job.cancelled)
                if job.cancelled.is_set():  # its client left while it waited: no prefill for nobody
                    self._retire(job, Ending.CANCELLED)
                    return
            gate_s = 0.0  # the first blend request may run the quality gate (once): not its TTFT, said in its report
            if job.policy.mode is ReuseMode.BLEND and engine.gate is not None and not job.policy.force:
                with self._gate_lock:
                    gate_s = engine.gate.verdict(engine).ran_s
            with self._cond:
                self._prefilling += 1
            try:
                with self._exclusive or nullcontext():
                    first, cache, report = engine.prefill(job.prompt, job.policy, job.config.max_tokens)
            finally:
                with self._cond:
                    self._prefilling -= 1
        finally:
            if self.flight is not None:
                self.flight.release(job.id)
        if job.retired:  # failed while it prefilled (the scheduler closed): its client has its answer
            return
        job.ttft_s = time.perf_counter() - job.submitted - gate_s
        if gate_s:  # the engine found the verdict this run recorded: the run was this request's
            report = replace(report, timings=replace(report.timings, gate_s=gate_s))
        job.first_logits, job.cache, job.report = first, cache, report
        job.stream = TokenStream(engine.tokenizer, engine.eos_ids, job.config)
        text = job.stream.step(first)
        self._emit(job, Event(EventKind.STARTED, text=text, report=report, ttft_s=job.ttft_s,
                              logprobs=job.stream.take_logprobs()))
        if self.refine is not None and self.refine.saw(job.prompt, job.policy, report):  # after the first token
            self.wake()  # an idle worker may take it
        if self.metrics is not None:
            self.metrics.on_prefill(report, job.ttft_s)
            self.metrics.on_tokens(job.stream.generated)
        if job.stream.finished:
            self._complete(job)
            return
        with self._cond:
            self._incoming.append(job)
            self._cond.notify_all()

    # ---- decode ---------------------------------------------------------------------------

    def _decode_loop(self) -> None:
        self._loop_threads.setup()
        batch: list[SchedulerJob] = []  # changed in place, so that a failed iteration knows whom to fail
        while True:
            try:
                if not self._decode_iteration(batch):
                    return
            except Exception as e:  # noqa: BLE001 - a bug here fails the batch, never the loop
                log.exception("decode loop iteration failed; its requests fail")
                for job in batch:
                    self._fail(job, e)
                batch.clear()

    def _decode_iteration(self, batch: list[SchedulerJob]) -> bool:
        """Wait for work, then run one prefill or one decode step (``batch`` is updated in place).

        Returns:
            False once the scheduler stops (the batch's requests failed).
        """
        job, joining = None, []
        with self._cond:
            self._cond.wait_for(lambda: not self._running or self._incoming or batch
                                or self._decode_loop_prefill_due())
            stopping = not self._running
            if not stopping:
                joining = list(self._incoming)
                batch.extend(joining)
                self._incoming.clear()
                if self._decode_loop_prefill_due() and (not batch or self._loop_share_allows()):
                    job = self._take_job()
        if stopping:  # retired (slot back to the pool, counted), not only told: _fail takes the lock itself
            for job in batch:
                self._fail(job, ShuttingDownError())
            batch.clear()
            return False
        if joining:  # before a prefill this iteration may run: the next iteration no longer knows them
            self._pool_joined(batch, joining)
        if job is not None:  # nothing to decode (or within its share) and every worker busy: prefill here
            self.decode_loop_prefills += 1
            self._loop_threads.for_prefill()
            t0 = time.perf_counter()
            self._run_prefill(job)
            self._loop_time.add(time.perf_counter() - t0, prefill=True)
            return True
        live = []
        for job in batch:
            if job.cancelled.is_set():
                self._retire(job, Ending.CANCELLED)
            else:
                live.append(job)
        batch[:] = live
        if batch:
            t0 = time.perf_counter()
            batch[:] = self._step(batch)
            self._loop_time.add(time.perf_counter() - t0, prefill=False)
        return True

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
                    self._fail(job, e)
        batch[:] = [j for j in batch if not j.retired]
        batch.sort(key=lambda j: j.cache.slot if isinstance(j.cache, PoolSlotCache) else pool.slots)

    def _step(self, batch: list[SchedulerJob]) -> list[SchedulerJob]:
        """One batched decode step; returns the jobs still decoding."""
        self._loop_threads.for_decode(self._prefilling)
        caches, tokens = [j.cache for j in batch], [j.stream.next_input for j in batch]
        share = None
        try:
            share = self.shares.offer(caches, tokens, self._worker_free)
            own = len(caches) - (share.step.b if share is not None else 0)
            with self._exclusive or nullcontext():
                logits = decode_batch(self.engine.runner, caches[:own], tokens[:own], self.config.batching)  # (m, V)
            if share is not None:
                logits = torch.cat([logits, self.shares.collect(share)])  # (B, V)
        except BaseException as e:  # noqa: BLE001 - fail this batch's requests, keep serving
            if share is not None:
                self.shares.abandon(share)
            log.exception("decode step failed")
            for job in batch:
                self._fail(job, e)
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
                self._fail(job, e)
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
            self._emit(job, Event(EventKind.TEXT, text=text, logprobs=job.stream.take_logprobs()))
        if job.stream.finished:
            self._complete(job)
            return False
        return True

    # ---- what may run now (read under ``_cond``; a worker running a share also asks between layers) ----

    def _prefill_due(self) -> bool:
        """A request waits for a prefill and a slot is free for it."""
        return bool(self._waiting) and self._active < self.config.max_concurrency

    def _decode_loop_prefill_due(self) -> bool:
        """The decode loop may take a prefill: allowed, one is due and no worker is free for it
        (the caller checks that there is nothing to decode, or that its prefill share allows one)."""
        return self.config.decode_loop_prefills and self._idle_workers == 0 and self._prefill_due()

    def _loop_share_allows(self) -> bool:
        """With sequences to decode, whether the decode loop may take a prefill: a share is set and
        prefills took less than it of the loop's recent time."""
        share = self.config.decode_loop_prefill_share
        return share is not None and self._loop_time.prefill_share() < share

    def _worker_free(self) -> bool:
        """A prefill worker is idle and no waiting request is about to take it: a share may be posted."""
        return self._idle_workers > 0 and not self._prefill_due()

    # ---- endings --------------------------------------------------------------------------

    def _complete(self, job: SchedulerJob) -> None:
        e2e = time.perf_counter() - job.submitted
        completion = job.stream.completion(job.prompt, job.first_logits, job.report, job.ttft_s, e2e)
        if self.metrics is not None:
            self.metrics.on_finish(e2e)
        self._retire(job, Ending.COMPLETED, e2e)
        self._emit(job, Event(EventKind.DONE, completion=completion, logprobs=job.stream.take_logprobs()))

    @staticmethod
    def _emit(job: SchedulerJob, event: Event) -> None:
        try:
            job.sink(event)
        except Exception:  # noqa: BLE001 - a consumer's bug must not stop the scheduler
            log.exception("request %d: event sink failed", job.id)

    def _fail(self, job: SchedulerJob, error: BaseException) -> None:
        if not self._retire(job, Ending.FAILED):  # it already ended; nothing more to tell its client
            log.error("request %d: error after it ended: %s", job.id, error)
            return
        if not isinstance(error, KVBlendError):
            log.error("request %d failed: %s: %s", job.id, type(error).__name__, error)
        self._emit(job, Event(EventKind.FAILED, error=error))

    def _retire(self, job: SchedulerJob, ending: Ending, e2e_s: float | None = None) -> bool:
        """Free an active request's slot and KV and count how it ended (under the lock: several
        threads retire requests).

        Returns:
            False when it had been retired already (nothing counted).
        """
        if self.pool is not None:
            self.pool.release(job.cache)  # a no-op for a cache that is not one of its slots
        job.cache = None  # frees the request's KV now, whoever still holds the job
        with self._cond:
            if job.retired:
                return False
            job.retired = True
            if ending is Ending.COMPLETED:
                self.completed += 1
                if e2e_s is not None:
                    self._e2e_ewma_s = 0.9 * self._e2e_ewma_s + 0.1 * e2e_s
            elif ending is Ending.FAILED:
                self.failed += 1
            else:
                self.cancelled += 1
            self._active -= 1
            self._gauges()
            self._cond.notify_all()
        return True
