"""Prometheus metrics of one server (its own registry, so several apps can live in one process).

    kvblend_requests_total{endpoint,status}     HTTP requests answered
    kvblend_ttft_seconds                         submit -> first token (queue wait included)
    kvblend_e2e_seconds                          submit -> last token
    kvblend_output_tokens_total                  generated tokens
    kvblend_output_tokens_per_second             over the last RATE_WINDOW_S seconds
    kvblend_prompt_tokens_total / _cached_tokens_total
    kvblend_segments_total{class}                prompt segments by reuse class
    kvblend_recomputed_fraction                  recomputed / reused document rows (blended requests)
    kvblend_guarded_requests_total               blended requests the near-tie guard recomputed
    kvblend_store_lookups_total{result}          store hits / misses / rejections
    kvblend_queue_depth, kvblend_active_requests, kvblend_decode_batch_size
    kvblend_decode_shared_steps_total            decode steps that ran part of their rows on an idle prefill worker
    kvblend_refined_orders_total / _segments_total   document orders (segments) an idle worker gave exact KV
    kvblend_refine_pending                       orders waiting for that
    kvblend_write_timeouts_total                 connections closed: their client took no bytes for --write-timeout
    kvblend_interrupted_prefills_total           prefills stopped between layers: their client left while they ran
"""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from blend.defaults import DEFAULT_RATIO
from blend.kvpool import KVBufferPool
from blend.report import ReuseReport
from blend.store.base import KVStore

RATE_WINDOW_S = 10.0
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
FRACTION_BUCKETS = tuple(sorted({0.0, 0.05, 0.1, DEFAULT_RATIO, 0.2, 0.3, 0.5, 0.75, 1.0}))  # the default ratio is an edge
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class _StoreCollector(Collector):
    """Store lookups, read from ``store.counters()`` at scrape time (never ``stats()``, which scans
    every entry file on disk and every key in Redis)."""

    def __init__(self, store: KVStore) -> None:
        self.store = store

    def collect(self):
        stats = self.store.counters()
        fam = CounterMetricFamily("kvblend_store_lookups", "KV store lookups by result", labels=["result"])
        fam.add_metric(["hit"], stats.hits)
        fam.add_metric(["miss"], stats.misses)
        fam.add_metric(["rejected"], stats.rejected)
        yield fam


class _KVPoolCollector(Collector):
    """The model's recycled KV buffers (:class:`~blend.kvpool.KVBufferPool`), read at scrape time."""

    def __init__(self, pool: KVBufferPool) -> None:
        self.pool = pool

    def collect(self):
        st = self.pool.stats()
        held = GaugeMetricFamily("kvblend_kv_pool_bytes", "KV buffers the model holds for the next requests' "
                                 "caches: free, or pending (given back while views of their rows live on)",
                                 labels=["state"])
        held.add_metric(["free"], st.free_bytes)
        held.add_metric(["pending"], st.pending_bytes)
        yield held
        taken = CounterMetricFamily("kvblend_kv_pool_buffers", "per-layer KV buffers handed to caches, by where "
                                    "they came from", labels=["source"])
        taken.add_metric(["reused"], st.reused)
        taken.add_metric(["allocated"], st.allocated)
        yield taken


class ServeMetrics:
    """The server's metrics.

    Args:
        store: the engine's store (its lookup counters are exported).
        kv_pool: the model's KV buffer pool (what it holds is exported).
    """

    def __init__(self, store: KVStore | None = None, kv_pool: KVBufferPool | None = None) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kvblend_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.ttft = Histogram("kvblend_ttft_seconds", "time to first token (queue wait included)",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("kvblend_e2e_seconds", "request submit to last token", buckets=LATENCY_BUCKETS,
                             registry=r)
        self.output_tokens = Counter("kvblend_output_tokens", "generated tokens", registry=r)
        self.prompt_tokens = Counter("kvblend_prompt_tokens", "prompt tokens prefilled", registry=r)
        self.cached_tokens = Counter("kvblend_cached_tokens", "prompt tokens whose KV came from the store",
                                     registry=r)
        self.segments = Counter("kvblend_segments", "prompt segments by reuse class", ["class"], registry=r)
        self.recomputed = Histogram("kvblend_recomputed_fraction", "recomputed / reused document rows per "
                                    "blended request", buckets=FRACTION_BUCKETS, registry=r)
        self.guarded = Counter("kvblend_guarded_requests", "blended requests the near-tie guard recomputed "
                               "(their first token was a near tie)", registry=r)
        self.queue_depth = Gauge("kvblend_queue_depth", "requests waiting for a slot", registry=r)
        self.active = Gauge("kvblend_active_requests", "requests prefilling or decoding", registry=r)
        self.batch = Histogram("kvblend_decode_batch_size", "sequences per decode step", buckets=BATCH_BUCKETS,
                               registry=r)
        self.shared_steps = Counter("kvblend_decode_shared_steps", "decode steps that ran part of their "
                                    "sequences on an idle prefill worker", registry=r)
        self.refined_orders = Counter("kvblend_refined_orders", "document orders whose exact KV an idle "
                                      "prefill worker completed (later blends of them are exact)", registry=r)
        self.refined_segments = Counter("kvblend_refined_segments", "segments an idle prefill worker computed "
                                        "for exact KV of blended document orders", registry=r)
        self.refine_pending = Gauge("kvblend_refine_pending", "document orders waiting for idle-time exact KV",
                                    registry=r)
        self.write_timeouts = Counter("kvblend_write_timeouts", "connections closed because their client took "
                                      "none of its response's bytes for the write timeout (it stopped reading)",
                                      registry=r)
        self.interrupted_prefills = Counter("kvblend_interrupted_prefills", "prefills stopped between layers "
                                            "because their request was cancelled (its client left) while they ran",
                                            registry=r)
        self.rate = Gauge("kvblend_output_tokens_per_second", f"generated tokens/s over the last {RATE_WINDOW_S:g} s",
                          registry=r)
        self.rate.set_function(self._tokens_per_s)
        self._recent: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()
        if store is not None:
            r.register(_StoreCollector(store))
        if kv_pool is not None:
            r.register(_KVPoolCollector(kv_pool))

    def _tokens_per_s(self) -> float:
        with self._lock:
            self._forget_old(time.monotonic())
            return sum(n for _, n in self._recent) / RATE_WINDOW_S

    def _forget_old(self, now: float) -> None:
        """Drop token counts older than the rate's window (the caller holds ``_lock``): on every
        count, not only at scrape time, so a server nobody scrapes keeps one window's worth."""
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
            self._recent.popleft()

    # ---- hooks (called from the scheduler's threads) ---------------------------------

    def on_prefill(self, report: ReuseReport, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)
        self.prompt_tokens.inc(report.prompt_tokens)
        self.cached_tokens.inc(report.reused_tokens)
        for seg in report.segments:
            self.segments.labels(seg.reuse_class.value).inc()
        if report.ratio is not None and report.reused_tokens:
            self.recomputed.observe(report.recomputed_tokens / report.reused_tokens)
        if report.guard:
            self.guarded.inc()

    def on_tokens(self, n: int) -> None:
        self.output_tokens.inc(n)
        with self._lock:
            now = time.monotonic()
            self._recent.append((now, n))
            self._forget_old(now)

    def on_batch(self, size: int) -> None:
        self.batch.observe(size)

    def on_finish(self, e2e_s: float) -> None:
        self.e2e.observe(e2e_s)

    def on_write_timeout(self) -> None:
        self.write_timeouts.inc()

    def on_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def exposition(self) -> bytes:
        """The Prometheus text format."""
        return generate_latest(self.registry)
