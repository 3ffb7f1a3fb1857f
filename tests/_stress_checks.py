"""The stress test's oracles: an answer equals the one its request got alone, its reuse report says what its
policy can have run, the server is idle afterwards, and its counters add up (see tests/test_serve_stress.py)."""

from __future__ import annotations

import gc
import weakref
from collections import Counter

import httpx
from prometheus_client.parser import text_string_to_metric_families

from _serve_util import wait_until
from _stress_util import CHAT, COMPLETIONS, Entry, Outcome, Spec


class LiveCaches:
    """Every KV cache the engine's model makes, held weakly: once the server is idle none may be alive."""

    def __init__(self, engine) -> None:
        self.caches: weakref.WeakSet = weakref.WeakSet()
        self.made = 0
        real = engine.runner.new_cache

        def new_cache(capacity: int):
            cache = real(capacity)
            self.caches.add(cache)
            self.made += 1
            return cache

        engine.runner.new_cache = new_cache

    def alive(self, caplog) -> int:
        """Caches still alive. pytest keeps the test's log records, and a logged error's traceback holds the
        frames it passed through: an injected sampling failure's, the decode step's, whose locals are the caches of
        its whole batch. Those tracebacks are let go first (the log text was written already)."""
        for record in caplog.records:
            record.exc_info = None
            for arg in record.args if isinstance(record.args, tuple) else ():
                if isinstance(arg, BaseException):
                    arg.__traceback__ = None
        gc.collect()
        return len(self.caches)


REPORT_SAME = ("policy", "applied", "prompt_tokens", "selector", "ratio", "first_token_margin", "guard", "spent")
EXT_SAME = ("logits_sha256", "answer_token_ids", "finish_reason")
REUSED = ("exact", "blended")
NEAR_TIE = 1e-3  # nats: logprobs a batch's float rounding moves by ~1e-6 (see first_split)


def _close(a: float | None, b: float | None) -> bool:
    return a == b or (a is not None and b is not None and abs(a - b) <= 1e-4)


def same_logprobs(got: list[Entry], ref: list[Entry], bits: bool) -> bool:
    """Equal; outside batch-invariant mode each value within float rounding (the same tokens, and each rank's
    alternative as likely: two alternatives of equal odds may trade places)."""
    if bits or got == ref:
        return got == ref
    return len(got) == len(ref) and all(
        (g.token, g.bytes, g.offset, len(g.alternatives)) == (r.token, r.bytes, r.offset, len(r.alternatives))
        and _close(g.logprob, r.logprob) and all(_close(x[1], y[1]) for x, y in zip(g.alternatives, r.alternatives))
        for g, r in zip(got, ref))


def first_split(got: list[Entry], ref: list[Entry]) -> int | None:
    """Where two greedy answers' tokens part (None: nowhere), if they part at a near tie of the answer alone.

    Outside batch-invariant mode a decode step's logits move by float rounding with the batch, so a greedy
    answer may take the other token where the two most likely ones tie within that; nothing after such a
    step is compared. Anywhere else the two answers must agree: a wider gap than :data:`NEAR_TIE` fails.
    """
    for i, (g, r) in enumerate(zip(got, ref)):
        if (g.token, g.bytes) != (r.token, r.bytes):
            top = r.alternatives
            assert len(top) >= 2 and top[0][1] - top[1][1] < NEAR_TIE, (i, g, r)
            return i
    return None


