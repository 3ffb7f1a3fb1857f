"""Idle-time refinement: a document order that blends keep seeing gets its exact KV, a segment at
a time, after which a blend of that order is the exact path bit for bit (blend.prefix_fill,
blend.serve.refine, the scheduler's idle workers)."""

from __future__ import annotations

import threading

import pytest
import torch

from _serve_util import (  # noqa: F401 - fixtures
    Collector, make_scheduler, one_torch_thread, tiny_serve_engine, wait_until,
)
from blend.policy import ReusePolicy
from blend.prefix_fill import PrefixFill, order_segments
from blend.prompt import SegmentKind
from blend.report import ReuseClass
from blend.sampling import GenerationConfig
from blend.serve.config import SchedulerConfig
from blend.serve.jobs import EventKind
from blend.serve.scheduler import Scheduler
from conftest import make_docs, unguarded_blend

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _doc_classes(report) -> list[ReuseClass]:
    return [s.reuse_class for s in report.segments if s.kind is SegmentKind.DOCUMENT]


def test_a_fill_computes_one_segment_per_step_and_makes_the_blend_exact():
    engine = tiny_serve_engine()
    prompt = engine.build_prompt("where is it?", make_docs(4, words=30, seed=3))
    blend = unguarded_blend(ratio=0.2, take_exact=True)
    engine.precompute(prompt, blend)  # preamble and canonical chunks stored
    _, _, first = engine.prefill(prompt, blend)
    assert _doc_classes(first)[0] is ReuseClass.EXACT  # document 1 at its canonical place
    assert ReuseClass.EXACT not in _doc_classes(first)[1:]  # documents 2-4 blended
    fill = PrefixFill(engine.segments, order_segments(prompt))
    steps = 0
    while not fill.step():
        steps += 1
        assert fill.computed == steps  # one segment computed per unfinished step
    assert fill.computed == 3  # documents 2-4: preamble and document 1 were stored (canonical)
    assert PrefixFill(engine.segments, order_segments(prompt)).run() == 0  # all stored now
    logits, _, report = engine.prefill(prompt, blend)
    assert _doc_classes(report) == [ReuseClass.EXACT] * 4
    ref, _, _ = engine.prefill(prompt, ReusePolicy.none())  # no reuse: the cold exact program
    assert torch.equal(logits, ref)


def test_a_fill_under_a_salt_is_found_only_with_that_salt():
    engine = tiny_serve_engine()
    prompt = engine.build_prompt("who?", make_docs(3, words=20, seed=5))
    PrefixFill(engine.segments, order_segments(prompt), salt="tenant-a").run()
    _, _, mine = engine.prefill(prompt, unguarded_blend(ratio=0.2, cache_salt="tenant-a", take_exact=True))
    _, _, theirs = engine.prefill(prompt, unguarded_blend(ratio=0.2, cache_salt="tenant-b", take_exact=True))
    assert _doc_classes(mine) == [ReuseClass.EXACT] * 3
    assert ReuseClass.EXACT not in _doc_classes(theirs)[1:]


def _queue(engine, after=2, pending=4, tracked=64):
    from blend.serve.refine import RefineQueue

    return RefineQueue(engine.segments, after, pending, tracked)


def test_the_queue_admits_an_order_on_its_nth_blend_and_only_blends_with_work_left():
    engine = tiny_serve_engine()
    q = _queue(engine, after=2)
    prompt = engine.build_prompt("q?", make_docs(3, words=20, seed=1))
    blend = unguarded_blend(ratio=0.2, take_exact=True)
    _, _, rep = engine.prefill(prompt, blend)
    _, _, exact = engine.prefill(prompt, ReusePolicy.exact())
    assert not q.saw(prompt, ReusePolicy.exact(), exact)  # exact requests are not counted
    assert not q.saw(prompt, blend, rep) and q.pending == 0  # first blend: counted only
    assert not q.wants(blend, engine.prefill(prompt, blend)[2])  # the exact run is stored: nothing to do
    other = engine.build_prompt("q?", make_docs(3, words=20, seed=2))
    _, _, rep2 = engine.prefill(other, blend)
    assert not q.saw(other, blend, rep2)
    assert q.saw(other, blend, rep2) and q.pending == 1  # second blend of that order: queued
    assert not q.saw(other, blend, rep2) and q.pending == 1  # queued once
    one = _queue(engine, after=1, pending=2)
    prompts = [engine.build_prompt("q?", make_docs(3, words=20, seed=10 + i)) for i in range(3)]
    for p in prompts:
        assert one.saw(p, blend, engine.prefill(p, blend)[2])
    assert one.pending == 2 and one.dropped == 1  # the oldest was dropped
    fill = one.take()
    assert fill.prefix == order_segments(prompts[1])
    one.put_back(fill, computed=1)
    assert one.pending == 2 and one.take() is fill  # an unfinished fill goes first in line again


@pytest.mark.parametrize("after", [0, -1])
def test_refine_after_must_be_positive(after):
    with pytest.raises(ValueError):
        SchedulerConfig(refine_after=after)


