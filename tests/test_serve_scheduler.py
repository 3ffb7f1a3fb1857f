"""The scheduler: concurrent answers equal one-at-a-time ones, single-flight, prefill beside decode,
admission limits and cancellation (no HTTP here).

Tolerance: with DecodeBatching.INVARIANT every answer is bit-identical to the
same request run alone (tokens and the hash over every sampled-from logits
row); with THROUGHPUT the first-token logits are bit-identical (prefills are
not batched) and the tokens equal, decode logits agree within float rounding
(see test_batch_decode).
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
import torch

from _serve_util import (  # noqa: F401 - fixtures
    Collector, make_scheduler, one_torch_thread, tiny_serve_engine, wait_until,
)
from blend.batch_decode import DecodeBatching, decode_batch
from blend.errors import InvalidPolicyError
from blend.generation import generate
from blend.keys import Namespace
from blend.policy import ReusePolicy
from blend.sampling import GenerationConfig
from blend.serve.config import SchedulerConfig
from blend.serve.decode_share import ShareState, run_share, share_rows
from blend.serve.jobs import EventKind, QueueFullError
from blend.serve.scheduler import Scheduler
from blend.store.memory import MemoryStore
from conftest import make_docs

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class SlowStore(MemoryStore):
    """A memory store whose misses take ``delay`` seconds (a slow tier); counts puts per key."""

    def __init__(self, delay: float = 0.0) -> None:
        super().__init__()
        self.delay = delay
        self.puts: Counter = Counter()
        self.slow_window: list[tuple[float, float]] = []

    def get(self, ns, key, provenance):
        found = super().get(ns, key, provenance)
        if found.entry is None and self.delay:
            t0 = time.monotonic()
            time.sleep(self.delay)
            self.slow_window.append((t0, time.monotonic()))
        return found

    def put(self, ns, key, entry):
        self.puts[(ns, bytes(key))] += 1
        super().put(ns, key, entry)


def requests(engine, n: int):
    """Mixed requests: exact and blend, greedy and seeded sampling, different lengths and budgets."""
    out = []
    for i in range(n):
        prompt = engine.build_prompt(f"question {i}?", make_docs(2 + i % 2, words=12 + 5 * i, seed=i % 3))
        policy = ReusePolicy.blend(ratio=0.3) if i % 3 == 1 else ReusePolicy.exact()
        cfg = GenerationConfig(max_tokens=6 + 3 * i, temperature=0.0 if i % 2 == 0 else 0.8, seed=100 + i)
        out.append((prompt, policy, cfg))
    return out


@pytest.mark.parametrize("batching, threads", [
    (DecodeBatching.INVARIANT, {}),
    (DecodeBatching.THROUGHPUT, {}),
    (DecodeBatching.THROUGHPUT, {"torch_threads": 1, "idle_decode_threads": 2}),  # decode threads change
    (DecodeBatching.THROUGHPUT, {"share_decode_min_batch": 2, "prefill_workers": 1}),  # halves on a worker
    (DecodeBatching.THROUGHPUT, {"decode_pool_tokens": None}),  # every cache its own: attention per sequence
])
def test_concurrent_answers_equal_one_at_a_time(make_scheduler, batching, threads):
    engine = tiny_serve_engine()
    sharing = "share_decode_min_batch" in threads
    reqs = requests(engine, 7)
    if sharing:  # long enough that the batch is still full once every prefill is done
        reqs = [(p, pol, GenerationConfig(max_tokens=40, temperature=c.temperature, seed=c.seed, ignore_eos=True))
                for p, pol, c in reqs]
    threads = {"prefill_workers": 2, **threads}
    sched = make_scheduler(engine, batching=batching, **threads)
    col = Collector()
    for i, (p, pol, cfg) in enumerate(reqs):
        sched.submit(p, pol, cfg, col.sink(i))
    col.wait(len(reqs))
    assert (sched.shared_steps > 0) == sharing  # an idle prefill worker ran part of some steps
    for i, (p, pol, cfg) in enumerate(reqs):
        got = col.last(i).completion
        ref = generate(engine, p, pol, cfg, batching)
        assert got.logits_sha256() == ref.logits_sha256(), i
        assert got.token_ids == ref.token_ids, i
        assert got.text == "".join(ev.text for _, ev in col.events[i]), i  # the streamed pieces add up
        if batching is DecodeBatching.INVARIANT:
            assert got.steps_sha256 == ref.steps_sha256, i
    assert sched.steps < sum(cfg.max_tokens for _, _, cfg in reqs)  # decode steps were shared
    pooled = batching is DecodeBatching.THROUGHPUT and threads.get("decode_pool_tokens", 1) is not None
    assert (sched.pool is not None) == pooled
    if pooled:  # the sequences decoded from pool slots, and every slot came back
        assert sched.pool.adopted >= len(reqs) - 1 and sched.pool.free_slots == sched.pool.slots


def _prefilled(engine, n: int):
    caches, toks = [], []
    for i in range(n):
        logits, cache, _ = engine.prefill(engine.build_prompt(f"q{i}?", make_docs(1 + i % 2, seed=i)),
                                          ReusePolicy.exact(), 4)
        caches.append(cache)
        toks.append(int(logits.argmax()))
    return caches, toks


def test_share_sizes_keep_each_modes_promise():
    engine = tiny_serve_engine()
    through = Scheduler(engine, SchedulerConfig(share_decode_min_batch=4))
    assert [through.shares.rows(b) for b in (1, 3, 4, 5, 16)] == [0, 0, 2, 2, 8]  # halves
    inv = Scheduler(engine, SchedulerConfig(share_decode_min_batch=4, batching=DecodeBatching.INVARIANT))
    # whole 16-row tiles only (rows padded to tiles keep their numbers wherever they run)
    assert [inv.shares.rows(b) for b in (4, 16, 31, 32, 40, 64)] == [0, 0, 0, 16, 16, 32]
    assert Scheduler(engine, SchedulerConfig(share_decode_min_batch=None)).shares.rows(16) == 0
    assert Scheduler(engine, SchedulerConfig(torch_threads=1, idle_decode_threads=2)).shares.rows(16) == 0
    assert share_rows(SchedulerConfig(share_decode_min_batch=4), 16, exclusive=True) == 0  # dynamic RoPE: never
    with pytest.raises(ValueError, match="share_decode_min_batch"):
        SchedulerConfig(share_decode_min_batch=1)


def test_a_share_no_worker_takes_runs_on_the_decode_loop():
    engine = tiny_serve_engine()
    sched = Scheduler(engine, SchedulerConfig(share_decode_min_batch=2))  # not started: no worker will come
    caches, toks = _prefilled(engine, 5)
    ref_caches, _ = _prefilled(engine, 5)
    assert sched.shares.offer(caches, toks, sched.book.worker_free) is None  # no idle worker: nothing is posted
    sched.book.idle_workers = 1
    share = sched.shares.offer(caches, toks, sched.book.worker_free)
    assert share is not None and share.step.b == 2 and share.step.caches == caches[3:]
    got = sched.shares.collect(share)  # nobody took it: the decode loop runs it itself
    assert torch.equal(got, decode_batch(engine.runner, ref_caches[3:], toks[3:]))
    assert sched.shared_steps == 0 and sched.shares.posted is None
    assert sched.shares.offer(caches[:1], toks[:1], sched.book.worker_free) is None  # below the minimum batch


def test_a_failed_step_drops_its_posted_share():
    engine = tiny_serve_engine()
    sched = Scheduler(engine, SchedulerConfig(share_decode_min_batch=2))
    caches, toks = _prefilled(engine, 4)
    sched.book.idle_workers = 1
    share = sched.shares.offer(caches, toks, sched.book.worker_free)
    lengths = [c.length for c in caches]
    sched.shares.abandon(share)  # the decode loop's own rows failed before anyone took the share
    assert share.done.is_set() and share.state is ShareState.DONE and share.logits is None
    assert sched.shares.posted is None and not sched.shares.pending()
    assert [c.length for c in caches] == lengths  # nothing ran on the failed batch's caches


def test_a_worker_hands_a_share_back_between_layers_when_a_prefill_arrives():
    engine = tiny_serve_engine()
    sched = Scheduler(engine, SchedulerConfig(share_decode_min_batch=2))
    caches, toks = _prefilled(engine, 4)
    ref_caches, _ = _prefilled(engine, 4)
    sched.book.idle_workers = 1
    share = sched.shares.offer(caches, toks, sched.book.worker_free)
    share.state, share.by_worker = ShareState.TAKEN, True  # as a worker takes it
    advance = share.step.advance

    def then_a_request_arrives():
        more = advance()
        sched.book.waiting.append(object())  # a request now waits for its prefill
        return more

    share.step.advance = then_a_request_arrives
    run_share(share, sched.book.prefill_due)  # the worker's side
    assert share.state is ShareState.RETURNED and share.step.layer == 1  # stopped after one layer
    sched.book.waiting.clear()
    got = sched.shares.collect(share)  # the decode loop finishes the other layers
    assert torch.equal(got, decode_batch(engine.runner, ref_caches[2:], toks[2:]))  # the same bits
    assert sched.returned_shares == 1 and sched.shared_steps == 1
    assert [c.length for c in caches[2:]] == [c.length for c in ref_caches[2:]]


def test_a_failing_share_fails_its_batch_and_serving_goes_on(make_scheduler, monkeypatch):
    from blend.batch_decode import DecodeStep

    real = DecodeStep.advance

    def on_worker_fails(self):
        if threading.current_thread().name.startswith("kvblend-prefill"):
            raise RuntimeError("share failed")
        return real(self)

    monkeypatch.setattr(DecodeStep, "advance", on_worker_fails)
    engine = tiny_serve_engine()
    sched = make_scheduler(engine, share_decode_min_batch=2)
    col = Collector()
    for i in range(3):
        sched.submit(engine.build_prompt(f"q{i}?", make_docs(1, seed=i)), ReusePolicy.exact(),
                     GenerationConfig(max_tokens=200, ignore_eos=True), col.sink(i))
    col.wait(3)
    failed = [i for i in range(3) if col.last(i).kind is EventKind.FAILED]
    assert failed and all("share failed" in str(col.last(i).error) for i in failed)
    monkeypatch.setattr(DecodeStep, "advance", real)
    sched.submit(engine.build_prompt("q?", make_docs(1)), ReusePolicy.exact(), GenerationConfig(max_tokens=3),
                 col.sink(9))
    col.wait(4)
    assert col.last(9).kind is EventKind.DONE
    wait_until(lambda: sched.active == 0)


@pytest.mark.parametrize("single_flight", [True, False])
def test_single_flight_computes_a_shared_missing_chunk_once(make_scheduler, single_flight):
    store = SlowStore(delay=0.3)  # every miss is slow, so both requests are in flight together
    engine = tiny_serve_engine(store=store)
    docs = make_docs(2, seed=7)
    reqs = [(engine.build_prompt(q, docs), ReusePolicy.blend(ratio=0.2), GenerationConfig(max_tokens=3))
            for q in ("first question?", "second question?")]
    sched = make_scheduler(engine, prefill_workers=2, single_flight=single_flight)
    col = Collector()
    for i, (p, pol, cfg) in enumerate(reqs):
        sched.submit(p, pol, cfg, col.sink(i))
    col.wait(2)
    canonical = [n for (ns, _), n in store.puts.items() if ns is Namespace.CANONICAL]
    assert len(canonical) == 2  # two documents
    if single_flight:
        assert canonical == [1, 1]  # each computed once: the other request waited for it
        assert engine.store.waited >= 1
        assert engine.store.claimed() == 0
    else:
        assert canonical == [2, 2]  # the race the claims prevent
    for i, (p, pol, cfg) in enumerate(reqs):  # and nobody's answer changed
        assert col.last(i).completion.logits_sha256() == generate(engine, p, pol, cfg).logits_sha256()


def test_a_request_cancelled_while_it_waits_for_a_shared_chunk_is_never_prefilled(make_scheduler):
    store = SlowStore(delay=0.3)  # the first request's misses hold its claims for a while
    engine = tiny_serve_engine(store=store)
    prefills = []
    real = engine.prefill
    engine.prefill = lambda *a, **kw: (prefills.append(a[0]), real(*a, **kw))[1]
    docs = make_docs(2, seed=11)
    sched = make_scheduler(engine, prefill_workers=2, single_flight=True)
    col = Collector()
    first = engine.build_prompt("first?", docs)
    sched.submit(first, ReusePolicy.blend(ratio=0.2), GenerationConfig(max_tokens=2), col.sink(0))
    wait_until(lambda: engine.store.claimed() > 0)
    ticket = sched.submit(engine.build_prompt("second?", docs), ReusePolicy.blend(ratio=0.2),
                          GenerationConfig(max_tokens=2), col.sink(1))
    wait_until(lambda: engine.store.waited >= 1)  # the second waits for the first's chunks
    ticket.cancel()
    col.wait(0)
    wait_until(lambda: sched.active == 0)
    assert prefills == [first]  # its client was gone before its turn: no prefill for nobody
    assert sched.cancelled == 1


def test_a_cancelled_wait_for_a_shared_chunk_ends_at_once():
    """A cancelled request waiting on another's chunk held its prefill worker for up to flight_timeout_s (60 s)."""
    from blend.serve.flight import FlightStore

    store = FlightStore(MemoryStore())
    key = (Namespace.CANONICAL, bytes(range(32)))
    assert store.claim(1, [key]) == [] and store.claim(2, [key]) == [key]
    stop, got = threading.Event(), []
    waiter = threading.Thread(target=lambda: got.append(store.wait([key], 30.0, stop)))
    waiter.start()
    wait_until(lambda: store.waited == 1)
    t0 = time.monotonic()
    stop.set()
    store.wake()
    waiter.join(5)
    assert got == [False] and time.monotonic() - t0 < 1.0
    store.release(1)
    assert store.wait([key], 0.1, threading.Event())  # released: free, not stopped


