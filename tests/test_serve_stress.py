"""A randomized mixed workload through the real server: every answer equals the same request run alone.

A seeded schedule of requests (``KVBLEND_STRESS_SEED`` picks another, ``KVBLEND_STRESS_REQUESTS`` a longer one; both
are in every failure message) is sent by three client threads and three async tasks at once, through the openai
client, httpx and raw sockets: chat and completions, streamed and not, exact, blend (guarded and not, ratios 0-1)
and no reuse, the same documents in orders that come back and in others (store and hot-prefix hits and misses,
two requests computing one chunk at once, a document twice in a prompt), stop strings (some holding U+FFFD),
1-16 tokens, logprobs, seeded sampling, conversations and system prompts, cache salts, clients that leave
mid-stream or right after sending, invalid requests, and requests that fail in their prefill or their decode
(injected).

Oracles:
  * every request read to its end equals the same request sent alone, in reverse order, to a fresh server of the
    same settings (status, text, token ids, logprobs, finish reason, usage, the logits hashes, the report's
    policy and figures; an error's body and the field it names); a stream its client left is a prefix of that
    answer; alone, a streamed answer equals the unstreamed one, and one with stop strings equals the answer
    without them cut at the first;
  * each reuse report is consistent with its policy (classes, cached tokens = reused rows, offsets);
  * afterwards the server is idle within seconds: no request active, queued, prefilling or between the two, no
    KV cache alive (the KV pool's pending buffers only those hot prefixes view), every decode-pool slot and
    single-flight claim back, the gauges at 0, every thread alive; a last request gets its right answer;
  * the counters add up: admitted = completed + failed + cancelled, failed = the injected failures, completed
    between the answers read whole and those plus the ones whose client left, one first-token time per answer
    at most, one HTTP status (200 or 499 for those that left) per request.

With batch-invariant decoding every answer is bit-identical to the one alone (seeded sampling included). In
throughput mode (decode pool with slots some prompts do not fit, decode shares) a step's logits move with the
batch by float rounding, so the requests are greedy: the first token's logits are bit-identical (prefills are
never batched), logprobs within float rounding, and the tokens equal but where the two likeliest tie within
:data:`~_stress_checks.NEAR_TIE`, after which nothing is compared.
"""

from __future__ import annotations

import asyncio
import os
import random
import string
import threading

import pytest

from _serve_util import TINY, one_torch_thread, running_server, tiny_serve_engine  # noqa: F401
from _stress_checks import (
    LiveCaches, check_counts, check_idle, check_report, check_same_answer, check_stop_cut,
)
from _stress_util import CHAT, COMPLETIONS, Client, Lane, Leave, Outcome, Spec, send_all_async
from blend.batch_decode import DecodeBatching
from blend.serve.config import SchedulerConfig, ServeConfig
from blend.serve.decode_loop import DecodeLoop
from conftest import make_docs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SEED = int(os.environ.get("KVBLEND_STRESS_SEED", "20281"))
REQUESTS = int(os.environ.get("KVBLEND_STRESS_REQUESTS", "32"))  # more for a longer run by hand
DOCS = make_docs(4, words=9, seed=5)
ORDERS = ((0, 1, 2), (1, 0, 2), (0, 1))
STOPS = ["CC", "U\ufffd", "\ufffd", "\ufffdC"]
QUESTIONS = ("which river?", "who keeps the lantern?", "where is the harbor?")
FAIL_PREFILL, FAIL_DECODE = "FAIL-PREFILL", "FAIL-DECODE"  # questions whose request fails (injected)
INVALID = [  # (changes to a valid body, the status and the error's param)
    ({"n": 2}, 400, "n"), ({"temperature": -1.0}, 400, "temperature"), ({"max_tokens": 0}, 400, "max_tokens"),
    ({"kvblend": {"reuse": "blend", "ratio": 1.5}}, 400, "kvblend.ratio"),
    ({"kvblend": {"reuse": "exact", "ratio": 0.3}}, 400, "kvblend"), ({"model": "not-served"}, 404, "model"),
    ({"stream_options": {"include_usage": True}, "stream": False}, 400, "stream_options"),
    ({"kvblend": {"reuse": "sideways"}}, 400, "kvblend.reuse"), ({"seed": 2 ** 70}, 400, "seed"),
]


# ---- the schedule ----------------------------------------------------------------------------------------------

def _body(rng: random.Random, path: str) -> dict:
    if rng.random() < 0.5:  # orders that come back: exact store and hot-prefix hits
        docs = [DOCS[i] for i in rng.choice(ORDERS)]
    else:  # the same chunks in other orders and company: blends' canonical hits, exact misses
        docs = rng.sample(DOCS, rng.randint(0 if path == COMPLETIONS else 1, 3))
        if docs and rng.random() < 0.15:  # one document twice in a prompt
            docs.insert(rng.randint(0, len(docs)), docs[0])
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
    if rng.random() < 0.3:  # letters, and strings the tiny model's answers hold across tokens (U+FFFD: bytes that are
        # not UTF-8, or a character still incomplete)
        body["stop"] = rng.sample(string.ascii_letters + " ", rng.randint(0, 2)) + rng.sample(STOPS, rng.randint(0, 2))
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