def check_same_answer(spec: Spec, got: Outcome, ref: Outcome, bits: bool, ctx: str) -> None:
    """``got`` (read whole, or left mid-stream) is the answer ``ref`` the request got alone."""
    where = f"{ctx}: {spec.describe()}"
    assert ref.status is not None and not ref.left, where
    if not bits and ref.status == 200 and ref.error is None and got.status == 200:
        split = first_split(got.logprobs, ref.logprobs)  # (greedy, with each token's top 2: greedy_with_margins)
        if split is not None:  # the same answer up to a near tie, the same first token's logits
            assert same_logprobs(got.logprobs[:split], ref.logprobs[:split], bits), (where, got, ref)
            if got.ext is not None:
                assert got.ext["logits_sha256"] == ref.ext["logits_sha256"], where
                assert got.ext["answer_token_ids"][:split] == ref.ext["answer_token_ids"][:split], where
            return
    if got.left:  # what arrived before its client left is the start of the whole answer
        assert got.status == ref.status == 200 and ref.text.startswith(got.text), (where, got, ref)
        assert same_logprobs(got.logprobs, ref.logprobs[:len(got.logprobs)], bits), (where, got, ref)
        return
    assert (got.status, got.error) == (ref.status, ref.error), (where, got, ref)
    assert got.text == ref.text and got.finish == ref.finish, (where, got, ref)
    assert same_logprobs(got.logprobs, ref.logprobs, bits), (where, got.logprobs, ref.logprobs)
    if got.usage is not None and ref.usage is not None:  # (a stream has one when it asked for it)
        assert {**got.usage, "cached": None} == {**ref.usage, "cached": None}, (where, got.usage, ref.usage)
    if ref.ext is None:
        assert got.ext is None, where
        return
    seeded = ("seed",) if "seed" in spec.body else ()  # a request without one gets a random seed (greedy: unused)
    for name in EXT_SAME + seeded + (("steps_sha256",) if bits else ()):
        assert got.ext[name] == ref.ext[name], (where, name, got.ext[name], ref.ext[name])
    g, r = got.ext["report"], ref.ext["report"]
    for name in REPORT_SAME:
        assert g[name] == r[name], (where, name, g[name], r[name])
    shape = [(s["kind"], s["tokens"], s["start"]) for s in g["segments"]]
    assert shape == [(s["kind"], s["tokens"], s["start"]) for s in r["segments"]], where


def check_stop_cut(spec: Spec, stopped: Outcome, unstopped: Outcome, ctx: str) -> None:
    """Stop strings cut the answer the request gets without them at the first one's start: the same tokens up to
    there (a few more may have been sampled before a stop string was decided), the text up to it."""
    where = f"{ctx}: {spec.describe()}"
    assert unstopped.status == 200 and unstopped.error is None, (where, unstopped)
    ids, all_ids = stopped.ext["answer_token_ids"], unstopped.ext["answer_token_ids"]
    assert all_ids[:len(ids)] == ids, (where, ids, all_ids)
    hits = [i for s in spec.body["stop"] if (i := unstopped.text.find(s)) >= 0]
    cut = min(hits) if hits else None
    assert stopped.text == unstopped.text[:cut], (where, stopped.text, unstopped.text)
    assert stopped.finish == ("stop" if cut is not None else unstopped.finish), (where, stopped, unstopped)


def check_report(spec: Spec, out: Outcome, ctx: str) -> None:
    """The reuse report of an answer says what a request of its policy can have run."""
    if out.ext is None:
        return
    where = f"{ctx}: {spec.describe()}"
    rep = out.ext["report"]
    segs = rep["segments"]
    classes = [s["class"] for s in segs]
    kinds = [s["kind"] for s in segs]
    docs = len(spec.body.get("documents", ()))
    turns = len(kinds) - docs - 2  # a conversation's earlier turns, between the documents and the question
    assert kinds == ["preamble"] + ["document"] * docs + ["turn"] * turns + ["question"], (where, kinds)
    starts = [sum(s["tokens"] for s in segs[:i]) for i in range(len(segs))]
    assert [s["start"] for s in segs] == starts and rep["prompt_tokens"] == sum(s["tokens"] for s in segs), where
    reused = sum(s["tokens"] for s in segs if s["class"] in REUSED)
    assert rep["reused_tokens"] == reused and rep["computed_tokens"] == rep["prompt_tokens"] - reused, (where, rep)
    if out.usage is not None:
        assert out.usage["prompt"] == rep["prompt_tokens"] and out.usage["cached"] == reused, (where, out.usage)
    assert classes[-1] == "computed", (where, classes)  # the question is never stored
    reuse = (spec.body.get("kvblend") or {}).get("reuse", "exact")
    for s in segs:  # only a blend recomputes rows of its documents (found, or computed alone and then re-positioned)
        assert len(s["recomputed_offsets"]) == s["recomputed"], where
        assert s["recomputed"] == 0 or (reuse == "blend" and s["kind"] == "document"), (where, s)
    if reuse == "none":
        assert set(classes) == {"computed"} and rep["applied"] == "none", (where, rep)
    elif reuse == "exact":  # found segments form a prefix: each key commits to every token before it
        assert rep["applied"] == "exact" and classes == sorted(classes, key=lambda c: c != "exact"), (where, classes)
        assert set(classes) <= {"exact", "computed"}, (where, classes)
    else:  # documents exact only at the canonical place (the first); re-positioned ones are blended
        assert set(classes) <= {"exact", "blended", "computed"}, (where, classes)
        docs_classes = classes[1:1 + docs]
        assert "exact" not in docs_classes[1:] and "blended" not in classes[:2] + classes[1 + docs:], (where, classes)
    assert out.ext["finish_reason"] == out.finish, where