def test_a_long_prefill_does_not_stall_other_streams(make_scheduler):
    store = SlowStore()
    engine = tiny_serve_engine(store=store)
    sched = make_scheduler(engine)
    col = Collector()
    streaming = engine.build_prompt("long answer?", make_docs(1))
    ticket = sched.submit(streaming, ReusePolicy.exact(), GenerationConfig(max_tokens=3000, ignore_eos=True),
                          col.sink(0))
    wait_until(lambda: sched.steps >= 5)
    store.delay = 0.5  # the next request's store misses take 0.5 s each
    steps_before = sched.steps
    sched.submit(engine.build_prompt("other?", make_docs(2, seed=9)), ReusePolicy.exact(),
                 GenerationConfig(max_tokens=2), col.sink(1))
    col.wait(1)
    assert 1 in col.events and col.last(1).kind is EventKind.DONE
    (t0, _), (_, t1) = store.slow_window[0], store.slow_window[-1]
    during = [t for t, ev in col.events[0] if t0 <= t <= t1]
    assert t1 - t0 >= 0.5 and sched.steps - steps_before >= 20
    assert len(during) >= 10  # request 0 kept streaming while request 1 prefilled
    ticket.cancel()


class ThreadsStore(SlowStore):
    """A slow store that records which scheduler threads looked things up."""

    def __init__(self, delay: float) -> None:
        super().__init__(delay)
        self.threads: set[str] = set()

    def get(self, ns, key, provenance):
        self.threads.add(threading.current_thread().name)
        return super().get(ns, key, provenance)