def test_an_idle_worker_refines_an_order_and_its_next_blend_is_exact(make_scheduler):
    engine = tiny_serve_engine()
    sched = make_scheduler(engine, refine_after=2, prefill_workers=1)
    prompt = engine.build_prompt("where?", make_docs(4, words=40, seed=7))
    policy, cfg = unguarded_blend(ratio=0.2, take_exact=True), GenerationConfig(max_tokens=3)
    col = Collector()
    for i in range(2):
        sched.submit(prompt, policy, cfg, col.sink(i))
        col.wait(i + 1)
        assert ReuseClass.EXACT not in _doc_classes(col.last(i).completion.report)[1:]  # cold, then blended
    wait_until(lambda: sched.refine.completed == 1)
    assert sched.refine.segments_computed == 3 and sched.refine.pending == 0
    sched.submit(prompt, policy, cfg, col.sink(2))
    col.wait(3)
    done = col.last(2).completion
    assert _doc_classes(done.report) == [ReuseClass.EXACT] * 4
    ref, _, _ = engine.prefill(prompt, ReusePolicy.none())
    assert torch.equal(done.first_logits, ref)  # bit-identical to a full prefill


def test_a_waiting_request_comes_before_refinement():
    engine = tiny_serve_engine()
    sched = Scheduler(engine, SchedulerConfig(refine_after=1))  # not started: state only
    prompt = engine.build_prompt("q?", make_docs(3, words=20, seed=4))
    blend = unguarded_blend(ratio=0.2, take_exact=True)
    assert sched.refine.saw(prompt, blend, engine.prefill(prompt, blend)[2])
    assert sched._refine_due()
    sched.book.waiting.append(object())  # a request now waits for its prefill
    assert sched.book.prefill_due() and not sched._refine_due()


def test_a_failing_fill_is_dropped_and_serving_goes_on(make_scheduler, monkeypatch):
    engine = tiny_serve_engine()
    sched = make_scheduler(engine, refine_after=1, prefill_workers=1)
    failed = threading.Event()

    def boom(self):
        failed.set()
        raise RuntimeError("disk full")

    monkeypatch.setattr(PrefixFill, "step", boom)
    prompt = engine.build_prompt("q?", make_docs(3, words=20, seed=9))
    col = Collector()
    sched.submit(prompt, unguarded_blend(ratio=0.2, take_exact=True), GenerationConfig(max_tokens=2), col.sink(0))
    col.wait(1)
    wait_until(lambda: sched.refine.dropped == 1)
    assert failed.is_set() and sched.refine.pending == 0
    sched.submit(prompt, ReusePolicy.exact(), GenerationConfig(max_tokens=2), col.sink(1))
    col.wait(2)
    assert col.last(1).kind is EventKind.DONE


def test_serve_cli_turns_refinement_on_and_off():
    from blend.serve.cli import build_parser, config_from_args

    on = config_from_args(build_parser().parse_args(["--refine-after", "2"]))
    off = config_from_args(build_parser().parse_args([]))
    assert on.scheduler.refine_after == 2
    assert off.scheduler.refine_after is None  # off by default: answers never depend on idle time


def test_refinement_is_exported_as_metrics(make_scheduler):
    from blend.serve.metrics import ServeMetrics

    engine = tiny_serve_engine()
    metrics = ServeMetrics(engine.store)
    sched = Scheduler(engine, SchedulerConfig(refine_after=1, prefill_workers=1), metrics)
    sched.start()
    try:
        prompt = engine.build_prompt("q?", make_docs(3, words=20, seed=12))
        col = Collector()
        sched.submit(prompt, unguarded_blend(ratio=0.2, take_exact=True), GenerationConfig(max_tokens=2), col.sink(0))
        col.wait(1)
        wait_until(lambda: sched.refine.completed == 1)
        text = metrics.exposition().decode()
        assert "kvblend_refined_orders_total 1.0" in text
        assert "kvblend_refined_segments_total 2.0" in text  # documents 2 and 3
        assert "kvblend_refine_pending 0.0" in text
    finally:
        sched.close()


def test_through_the_server_a_refined_order_answers_with_every_document_exact():
    """End to end over HTTP (the bench's client): a blend, the idle worker's refinement, then the same
    blend again reports every document exact (the bench's "documents all exact" column)."""
    from _serve_util import TINY, running_server
    from blend.evals.bench_serve import demo_requests, run_clients
    from blend.serve.config import ServeConfig

    reqs = demo_requests()[:1]
    config = ServeConfig(model=TINY, scheduler=SchedulerConfig(refine_after=1))
    with running_server(tiny_serve_engine(), config) as srv:
        first = run_clients(srv.url, TINY, "blend@0.15", 1, 1, 4, reqs)
        wait_until(lambda: srv.scheduler.refine.completed == 1)
        again = run_clients(srv.url, TINY, "blend@0.15", 1, 1, 4, reqs)
    assert (first.exact_docs, again.exact_docs) == (0, 1)
    assert again.guarded == 0  # exact documents: nothing approximate left for the near-tie guard