def metric_samples(url: str) -> dict[tuple, float]:
    """Every sample of the server's /metrics, by (name, sorted labels)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def check_idle(srv, engine, caches: LiveCaches, caplog, ctx: str) -> None:
    """No request holds anything: active, queued, prefilling, incoming, KV caches (their buffers back in the KV
    pool, pending only where a hot prefix views them), decode-pool slots, single-flight claims, gauges."""
    sched, book = srv.scheduler, srv.scheduler.book

    def state() -> tuple:
        with book.cond:
            return book.active, len(book.waiting), list(book.incoming), book.prefilling, set(book.prefilling_jobs)

    def pending() -> int:  # KV buffers given back that something other than a hot prefix still views
        return engine.runner.kv_pool.stats().pending_bytes - engine.segments.hot.held_bytes

    # the last requests retired a moment ago may still be on their way out (a prefill worker leaving the request,
    # the decode step that finished it returning): idle within seconds, or stuck
    try:
        wait_until(lambda: state() == (0, 0, [], 0, set()) and caches.alive(caplog) == 0 and pending() <= 0,
                   timeout=30)
    except AssertionError:
        raise AssertionError(f"{ctx}: not idle: {state()}, {caches.alive(caplog)} KV caches alive, "
                             f"{pending()} bytes of KV buffers viewed beyond hot prefixes") from None
    assert caches.made, ctx
    assert engine.store.claimed() == 0, ctx
    if sched.pool is not None:
        assert sched.pool.free_slots == sched.pool.slots, ctx
    assert sched.dead_threads() == [], ctx
    m = metric_samples(srv.url)
    assert m[("kvblend_active_requests", ())] == 0 and m[("kvblend_queue_depth", ())] == 0, ctx


def check_counts(srv, specs: list[Spec], got: dict[int, Outcome], admitted: int, ctx: str) -> None:
    """The scheduler's and /metrics' counters add up to what the clients saw."""
    sched = srv.scheduler
    whole = [s for s in specs if not got[s.index].left]
    ok = sum(1 for s in whole if got[s.index].status == 200 and got[s.index].error is None)
    failed = sum(1 for s in whole if got[s.index].status == 500 or (got[s.index].status == 200
                                                                     and got[s.index].error is not None))
    left = sum(1 for s in specs if got[s.index].left)
    counts = (admitted, sched.completed, sched.failed, sched.cancelled)
    assert admitted == sched.completed + sched.failed + sched.cancelled, (ctx, counts)
    assert sched.failed == failed and ok <= sched.completed <= ok + left, (ctx, counts, ok, failed, left)
    assert ok + failed <= admitted <= ok + failed + left, (ctx, counts)
    def statuses() -> Counter:
        http = Counter()
        for (name, labels), value in metric_samples(srv.url).items():
            if name == "kvblend_requests_total" and dict(labels)["endpoint"] in (CHAT, COMPLETIONS):
                http[int(dict(labels)["status"])] += int(value)
        return http

    # one status per request, whoever left (the answer to a client that left may still be on its way out)
    try:
        wait_until(lambda: sum(statuses().values()) == len(specs), timeout=10)
    except AssertionError:
        raise AssertionError(f"{ctx}: {len(specs)} requests, statuses counted: {statuses()}") from None
    http = statuses()
    m = metric_samples(srv.url)
    assert m[("kvblend_e2e_seconds_count", ())] == sched.completed, ctx
    assert sched.completed <= m[("kvblend_ttft_seconds_count", ())] <= admitted, ctx  # each first token once
    assert m[("kvblend_interrupted_prefills_total", ())] == sched.interrupted_prefills, ctx
    expected = Counter(got[s.index].status for s in whole)
    leavers = http - expected
    assert sum(leavers.values()) == left and set(leavers) <= {200, 499}, (ctx, http, expected)