@pytest.mark.parametrize("allowed, threads", [
    (True, {}), (False, {}),
    (True, {"torch_threads": 1, "idle_decode_threads": 2}),  # its prefills run at the workers' count
])
def test_an_idle_decode_loop_prefills_a_burst_beside_the_worker(make_scheduler, allowed, threads):
    store = ThreadsStore(delay=0.2)  # misses are slow: the burst's prefills overlap if two threads run them
    engine = tiny_serve_engine(store=store)
    sched = make_scheduler(engine, prefill_workers=1, decode_loop_prefills=allowed, **threads)
    col = Collector()
    reqs = [(engine.build_prompt(f"burst {i}?", make_docs(2, seed=40 + i)), ReusePolicy.exact(),
             GenerationConfig(max_tokens=3)) for i in range(4)]
    for i, (p, pol, cfg) in enumerate(reqs):
        sched.submit(p, pol, cfg, col.sink(i))
    col.wait(len(reqs))
    assert all(col.last(i).kind is EventKind.DONE for i in range(len(reqs)))
    assert ("kvblend-decode" in store.threads) == allowed
    assert (sched.decode_loop_prefills > 0) == allowed
    for i, (p, pol, cfg) in enumerate(reqs):  # the same answers wherever the prefill ran
        assert col.last(i).completion.logits_sha256() == generate(engine, p, pol, cfg).logits_sha256()


