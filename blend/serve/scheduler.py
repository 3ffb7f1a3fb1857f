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

The pieces: the requests (who waits, who runs, how each ended) and the threads'
shared counts are a :class:`~blend.serve.request_book.RequestBook`; the decode loop
(its batch, decode shares an idle worker runs, the prefills it takes itself, its
thread count) is a :class:`~blend.serve.decode_loop.DecodeLoop`. This module starts
and stops the threads, admits requests and runs the prefill workers.

Threads: each prefill worker runs torch with its own intra-op thread count
(``torch_threads``: the cores divided among the workers and the decode loop, so
they never oversubscribe); prefills keep it fixed (their logits are the ones
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

import logging
import threading
import time
from contextlib import nullcontext

import torch

from blend.batch_decode import DecodeBatching
from blend.cancel import PrefillCancelled, cancellable
from blend.decode_pool import DecodePool
from blend.generation import TokenStream
from blend.policy import ReusePolicy
from blend.prefix_fill import PrefixFill
from blend.prompt import Prompt
from blend.refusals import refusal_for
from blend.sampling import GenerationConfig
from blend.serve.config import SchedulerConfig
from blend.serve.decode_loop import DecodeLoop
from blend.serve.decode_share import ShareDesk, run_share
from blend.serve.flight import FlightStore, request_keys
from blend.serve.jobs import Ending, Event, EventKind, SchedulerJob, ShuttingDownError, Sink, Ticket
from blend.serve.loop_threads import set_worker_threads
from blend.serve.metrics import ServeMetrics
from blend.serve.refine import RefineQueue
from blend.serve.request_book import RequestBook

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
        self._closing = threading.Lock()  # one close at a time (a shutdown deadline's and the lifespan's)
        self._threads: list[threading.Thread] = []
        # dynamic-NTK RoPE tables are rebuilt per call length (shared state): no overlap then
        self._exclusive = threading.Lock() if engine.runner.rope.dynamic else None
        self._gate_lock = threading.Lock()
        self.pool = self._make_pool()  # decoding sequences' caches (None: each keeps its own)
        self.book = RequestBook(self.config, metrics, self.pool)
        self.shares = ShareDesk(self.book.cond, engine.runner, self.config, self._exclusive is not None, metrics)
        self.decoder = DecodeLoop(self.book, self.shares, engine.runner, self.config, metrics, self.pool,
                                  self._exclusive, self._run_prefill)
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
        if self.book.running:
            return
        runner = self.engine.runner
        if not runner.rope.dynamic:  # grow the RoPE tables once, before threads share them
            runner.rope(torch.tensor([runner.dims.max_positions - 1]))
        self.book.running = True
        for i in range(self.config.prefill_workers):
            self._threads.append(threading.Thread(target=self._prefill_loop, name=f"kvblend-prefill-{i}", daemon=True))
        self._threads.append(threading.Thread(target=self.decoder.run, name="kvblend-decode", daemon=True))
        for t in self._threads:
            t.start()

    def drain(self) -> None:
        """Take no new request (``submit`` raises ShuttingDownError) and fail the queued ones now: they have
        not started, so a 503 at once lets a client or a balancer retry elsewhere instead of waiting out a
        stopping server's grace period. Running requests go on (:meth:`close` ends them)."""
        self.book.drain()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the threads; requests still queued or running fail."""
        with self._closing:
            self._close(timeout)

    def _close(self, timeout: float) -> None:
        book = self.book
        with book.cond:
            prefilling = list(book.prefilling_jobs)
        for job in prefilling:  # its client gets the 503 now; its prefill stops at its next layer
            job.cancelled.set()
            book.fail(job, ShuttingDownError())
        waiting, incoming = book.stop()
        if self.flight is not None:  # a prefill waiting on another request's chunk stops waiting
            self.flight.wake()
        for t in self._threads:
            t.join(timeout)
        self._threads.clear()
        incoming += book.take_incoming()  # a prefill that was running finished into the queue after stop()
        for job in waiting:
            book.emit(job, Event(EventKind.FAILED, error=ShuttingDownError()))
        for job in incoming:  # prefilled, active: retired (cache freed, counted); one failed already: no 2nd event
            book.fail(job, ShuttingDownError())

    def wake(self) -> None:
        with self.book.cond:
            self.book.cond.notify_all()

    def cancel(self, job: SchedulerJob) -> None:
        """Cancel a request: if it still waits for a prefill it leaves the queue now and is retired
        as cancelled (no event: its client is gone); otherwise its thread drops it at the next check.

        Args:
            job: the request (a :class:`Ticket`'s).
        """
        self.book.cancel(job)
        if self.flight is not None:  # a prefill waiting on another request's chunk stops waiting
            self.flight.wake()

    def dead_threads(self) -> list[str]:
        """Names of the scheduler's threads that stopped while it runs (none while it is healthy).

        Returns:
            Thread names, empty when every prefill worker and the decode loop is alive (or the
            scheduler is not running).
        """
        if not self.book.running:
            return []
        return [t.name for t in list(self._threads) if not t.is_alive()]

    # ---- state ----------------------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        return len(self.book.waiting)

    @property
    def active(self) -> int:
        return self.book.active

    @property
    def completed(self) -> int:
        return self.book.completed

    @property
    def cancelled(self) -> int:
        return self.book.cancelled

    @property
    def interrupted_prefills(self) -> int:
        """Prefills stopped between layers because their request was cancelled while they ran."""
        return self.book.interrupted

    @property
    def failed(self) -> int:
        return self.book.failed

    @property
    def steps(self) -> int:
        """Decode steps the decode loop ran."""
        return self.decoder.steps

    @property
    def decode_loop_prefills(self) -> int:
        """Prefills the decode loop ran (idle, or within its prefill share)."""
        return self.decoder.prefills

    @property
    def shared_steps(self) -> int:
        """Decode steps whose share a prefill worker ran (in whole or in part)."""
        return self.shares.shared_steps

    @property
    def returned_shares(self) -> int:
        """Shares a worker handed back between layers for a prefill."""
        return self.shares.returned

    def retry_after_s(self) -> int:
        """Seconds until a slot is likely free (at least 1)."""
        return self.book.retry_after_s()

    # ---- submit ---------------------------------------------------------------------------

    def submit(self, prompt: Prompt, policy: ReusePolicy, config: GenerationConfig, sink: Sink) -> Ticket:
        """Queue a request; its events go to ``sink``.

        Raises:
            QueueFullError: no slot and no queue place.
            ShuttingDownError: the scheduler is not running.
        """
        return Ticket(self.book.admit(prompt, policy, config, sink), self.cancel)

    # ---- prefill --------------------------------------------------------------------------

    def _prefill_loop(self) -> None:
        set_worker_threads(self.config)
        book = self.book
        while True:
            share = job = fill = None
            with book.cond:
                book.idle_workers += 1
                book.cond.wait_for(lambda: not book.running or self.shares.pending() or book.prefill_due()
                                   or self._refine_due())
                book.idle_workers -= 1
                if not book.running:
                    return
                if book.prefill_due():  # prefills first
                    job = book.take()
                elif self.shares.pending():  # then the decode step's share
                    share = self.shares.take()
                else:  # then one segment of an order's exact KV
                    fill = self.refine.take()
            try:
                if share is not None:  # a worker stops between layers when a request waits for a prefill
                    run_share(share, book.prefill_due)
                elif job is not None:
                    self._run_prefill(job)
                elif fill is not None:
                    self._run_refine(fill)
            except Exception:  # noqa: BLE001 - each of them handles its own errors; a bug must not stop the worker
                log.exception("prefill worker iteration failed")

    def _refine_due(self) -> bool:
        """An order waits for refinement (and no request for a prefill)."""
        return (self.refine is not None and self.refine.pending > 0 and not self.book.prefill_due()
                and not self.book.draining)  # a stopping server leaves the cores to the requests it finishes

    def _run_refine(self, fill: PrefixFill) -> None:
        """One step of a :class:`~blend.prefix_fill.PrefixFill` on this idle worker; never raises."""
        computed_before, failed = fill.computed, False
        with self.book.prefill_running():
            try:
                with self._exclusive or nullcontext():
                    fill.step()
            except BaseException:  # noqa: BLE001 - a failed fill is dropped; serving goes on
                log.exception("refinement of a document order failed; dropped")
                failed = True
        computed = fill.computed - computed_before
        if self.metrics is not None:  # before put_back, which publishes the fill's outcome
            self.metrics.refined_segments.inc(computed)
            if fill.done and not failed and fill.computed:  # an order found stored already gained nothing
                self.metrics.refined_orders.inc()
        self.refine.put_back(fill, computed, failed)

    def _run_prefill(self, job: SchedulerJob) -> None:
        """A request's prefill and first token (on a worker, or on the decode loop); never raises."""
        book = self.book
        with book.cond:
            book.prefilling_jobs.add(job)
        try:
            self._prefill(job)
        except BaseException as e:  # noqa: BLE001 - a failed request must not kill the thread
            book.fail(job, e)
        finally:
            with book.cond:
                book.prefilling_jobs.discard(job)

    def _prefill(self, job: SchedulerJob) -> None:
        book, engine = self.book, self.engine
        if job.cancelled.is_set():
            book.retire(job, Ending.CANCELLED)
            return
        try:
            if self.flight is not None:
                busy = self.flight.claim(job.id, request_keys(engine, job.prompt, job.policy))
                self.flight.wait(busy, self.config.flight_timeout_s, job.cancelled)
                if job.cancelled.is_set():  # its client left while it waited: no prefill for nobody
                    book.retire(job, Ending.CANCELLED)
                    return
            # decided once, before the prefill: the first blend request the gate decides runs its first run here,
            # holding no prefill slot and never cancelled half-way; not its TTFT, said in its report (gate_s)
            refusal = refusal_for(engine, job.prompt, job.policy, self._gate_lock)
            # a request cancelled while it prefills (its client left, the server closes) stops at the next layer
            with book.prefill_running(), self._exclusive or nullcontext(), cancellable(job.cancelled):
                first, cache, report = engine.prefill(job.prompt, job.policy, job.config.max_tokens, refusal=refusal)
        except PrefillCancelled:  # its cache goes with it; the segments it finished are stored, complete
            book.interrupted_prefill()  # (retired below, once its claims are released, as cancelled)
            if self.metrics is not None:
                self.metrics.interrupted_prefills.inc()
        finally:
            if self.flight is not None:
                self.flight.release(job.id)
        if job.retired:  # failed while it prefilled (the scheduler closed): its client has its answer
            return
        if job.cancelled.is_set():  # its client left while it prefilled: nobody to answer; its KV is freed now,
            book.retire(job, Ending.CANCELLED)  # not copied into a decode-pool slot first (nor a 1-token answer done)
            return
        job.ttft_s = time.perf_counter() - job.submitted - refusal.gate_s
        job.first_logits, job.cache, job.report = first, cache, report
        job.stream = TokenStream(engine.tokenizer, engine.eos_ids, job.config)
        text = job.stream.step(first)
        book.emit(job, Event(EventKind.STARTED, text=text, report=report, ttft_s=job.ttft_s,
                             logprobs=job.stream.take_logprobs()))
        if self.refine is not None and self.refine.saw(job.prompt, job.policy, report):  # after the first token
            self.wake()  # an idle worker may take it
        if self.metrics is not None:
            self.metrics.on_prefill(report, job.ttft_s)
            self.metrics.on_tokens(job.stream.generated)
        if job.stream.finished:
            book.complete(job)
            return
        with book.cond:
            book.incoming.append(job)
            book.cond.notify_all()