def fails(spec: Spec) -> bool:
    """Whether a failure is injected into the request (see :func:`inject_failures`)."""
    question = spec.body["prompt"] if spec.path == COMPLETIONS else spec.body["messages"][-1]["content"]
    return question in (FAIL_PREFILL, FAIL_DECODE)


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
    # decode shares from two sequences on; slots that the longer prompts (three documents) do not fit, so that
    # steps mix pooled caches and caches of their own
    "throughput": SchedulerConfig(max_concurrency=4, max_queue=64, prefill_workers=2, torch_threads=1,
                                  share_decode_min_batch=2, decode_loop_prefill_share=0.5, decode_pool_tokens=320),
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
    assert not any(w.is_alive() for w in workers), "a client still waits for its answer: a request is stuck"
    if errors:
        raise errors[0]
    return out


def run_alone(url: str, specs: list[Spec]) -> tuple[dict[int, Outcome], dict[int, Outcome], dict[int, Outcome]]:
    """Each request read whole, one at a time, in reverse order (so the store's state differs from the run's).

    Returns:
        The outcomes by request index, those of each streamed request sent again unstreamed, and those of each
        request with stop strings sent again without them.
    """
    lane = Lane(url)
    alone, unstreamed, unstopped = {}, {}, {}
    try:
        for s in reversed(specs):
            alone[s.index] = lane.send(s.whole())
            if s.body.get("stream"):
                unstreamed[s.index] = lane.send(s.unstreamed())
            if s.body.get("stop"):
                unstopped[s.index] = lane.send(s.without_stop())
    finally:
        lane.close()
    return alone, unstreamed, unstopped


FINAL = {"model": TINY, "messages": [{"role": "user", "content": "which river?"}], "documents": DOCS[:3],
         "max_tokens": 8, "temperature": 0.0, "logprobs": True, "top_logprobs": 2}


@pytest.mark.parametrize("mode", list(CONFIGS))
def test_a_mixed_workload_answers_as_each_request_alone(mode, monkeypatch, caplog):
    bits = CONFIGS[mode].batching is DecodeBatching.INVARIANT
    specs = schedule(SEED, REQUESTS, greedy=not bits)  # bits: every answer to the bit; else greedy, to a near tie
    final = Spec(len(specs), CHAT, FINAL, Client.HTTPX)
    ctx = f"seed {SEED} (KVBLEND_STRESS_SEED={SEED} KVBLEND_STRESS_REQUESTS={REQUESTS} to rerun), {mode}"
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
        ref, unstreamed, unstopped = run_alone(ref_srv.url, [*specs, final])
    for spec in [*specs, final]:
        out = got[spec.index]
        if spec.leave is Leave.EARLY:  # timing decides what it got, if anything: only the server's state is checked
            continue
        check_same_answer(spec, out, ref[spec.index], bits, ctx)
        if spec.refused is not None:  # a clear error naming the field
            assert (out.status, out.error["param"]) == spec.refused, (ctx, spec.describe(), out)
        check_report(spec, out, ctx)
        check_report(spec, ref[spec.index], ctx)
        answered = ref[spec.index].status == 200 and ref[spec.index].error is None
        if spec.index in unstreamed and answered:
            check_same_answer(spec, ref[spec.index], unstreamed[spec.index], True, ctx + ", streamed and not")
        if spec.index in unstopped and answered and not fails(spec):  # (without its stop, one may fail later)
            check_stop_cut(spec, ref[spec.index], unstopped[spec.index], ctx)
    assert got[final.index].status == 200 and got[final.index].error is None, ctx


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_holding_u_fffd_cuts_the_answer_where_its_text_holds_one(stream):
    """Found by the stress test's stop-string oracle: a stop string holding U+FFFD matched the stand-in of a
    character whose bytes were still coming, so this answer ("ȅ" is bytes C8 85 on the byte-level tiny model)
    ended empty after C8, where its text holds no U+FFFD. It is now cut where its text does."""
    body = {"model": TINY, "messages": [{"role": "user", "content": "q?"}], "documents": DOCS[:2], "max_tokens": 12,
            "temperature": 1.0, "seed": 7}
    with running_server(tiny_serve_engine(), ServeConfig(model=TINY, scheduler=CONFIGS["invariant"])) as srv:
        lane = Lane(srv.url)
        unstopped = lane.send(Spec(0, CHAT, body, Client.HTTPX))
        spec = Spec(1, CHAT, {**body, "stop": ["\ufffd"], "stream": stream}, Client.HTTPX)
        stopped = lane.send(spec)
        lane.close()
    assert unstopped.text.index("\ufffd") > 0 and unstopped.ext["answer_token_ids"][0] >= 0xC2  # a character first
    check_stop_cut(spec, stopped, unstopped, "pinned")