@pytest.mark.parametrize("share", [None, 0.5])
def test_with_a_prefill_share_the_decode_loop_prefills_beside_a_decoding_batch(make_scheduler, share):
    """A long answer decodes while a queue of slow prefills waits: only with a share does the decode
    loop take some of them (every worker busy), and the answers are the same wherever they ran."""
    store = ThreadsStore(delay=0.0)
    engine = tiny_serve_engine(store=store)
    sched = make_scheduler(engine, prefill_workers=1, decode_loop_prefill_share=share)
    col = Collector()
    ticket = sched.submit(engine.build_prompt("long answer?", make_docs(1)), ReusePolicy.exact(),
                          GenerationConfig(max_tokens=3000, ignore_eos=True), col.sink(99))
    wait_until(lambda: sched.steps >= 5)
    store.delay = 0.15  # the queue's store misses are slow, so the worker stays busy
    reqs = [(engine.build_prompt(f"queued {i}?", make_docs(2, seed=60 + i)), ReusePolicy.exact(),
             GenerationConfig(max_tokens=2)) for i in range(4)]
    for i, (p, pol, cfg) in enumerate(reqs):
        sched.submit(p, pol, cfg, col.sink(i))
    col.wait(len(reqs))
    assert (sched.decode_loop_prefills > 0) == (share is not None)
    assert ("kvblend-decode" in store.threads) == (share is not None)
    assert col.last(99).kind is EventKind.TEXT  # still streaming
    ticket.cancel()
    for i, (p, pol, cfg) in enumerate(reqs):
        assert col.last(i).completion.logits_sha256() == generate(engine, p, pol, cfg).logits_sha256()
    # every request that joined the batch was moved into the decode pool, also in an iteration where the
    # loop then ran a prefill (those were never adopted: their steps ran attention per sequence)
    assert sched.pool is None or sched.pool.adopted == len(reqs) + 1


