"""A randomized mixed workload through the real server: every answer equals the same request run alone.

A seeded schedule of requests (``KVBLEND_STRESS_SEED`` picks another; the seed is in every failure message) is sent
by several client threads and async tasks at once, through the openai client, httpx and raw sockets: chat and
completions, streamed and not, exact, blend (guarded and not, several ratios) and no reuse, the same documents in
different orders (store and hot-prefix hits and misses, two requests computing one chunk at once), stop
sequences, 1-16 tokens, logprobs, seeded sampling, conversations and system prompts, cache salts, clients that
leave mid-stream or before their first token, invalid requests, and requests that fail in their prefill or
their decode (injected).

Oracles:
  * every request read to its end equals the same request sent alone, in reverse order, to a fresh server of the
    same settings (status, text, token ids, logprobs, finish reason, usage, the logits hashes, the report's
    policy and figures; an error's body); a stream its client left is a prefix of that answer;
  * each report is consistent with what ran (classes per policy, cached tokens = reused rows, ...);
  * afterwards the server is idle: no request active, queued or prefilling, every decode-pool slot and
    single-flight claim back, the gauges at 0, every thread alive; a last request gets its right answer;
  * the counters add up: admitted = completed + failed + cancelled, failed = the injected failures, completed
    between the answers read whole and those plus the ones whose client left; one HTTP status counted per request.

With batch-invariant decoding every answer is bit-identical to the one alone; in throughput mode (decode pool,
decode shares) the first token's logits are (prefills are never batched) and the tokens are equal, logprobs
within float rounding (as tests/test_serve_scheduler.py holds for uniform requests).
"""

from __future__ import annotations

import os
import random
import string
import threading

import pytest

from _serve_util import TINY, one_torch_thread, running_server, tiny_serve_engine  # noqa: F401
from _stress_checks import LiveCaches, check_counts, check_idle, check_report, check_same_answer
from _stress_util import CHAT, COMPLETIONS, Client, Lane, Leave, Outcome, Spec, send_all_async
from blend.batch_decode import DecodeBatching
from blend.serve.config import SchedulerConfig, ServeConfig
from blend.serve.decode_loop import DecodeLoop
from conftest import make_docs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SEED = int(os.environ.get("KVBLEND_STRESS_SEED", "20281"))
DOCS = make_docs(4, words=9, seed=5)
ORDERS = ((0, 1, 2), (1, 0, 2), (0, 1))
QUESTIONS = ("which river?", "who keeps the lantern?", "where is the harbor?")
FAIL_PREFILL, FAIL_DECODE = "FAIL-PREFILL", "FAIL-DECODE"  # questions whose request fails (injected)
INVALID = [  # (changes to a valid body, the status and the error's param)
    ({"n": 2}, 400, "n"), ({"temperature": -1.0}, 400, "temperature"), ({"max_tokens": 0}, 400, "max_tokens"),
    ({"kvblend": {"reuse": "blend", "ratio": 1.5}}, 400, "kvblend.ratio"),
    ({"kvblend": {"reuse": "exact", "ratio": 0.3}}, 400, "kvblend"), ({"model": "not-served"}, 404, "model"),
    ({"stream_options": {"include_usage": True}, "stream": False}, 400, None),  # (a check of the whole body)
    ({"kvblend": {"reuse": "sideways"}}, 400, "kvblend.reuse"), ({"seed": 2 ** 70}, 400, "seed"),
]


# ---- the schedule ----------------------------------------------------------------------------------------------