def test_the_loop_time_window_measures_the_prefill_share():
    from blend.serve.decode_share import LoopTime

    for bad in ({"decode_loop_prefill_share": 0.0}, {"decode_loop_prefill_share": 1.5},
                {"decode_loop_prefill_share": 0.5, "decode_loop_prefills": False}):
        with pytest.raises(ValueError, match="decode_loop_prefill_share"):
            SchedulerConfig(**bad)

    lt = LoopTime(window_s=60.0)
    assert lt.prefill_share() == 0.0
    lt.add(0.3, prefill=True)
    lt.add(0.1, prefill=False)
    assert lt.prefill_share() == pytest.approx(0.75)
    old = LoopTime(window_s=0.0)  # events older than the window drop out
    old.add(1.0, prefill=True)
    time.sleep(0.01)
    old.add(0.1, prefill=False)
    assert old.prefill_share() == 0.0


def test_queue_full_is_refused_with_a_retry_hint(make_scheduler):
    store = SlowStore(delay=0.5)
    engine = tiny_serve_engine(store=store)
    sched = make_scheduler(engine, max_concurrency=1, max_queue=1)
    col = Collector()
    prompt = engine.build_prompt("q?", make_docs(1))
    sched.submit(prompt, ReusePolicy.exact(), GenerationConfig(max_tokens=2), col.sink(0))
    sched.submit(prompt, ReusePolicy.exact(), GenerationConfig(max_tokens=2), col.sink(1))
    with pytest.raises(QueueFullError, match="max_queue=1") as exc:
        sched.submit(prompt, ReusePolicy.exact(), GenerationConfig(max_tokens=2), col.sink(2))
    assert exc.value.retry_after_s >= 1
    col.wait(2)
    assert sched.active == 0 and sched.queue_depth == 0


def test_cancel_leaves_the_batch_and_frees_the_slot(make_scheduler):
    engine = tiny_serve_engine()
    sched = make_scheduler(engine)
    col = Collector()
    ticket = sched.submit(engine.build_prompt("q?", make_docs(1)), ReusePolicy.exact(),
                          GenerationConfig(max_tokens=1000), col.sink(0))
    wait_until(lambda: sched.steps >= 3)
    ticket.cancel()
    wait_until(lambda: not sched.active)
    assert sched.active == 0 and sched.cancelled == 1
    assert all(ev.kind is not EventKind.DONE for _, ev in col.events[0])
    assert sched.steps < 900