def _body(rng: random.Random, path: str) -> dict:
    if rng.random() < 0.5:  # orders that come back: exact store and hot-prefix hits
        docs = [DOCS[i] for i in rng.choice(ORDERS)]
    else:  # the same chunks in other orders and company: blends' canonical hits, exact misses
        docs = rng.sample(DOCS, rng.randint(0 if path == COMPLETIONS else 1, 3))
    question = rng.choice(QUESTIONS)
    body: dict = {"model": TINY, "max_tokens": rng.randint(1, 16), "stream": rng.random() < 0.5}
    if path == CHAT:
        messages = [{"role": "user", "content": question}]
        if rng.random() < 0.2:
            messages.insert(0, {"role": "system", "content": "Answer briefly."})
        if rng.random() < 0.15:  # an earlier turn: the question's KV chains over it
            messages[-1:-1] = [{"role": "user", "content": rng.choice(QUESTIONS)},
                               {"role": "assistant", "content": "the north one."}]
        body["messages"] = messages
    else:
        body["prompt"] = question
    if docs:
        body["documents"] = docs
    if rng.random() < 0.5:
        body.update(temperature=0.0)
    else:
        body.update(temperature=round(rng.uniform(0.4, 1.3), 2), seed=rng.randrange(-2 ** 40, 2 ** 40))
        if rng.random() < 0.3:
            body["top_p"] = 0.9
    reuse = rng.choice(["default", "exact", "blend", "blend", "none"])
    if reuse == "blend":
        opts = {"reuse": "blend", "ratio": rng.choice([0.0, 0.15, 0.5, 1.0])}
        if rng.random() < 0.6:
            opts["guard_margin"] = None  # a tiny random model's first token is nearly always a near tie
        body["kvblend"] = opts
    elif reuse != "default":
        body["kvblend"] = {"reuse": reuse}
    if rng.random() < 0.3:
        body["stop"] = rng.sample(string.ascii_letters + " ", rng.randint(1, 3))
    if rng.random() < 0.3:
        if path == CHAT:
            body.update(logprobs=True, top_logprobs=rng.randint(0, 3))
        else:
            body["logprobs"] = rng.randint(0, 3)
    if rng.random() < 0.2:
        body["ignore_eos"] = True
    if rng.random() < 0.15:
        body["cache_salt"] = "tenant-b"
    if body["stream"] and rng.random() < 0.3:
        body["stream_options"] = {"include_usage": True}
    return body


def greedy_with_margins(path: str, body: dict) -> dict:
    """``body`` answered greedily, with each token's two most likely alternatives (see :func:`first_split`)."""
    body = {k: v for k, v in body.items() if k not in ("seed", "top_p")}
    if path == CHAT:
        return {**body, "temperature": 0.0, "logprobs": True, "top_logprobs": max(2, body.get("top_logprobs", 0))}
    return {**body, "temperature": 0.0, "logprobs": max(2, body.get("logprobs") or 0)}


def schedule(seed: int, n: int, greedy: bool = False) -> list[Spec]:
    """``n`` requests of every kind, some invalid, some failing, some whose client leaves (``greedy``: every
    request greedy and with its tokens' top-2 logprobs)."""
    rng = random.Random(seed)
    specs = []
    for i in range(n):
        path = rng.choice([CHAT, CHAT, COMPLETIONS])
        body = _body(rng, path)
        if greedy:
            body = greedy_with_margins(path, body)
        client = rng.choice([Client.OPENAI, Client.HTTPX, Client.ASYNC])
        leave, chunks, after, refused = Leave.NEVER, 0, 0.0, None
        roll = rng.random()
        if roll < 0.12:
            changes, status, param = rng.choice(INVALID)
            body, refused = {**body, **changes}, (status, param)
        elif roll < 0.17:
            marker = rng.choice([FAIL_PREFILL, FAIL_DECODE])
            body = {**body, "max_tokens": max(body["max_tokens"], 4)}
            body.update({"messages": [{"role": "user", "content": marker}]} if path == CHAT else {"prompt": marker})
        elif roll < 0.27 and body["max_tokens"] >= 3:  # reads a chunk or two, then leaves
            body = {**body, "stream": True, "ignore_eos": True}
            leave, chunks = Leave.MID_STREAM, rng.randint(1, 2)
        elif roll < 0.35:  # leaves before its first token, or just after: timing decides
            leave, client, after = Leave.EARLY, Client.RAW, rng.choice([0.0, 0.005, 0.03])
        specs.append(Spec(i, path, body, client, leave, chunks, after, refused))
    return specs


# ---- servers and injected failures ----------------------------------------------------------------------------

def _question(prompt) -> str:
    return prompt.question.text


def inject_failures(engine, monkeypatch) -> None:
    """A prompt whose question is FAIL_PREFILL fails in its prefill; FAIL_DECODE at its third decode step."""
    real_prefill = engine.prefill

    def prefill(prompt, *a, **kw):
        if FAIL_PREFILL in _question(prompt):
            raise RuntimeError("injected prefill failure")
        return real_prefill(prompt, *a, **kw)

    engine.prefill = prefill
    real_advance = DecodeLoop._advance

    def advance(self, job, logits):
        if FAIL_DECODE in _question(job.prompt) and job.stream.generated >= 3:
            raise RuntimeError("injected sampling failure")
        return real_advance(self, job, logits)

    monkeypatch.setattr(DecodeLoop, "_advance", advance)


class Admissions:
    """Counts the requests a scheduler admitted (a wrapper of its ``submit``)."""

    def __init__(self, sched) -> None:
        self.count = 0
        self._lock = threading.Lock()
        real = sched.submit

        def submit(*a, **kw):
            ticket = real(*a, **kw)
            with self._lock:
                self.count += 1
            return ticket

        sched.submit = submit