def test_a_failing_request_does_not_stop_the_scheduler(make_scheduler):
    engine = tiny_serve_engine()
    sched = make_scheduler(engine)
    col = Collector()
    prompt = engine.build_prompt("q?", make_docs(2))
    sched.submit(prompt, ReusePolicy.blend(check_layers=(99,)), GenerationConfig(max_tokens=2), col.sink(0))
    col.wait(1)
    assert col.last(0).kind is EventKind.FAILED and isinstance(col.last(0).error, InvalidPolicyError)
    sched.submit(prompt, ReusePolicy.exact(), GenerationConfig(max_tokens=2), col.sink(1))
    col.wait(2)
    assert col.last(1).kind is EventKind.DONE and sched.active == 0


def test_batch_invariant_decoding_refuses_a_changing_thread_count():
    # INVARIANT promises bit-identical answers; a different thread count may change GEMM rounding.
    with pytest.raises(ValueError, match="batch-invariant"):
        SchedulerConfig(batching=DecodeBatching.INVARIANT, torch_threads=1, idle_decode_threads=2)
    assert SchedulerConfig(batching=DecodeBatching.THROUGHPUT, torch_threads=1, idle_decode_threads=2)


def test_a_request_still_prefilling_when_the_scheduler_closes_fails_and_does_not_hang(make_scheduler):
    """close() took its snapshot of the queues while the prefill ran; the prefill then queued the request
    for the decode loop, which nothing read after shutdown: no FAILED event, ever."""
    engine = tiny_serve_engine()
    real = engine.prefill

    def slow(*a, **kw):
        time.sleep(0.8)
        return real(*a, **kw)

    engine.prefill = slow
    sched = make_scheduler(engine, torch_threads=1)
    col = Collector()
    sched.submit(engine.build_prompt("q?", make_docs(1)), ReusePolicy.exact(), GenerationConfig(max_tokens=5),
                 col.sink(0))
    wait_until(lambda: sched.active >= 1)  # prefilling now
    time.sleep(0.2)
    sched.close()
    assert col.last(0).kind is EventKind.FAILED


def test_the_decode_loops_thread_count_follows_prefills_and_its_mode():
    from blend.serve.loop_threads import LoopThreads

    before = torch.get_num_threads()
    try:
        loop = LoopThreads(SchedulerConfig(torch_threads=1, idle_decode_threads=2))
        loop.setup()
        assert (loop.current, torch.get_num_threads()) == (1, 1)
        loop.for_decode(prefilling=0)  # no prefill running: every core
        assert (loop.current, torch.get_num_threads()) == (2, 2)
        loop.for_decode(prefilling=1)  # a worker prefills: the loop's own share
        assert (loop.current, torch.get_num_threads()) == (1, 1)
        loop.for_decode(prefilling=0)
        loop.for_prefill()  # a prefill's numbers depend on its thread count: the workers' count
        assert (loop.current, torch.get_num_threads()) == (1, 1)
        fixed = LoopThreads(SchedulerConfig(torch_threads=1))  # no idle count: decode steps never change it
        fixed.setup()
        fixed.for_decode(prefilling=0)
        assert fixed.current == 1
        untouched = LoopThreads(SchedulerConfig())  # torch's default count, never set
        untouched.setup()
        untouched.for_decode(prefilling=0)
        untouched.for_prefill()
        assert untouched.current is None
    finally:
        torch.set_num_threads(before)


def test_close_retires_the_decoding_requests_and_gives_their_slots_back(make_scheduler):
    """close() told decoding requests they failed but never retired them: their pool slots stayed taken,
    ``active`` stayed up and ``failed`` did not count them."""
    engine = tiny_serve_engine()
    sched = make_scheduler(engine, prefill_workers=1, torch_threads=1, max_concurrency=4)
    col = Collector()
    for i in range(3):
        sched.submit(engine.build_prompt(f"q{i}?", make_docs(1, seed=i)), ReusePolicy.exact(),
                     GenerationConfig(max_tokens=3000, ignore_eos=True), col.sink(i))
    wait_until(lambda: sched.steps > 20 and sched.pool.free_slots == 1)  # three sequences decode from slots
    sched.close()
    col.wait(3)
    assert [col.last(i).kind for i in range(3)] == [EventKind.FAILED] * 3
    assert sum(1 for i in range(3) for _, ev in col.events[i] if ev.kind is EventKind.FAILED) == 3  # one each
    assert sched.active == 0  # was 3
    assert sched.failed == 3  # was 0
    assert sched.pool.free_slots == sched.pool.slots  # was 1 of 4