CONFIGS = {
    "invariant": SchedulerConfig(max_concurrency=4, max_queue=64, prefill_workers=2, torch_threads=1,
                                 batching=DecodeBatching.INVARIANT),
    "throughput": SchedulerConfig(max_concurrency=4, max_queue=64, prefill_workers=2, torch_threads=1,
                                  share_decode_min_batch=2, decode_loop_prefill_share=0.5),
}


# ---- sending ----------------------------------------------------------------------------------------------------

def run_concurrently(url: str, specs: list[Spec], threads: int = 3, tasks: int = 3) -> dict[int, Outcome]:
    """The async requests from ``tasks`` tasks of one thread, the others from ``threads`` threads, all at once."""
    by_async = [s for s in specs if s.client is Client.ASYNC]
    rest = [s for s in specs if s.client is not Client.ASYNC]
    out: dict[int, Outcome] = {}
    errors: list[BaseException] = []

    def lane(mine: list[Spec]) -> None:
        client = Lane(url)
        try:
            for spec in mine:
                out[spec.index] = client.send(spec)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)
        finally:
            client.close()

    def async_lane() -> None:
        import asyncio
        try:
            out.update(asyncio.run(send_all_async(url, by_async, tasks)))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    workers = [threading.Thread(target=lane, args=(rest[i::threads],)) for i in range(threads)]
    workers.append(threading.Thread(target=async_lane))
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    if errors:
        raise errors[0]
    return out


def run_alone(url: str, specs: list[Spec]) -> tuple[dict[int, Outcome], dict[int, Outcome]]:
    """Each request read whole, one at a time, in reverse order (so the store's state differs from the run's).

    Returns:
        The outcomes by request index, and those of each streamed request sent again unstreamed.
    """
    lane = Lane(url)
    alone, unstreamed = {}, {}
    try:
        for s in reversed(specs):
            alone[s.index] = lane.send(s.whole())
            if s.body.get("stream"):
                unstreamed[s.index] = lane.send(s.unstreamed())
    finally:
        lane.close()
    return alone, unstreamed


FINAL = {"model": TINY, "messages": [{"role": "user", "content": "which river?"}], "documents": DOCS[:3],
         "max_tokens": 8, "temperature": 0.0, "logprobs": True, "top_logprobs": 2}


@pytest.mark.parametrize("mode", list(CONFIGS))
def test_a_mixed_workload_answers_as_each_request_alone(mode, monkeypatch, caplog):
    bits = CONFIGS[mode].batching is DecodeBatching.INVARIANT
    specs = schedule(SEED, 32, greedy=not bits)  # bits: every answer to the bit; else greedy, to a near tie
    final = Spec(len(specs), CHAT, FINAL, Client.HTTPX)
    ctx = f"seed {SEED} (set KVBLEND_STRESS_SEED to rerun), {mode}"
    config = ServeConfig(model=TINY, scheduler=CONFIGS[mode])
    engine = tiny_serve_engine()
    inject_failures(engine, monkeypatch)
    caches = LiveCaches(engine)
    with running_server(engine, config) as srv:
        admissions = Admissions(srv.scheduler)
        got = run_concurrently(srv.url, specs)
        check_idle(srv, engine, caches, caplog, ctx)
        check_counts(srv, specs, got, admissions.count, ctx)
        lane = Lane(srv.url)
        got[final.index] = lane.send(final)  # serving goes on, and answers right
        lane.close()
        check_idle(srv, engine, caches, caplog, ctx)
    reference = tiny_serve_engine()
    inject_failures(reference, monkeypatch)
    with running_server(reference, config) as ref_srv:
        ref, unstreamed = run_alone(ref_srv.url, [*specs, final])
    for spec in [*specs, final]:
        out = got[spec.index]
        if spec.leave is Leave.EARLY:  # timing decides what it got, if anything: only the server's state is checked
            continue
        check_same_answer(spec, out, ref[spec.index], bits, ctx)
        if spec.refused is not None:  # a clear error naming the field
            assert (out.status, out.error["param"]) == spec.refused, (ctx, spec.describe(), out)
        check_report(spec, out, ctx)
        check_report(spec, ref[spec.index], ctx)
        whole = unstreamed.get(spec.index)
        if whole is not None and ref[spec.index].status == 200 and ref[spec.index].error is None:
            check_same_answer(spec, ref[spec.index], whole, True, ctx + ", streamed and not")
    assert got[final.index].status == 200 and got[final.index].error is None, ctx
