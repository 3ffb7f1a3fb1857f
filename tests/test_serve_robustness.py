"""The server survives what used to break it: a request whose sampling fails, a tiny temperature, a
request cancelled while queued, a dead scheduler thread; and OpenAI's shapes where they differed
(context errors, error params, model retrieval, streamed usage); a stream whose stalled client leaves, and
a token rate nobody scrapes, hold no memory beyond their request and window. Tiny model, loopback server."""

from __future__ import annotations

import asyncio
import gc
import inspect
import json
import threading
import time
import tracemalloc
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch

from _serve_util import (  # noqa: F401 - fixtures
    TINY, Collector, make_scheduler, one_torch_thread, running_server, tiny_serve_engine, wait_until,
)
from blend.defaults import (
    DEFAULT_DTYPE, DEFAULT_GRACEFUL_SHUTDOWN_S, DEFAULT_LOG_LEVEL, DEFAULT_MAX_NEW_TOKENS, DTYPE_NAMES, LOG_LEVELS,
    MIN_SAMPLING_TEMPERATURE,
)
from blend.generation import TokenStream
from blend.policy import ReusePolicy
from blend.sampling import DEFAULT_MAX_TOKENS, GenerationConfig, sample
from blend.serve import metrics as metrics_module
from blend.serve import scheduler as scheduler_module
from blend.serve.app import create_app
from blend.serve.config import Limits, SchedulerConfig, ServeConfig
from blend.serve.connection import uvicorn_options
from blend.serve.decode_loop import DecodeLoop
from blend.serve.intake import ApiError, prepare
from blend.serve.metrics import ServeMetrics
from blend.serve.protocol import Endpoint
from blend.serve.request_book import RequestBook
from blend.serve.jobs import Ending, EventKind, QueueFullError, SchedulerJob
from blend.serve.scheduler import Scheduler
from blend.serve.schemas import ChatCompletionRequest, CompletionRequest
from conftest import make_docs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY_T = 8.964331009808708e-39  # logits / T overflow float32 (with frequency_penalty -2: NaN probabilities)
BAD_SEED = 666


@pytest.fixture(scope="module")
def engine(one_torch_thread):
    return tiny_serve_engine()


@pytest.fixture(scope="module")
def srv(engine):
    with running_server(engine, ServeConfig(model=TINY, scheduler=SchedulerConfig(max_concurrency=4))) as running:
        yield running


def chat(question: str = "hello there", **kw) -> dict:
    return {"model": TINY, "messages": [{"role": "user", "content": question}], "max_tokens": 8, "temperature": 0,
            **kw}


def post(srv, body: dict, path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=30)


# ---- 1. a failing request fails alone; the decode loop lives; tiny temperatures are greedy ------------

class _FlakyStream(TokenStream):
    """Sampling that fails on a decode step (not the first token) for requests seeded BAD_SEED."""

    def step(self, logits: torch.Tensor) -> str:
        if self.config.seed == BAD_SEED and self.tokens:
            raise RuntimeError("sampling broke")
        return super().step(logits)


def _fail_once(real, exc: Exception):
    calls = {"n": 0}

    def wrapped(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 1:
            raise exc
        return real(*args, **kw)
    return wrapped


@pytest.mark.parametrize("where", ["sample", "pool_adopt", "step"])
def test_a_failure_in_the_decode_loop_fails_its_requests_and_the_loop_keeps_serving(
        engine, make_scheduler, monkeypatch, where):
    monkeypatch.setattr(scheduler_module, "TokenStream", _FlakyStream)
    sched = make_scheduler(engine, max_concurrency=4)
    if where == "pool_adopt":
        sched.pool.adopt = _fail_once(sched.pool.adopt, RuntimeError("adopt broke"))
    elif where == "step":
        sched.decoder.step = _fail_once(sched.decoder.step, RuntimeError("step broke"))
    col = Collector()
    prompt = engine.build_prompt("q?", make_docs(1))
    seed = BAD_SEED if where == "sample" else 1
    sched.submit(prompt, ReusePolicy.exact(), GenerationConfig(max_tokens=6, ignore_eos=True, seed=seed),
                 col.sink(0))
    col.wait(1, timeout=20)
    assert col.last(0).kind is EventKind.FAILED and "broke" in str(col.last(0).error)
    assert sched.failed == 1 and sched.active == 0 and not sched.dead_threads()
    later = sched.submit(prompt, ReusePolicy.exact(), GenerationConfig(max_tokens=6, ignore_eos=True, seed=2),
                         col.sink(1))
    col.wait(2, timeout=20)
    assert later.id and col.last(1).kind is EventKind.DONE and len(col.last(1).completion.token_ids) == 6
    assert sched.completed == 1 and sched.failed == 1


def test_a_request_whose_sampling_fails_does_not_stop_its_batch_neighbours(engine, make_scheduler, monkeypatch):
    monkeypatch.setattr(scheduler_module, "TokenStream", _FlakyStream)
    sched = make_scheduler(engine, max_concurrency=4)
    col = Collector()
    prompt = engine.build_prompt("q?", make_docs(1))
    good = sched.submit(prompt, ReusePolicy.exact(), GenerationConfig(max_tokens=3000, ignore_eos=True, seed=1),
                        col.sink(0))
    wait_until(lambda: sched.steps >= 2, timeout=20)
    sched.submit(prompt, ReusePolicy.exact(), GenerationConfig(max_tokens=40, ignore_eos=True, seed=BAD_SEED),
                 col.sink(1))
    col.wait(1, timeout=20)
    assert col.last(1).kind is EventKind.FAILED
    steps = sched.steps
    wait_until(lambda: sched.steps >= steps + 5, timeout=20)  # the neighbour goes on decoding
    assert col.last(0).kind is EventKind.TEXT and sched.active == 1
    good.cancel()
    wait_until(lambda: sched.active == 0, timeout=10)
    assert (sched.failed, sched.cancelled) == (1, 1)


@pytest.mark.parametrize("temperature", [TINY_T, 1e-45, MIN_SAMPLING_TEMPERATURE / 2])
def test_a_temperature_below_the_threshold_is_greedy(temperature):
    logits = torch.tensor([2.0, 1.5, -1.0, 1.9])
    cfg = GenerationConfig(temperature=temperature, frequency_penalty=-2.0)
    assert cfg.greedy
    assert sample(logits, cfg, torch.Generator().manual_seed(0), {3: 1}) == 3  # 1.9 + 2 beats 2.0
    assert not GenerationConfig(temperature=MIN_SAMPLING_TEMPERATURE).greedy


def test_a_tiny_temperature_over_http_is_answered_greedily(srv):
    body = chat(max_tokens=20, frequency_penalty=-2.0, seed=1, ignore_eos=True)
    r = post(srv, {**body, "temperature": TINY_T})
    assert r.status_code == 200, r.text
    greedy = post(srv, {**body, "temperature": 0})
    assert r.json()["kvblend"]["answer_token_ids"] == greedy.json()["kvblend"]["answer_token_ids"]
    assert post(srv, chat(temperature=1e-45)).status_code == 200
    assert httpx.get(srv.url + "/health").status_code == 200


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread it kills
def test_health_is_503_when_a_scheduler_thread_died(engine, monkeypatch):
    def die(self, batch):
        raise SystemExit  # not an Exception: the loop's guard lets it end the thread

    monkeypatch.setattr(DecodeLoop, "_iteration", die)
    with running_server(engine, ServeConfig(model=TINY)) as running:
        wait_until(lambda: running.scheduler.dead_threads(), timeout=10)
        r = httpx.get(running.url + "/health")
        assert r.status_code == 503, r.text
        assert r.json()["status"] == "unavailable" and "kvblend-decode" in r.json()["reason"]


# ---- 2. a request cancelled while queued frees its place ---------------------------------------------

def test_a_request_cancelled_in_the_queue_leaves_it_at_once(engine, make_scheduler):
    sched = make_scheduler(engine, max_concurrency=1, max_queue=1)
    col = Collector()
    prompt = engine.build_prompt("q?", make_docs(1))
    long = sched.submit(prompt, ReusePolicy.exact(), GenerationConfig(max_tokens=3000, ignore_eos=True),
                        col.sink(0))
    wait_until(lambda: sched.steps >= 1, timeout=20)
    queued = sched.submit(prompt, ReusePolicy.exact(), GenerationConfig(max_tokens=2), col.sink(1))
    assert sched.queue_depth == 1
    queued.cancel()
    assert sched.queue_depth == 0 and sched.cancelled == 1 and sched.active == 1
    sched.submit(prompt, ReusePolicy.exact(), GenerationConfig(max_tokens=2), col.sink(2))  # no QueueFullError
    with pytest.raises(QueueFullError):
        sched.submit(prompt, ReusePolicy.exact(), GenerationConfig(max_tokens=2), col.sink(3))
    long.cancel()
    col.wait(1, timeout=30)
    assert col.last(2).kind is EventKind.DONE and 1 not in col.events
    queued.cancel()  # again: nothing changes
    wait_until(lambda: sched.active == 0, timeout=10)
    assert sched.cancelled == 2 and sched.completed == 1


# ---- 3, 4. context and field errors as OpenAI names them ---------------------------------------------

def _long_question(engine, tokens: int) -> str:
    """A question whose chat prompt is ``tokens`` tokens or a little more."""
    words = tokens // 2
    while len(engine.build_prompt("x " * words, [], None, ())) < tokens:
        words += 5
    return "x " * words


def _prepare(engine, body, endpoint=Endpoint.CHAT, **limits):
    return prepare(engine, ServeConfig(model=TINY, limits=Limits(**limits)), body, endpoint)


def _refusal(engine, body, endpoint=Endpoint.CHAT, **limits) -> ApiError:
    with pytest.raises(ApiError) as exc:
        _prepare(engine, body, endpoint, **limits)
    return exc.value


def test_the_default_budget_is_cut_to_the_room_left_in_the_context(engine):
    context = engine.dims.max_positions
    q = _long_question(engine, context - 150)
    job = _prepare(engine, ChatCompletionRequest(messages=[{"role": "user", "content": q}]))
    assert job.config.max_tokens == context - len(job.prompt) < Limits().default_max_tokens
    short = _prepare(engine, ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]))
    assert short.config.max_tokens == Limits().default_max_tokens
    err = _refusal(engine, ChatCompletionRequest(messages=[{"role": "user", "content": q}], max_tokens=200))
    assert (err.status, err.code, err.param) == (400, "context_length_exceeded", "max_tokens")
    err = _refusal(engine, ChatCompletionRequest(messages=[{"role": "user", "content": q}],
                                                 max_completion_tokens=200))
    assert (err.status, err.code, err.param) == (400, "context_length_exceeded", "max_completion_tokens")


@pytest.mark.parametrize("endpoint", [Endpoint.CHAT, Endpoint.COMPLETIONS])
def test_a_prompt_over_the_context_is_a_400_context_length_exceeded(engine, endpoint):
    q = _long_question(engine, engine.dims.max_positions + 10)
    body = (ChatCompletionRequest(messages=[{"role": "user", "content": q}]) if endpoint is Endpoint.CHAT
            else CompletionRequest(prompt=q))
    err = _refusal(engine, body, endpoint)
    param = "messages" if endpoint is Endpoint.CHAT else "prompt"
    assert (err.status, err.code, err.param) == (400, "context_length_exceeded", param)
    assert f"(max_position_embeddings={engine.dims.max_positions})" in str(err)  # what sets the limit
    err = _refusal(engine, body, endpoint, max_prompt_tokens=1000)  # the server's own limit stays a 413
    assert (err.status, err.kind.value) == (413, "request_too_large")


def test_over_the_context_over_http(srv, engine):
    q = _long_question(engine, engine.dims.max_positions + 10)
    r = post(srv, chat(q, max_tokens=None))
    assert r.status_code == 400
    assert (r.json()["error"]["code"], r.json()["error"]["param"]) == ("context_length_exceeded", "messages")


@pytest.mark.parametrize("body, param", [
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": ["y" * 65]}, "stop"),
    ({"max_completion_tokens": 5000}, "max_completion_tokens"),
    ({"max_tokens": 5000}, "max_tokens"),
])
def test_a_refused_setting_names_its_field(engine, body, param):
    err = _refusal(engine, ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **body))
    assert err.status == 400 and err.param == param, err.message
    assert param in err.message


# ---- 5. GET /v1/models/{id} --------------------------------------------------------------------------

def test_a_model_is_retrieved_by_id_with_the_openai_client(srv):
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    model = client.models.retrieve(TINY)
    assert (model.id, model.object, model.owned_by) == (TINY, "model", "kvblend")
    assert model.created == client.models.list().data[0].created
    with pytest.raises(openai.NotFoundError) as exc:
        client.models.retrieve("gpt-4o")
    assert exc.value.body["code"] == "model_not_found" and exc.value.body["param"] == "model"


# ---- 6. "usage": null on every chunk but the usage chunk --------------------------------------------

@pytest.mark.parametrize("include_usage", [True, False])
def test_streamed_chunks_carry_usage_null_when_usage_is_asked_for(srv, include_usage):
    body = chat(stream=True, stream_options={"include_usage": include_usage}, ignore_eos=True)
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=30) as r:
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    if include_usage:
        assert all("usage" in c and c["usage"] is None for c in chunks[:-1])
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    else:
        assert all("usage" not in c for c in chunks)


# ---- 7. counters change under the lock ---------------------------------------------------------------

def test_endings_are_counted_exactly_from_many_threads(engine):
    sched = Scheduler(engine, SchedulerConfig(decode_pool_tokens=None))  # not started: only its books
    per, endings = 500, [Ending.COMPLETED, Ending.FAILED, Ending.CANCELLED] * 2
    sched.book.active = per * len(endings)
    prompt = engine.build_prompt("q?", [])

    def retire(ending: Ending) -> None:
        for i in range(per):
            job = SchedulerJob(i, prompt, ReusePolicy.none(), GenerationConfig(), lambda ev: None, 0.0)
            assert sched.book.retire(job, ending, 1.0) and not sched.book.retire(job, ending, 1.0)

    threads = [threading.Thread(target=retire, args=(e,)) for e in endings]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (sched.completed, sched.failed, sched.cancelled, sched.active) == (2 * per, 2 * per, 2 * per, 0)
    assert sched.book.e2e_ewma_s == pytest.approx(1.0)


# ---- 8. one default, one place -----------------------------------------------------------------------

def test_defaults_come_from_blend_defaults():
    from blend.serve import cli

    assert DEFAULT_MAX_TOKENS == DEFAULT_MAX_NEW_TOKENS == GenerationConfig().max_tokens
    assert ServeConfig().dtype == DEFAULT_DTYPE
    actions = {a.dest: a for a in cli.build_parser()._actions}
    assert tuple(actions["dtype"].choices) == DTYPE_NAMES
    assert actions["log_level"].default == DEFAULT_LOG_LEVEL and tuple(actions["log_level"].choices) == LOG_LEVELS
    assert "**uvicorn_options(config, app.state.metrics)" in inspect.getsource(cli.main)  # its uvicorn settings
    options = uvicorn_options(ServeConfig())
    assert options["timeout_graceful_shutdown"] == DEFAULT_GRACEFUL_SHUTDOWN_S == 8
    assert options["limit_concurrency"] == Limits().max_connections
    assert options["http"].head_timeout_s == Limits().head_timeout_s
    assert actions["header_timeout"].default == Limits().head_timeout_s
    assert options["http"].write_timeout_s == Limits().write_timeout_s == actions["write_timeout"].default


# ---- 9. a stream whose client leaves stops its request then, not when the collector runs ---------------

def _stalled_client_stream(app, body: bytes, ended, timeout: float) -> list[str]:
    """Run one request through the app (ASGI, no socket) as a client that reads the first chunk,
    stops reading (the next write waits to drain, as uvicorn's does on a full socket) and goes away;
    then wait, with the event loop still running (as a server's does), until ``ended()``.

    Returns:
        The ASGI message types the app sent.
    """
    async def run() -> list[str]:
        first_chunk = asyncio.Event()
        sent: list[str] = []
        messages = iter([{"type": "http.request", "body": body, "more_body": False}])

        async def receive() -> dict:
            nxt = next(messages, None)
            if nxt is not None:
                return nxt
            await first_chunk.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message["type"])
            if message["type"] == "http.response.body":
                first_chunk.set()
                await asyncio.Event().wait()  # the write never drains: the client reads no more

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/v1/chat/completions",
                 "raw_path": b"/v1/chat/completions", "query_string": b"", "root_path": "",
                 "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
        await app(scope, receive, send)
        deadline = time.monotonic() + timeout
        while not ended() and time.monotonic() < deadline:  # not after asyncio.run: its shutdown closes
            await asyncio.sleep(0.01)                       # every async generator still alive
        return sent

    return asyncio.run(run())


def test_a_stream_whose_client_leaves_while_a_write_waits_is_cancelled_at_once(engine):
    """The disconnect cancels the response while its write waits, which leaves the answer's
    generator suspended at its ``yield``: its ``finally`` (which cancelled the request) ran only
    when the garbage collector reached it. With the collector off, the request decoded every one of
    its tokens, holding its slot and KV; now it leaves the batch at once."""
    app = create_app(engine, ServeConfig(model=TINY, limits=Limits(max_tokens=4000)))
    sched = app.state.scheduler
    sched.start()
    body = json.dumps(chat(max_tokens=3900, stream=True, ignore_eos=True)).encode()
    gc.disable()
    try:
        sent = _stalled_client_stream(app, body, lambda: sched.cancelled + sched.completed >= 1, timeout=60)
        assert sent[:2] == ["http.response.start", "http.response.body"]
        assert (sched.cancelled, sched.completed, sched.active) == (1, 0, 0)
        assert sched.pool.free_slots == sched.pool.slots  # its KV slot is free again
    finally:
        gc.enable()
        sched.close()


# ---- 10. the token rate remembers one window, scraped or not -------------------------------------------

def test_the_token_rate_keeps_one_window_when_nobody_scrapes(monkeypatch):
    """Every decoded token's count was kept until a /metrics scrape pruned it: a server nobody
    scrapes grew by ~90 bytes per token for ever. Counts older than the window go as new ones come,
    and the rate a scrape reads is unchanged."""
    clock = {"now": 0.0}
    monkeypatch.setattr(metrics_module, "time", SimpleNamespace(monotonic=lambda: clock["now"]))
    metrics = ServeMetrics()
    per_s, seconds = 100, 400  # 40,000 tokens, 100 a second
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(per_s * seconds):
            clock["now"] = i / per_s
            metrics.on_tokens(1)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 400_000, grown  # one window (~1,000 counts), not 40,000
    rate = [line for line in metrics.exposition().decode().splitlines()
            if line.startswith("kvblend_output_tokens_per_second ")]
    assert float(rate[0].split()[-1]) == pytest.approx(per_s, rel=0.01)


def test_requests_a_stopping_server_cannot_finish_get_a_503_not_a_500(engine):
    """Shutdown is neither the client's fault nor a bug: a queued request, and one that arrives after the
    scheduler stopped, get 503 (another replica may answer), where both got "internal error: RuntimeError"."""
    from starlette.testclient import TestClient

    from blend.serve.jobs import ShuttingDownError

    app = create_app(engine, ServeConfig(model=TINY, scheduler=SchedulerConfig(max_concurrency=1),
                                         limits=Limits(max_tokens=4000)))
    sched = app.state.scheduler
    sched.start()
    events = []
    prompt = engine.build_prompt("q?", make_docs(1))
    sched.submit(prompt, ReusePolicy.exact(), GenerationConfig(max_tokens=3000, ignore_eos=True), events.append)
    sched.submit(prompt, ReusePolicy.exact(), GenerationConfig(max_tokens=2), events.append)  # waits for the slot
    sched.close()
    failed = [e.error for e in events if e.kind is EventKind.FAILED]
    assert failed and all(isinstance(e, ShuttingDownError) for e in failed)
    r = TestClient(app).post("/v1/chat/completions", json=chat())  # no lifespan: the scheduler stays stopped
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
    assert "shutting down" in r.json()["error"]["message"]


def test_a_stopping_server_answers_queued_requests_at_once_and_ends_running_streams_cleanly(monkeypatch):
    """uvicorn cancels the handlers still running when its grace period ends and only then runs the app's
    shutdown: a stream was cut without an error event or [DONE], and a queued request waited out the whole
    period for uvicorn's plain-text 500. Now the queued one gets a 503 at once and the stream its error."""
    real_emit = RequestBook.emit

    def slow_text(job, event):  # decoding slower than the grace period (2 s in the tests' servers)
        if event.kind is EventKind.TEXT:
            time.sleep(0.005)
        real_emit(job, event)

    monkeypatch.setattr(RequestBook, "emit", staticmethod(slow_text))
    config = ServeConfig(model=TINY, scheduler=SchedulerConfig(max_concurrency=1), limits=Limits(max_tokens=4000))
    with running_server(tiny_serve_engine(), config) as srv:
        lines: list[str] = []
        streamed = threading.Event()

        def stream() -> None:
            body = {**chat(), "max_tokens": 3000, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=30) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    streamed.set()

        queued: list[tuple[httpx.Response, float]] = []

        def wait_in_queue() -> None:
            r = post(srv, chat())
            queued.append((r, time.monotonic()))

        threads = [threading.Thread(target=stream)]
        threads[0].start()
        assert streamed.wait(20)
        threads.append(threading.Thread(target=wait_in_queue))
        threads[1].start()
        wait_until(lambda: srv.scheduler.queue_depth == 1)
        stop = time.monotonic()
        srv.server.should_exit = True  # what SIGTERM does
        for t in threads:
            t.join(20)
        (r, at), = queued
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        assert at - stop < 1.0  # at once, not after the grace period
        data = [line for line in lines if line.startswith("data: ")]
        assert data[-1] == "data: [DONE]"
        assert "shutting" in json.loads(data[-2][len("data: "):])["error"]["message"]


def test_a_request_still_prefilling_when_the_grace_period_ends_gets_a_503():
    """A prefill cannot be interrupted: the scheduler's close failed a request only after its prefill, by
    when uvicorn had cancelled its handler (a plain-text 500). It fails it at once now."""
    engine = tiny_serve_engine()
    real = engine.prefill

    def slow_prefill(*a, **kw):
        time.sleep(3.5)  # longer than the tests' grace period (2 s)
        return real(*a, **kw)

    engine.prefill = slow_prefill
    with running_server(engine) as srv:
        got: list[httpx.Response] = []
        t = threading.Thread(target=lambda: got.append(post(srv, chat())))
        t.start()
        wait_until(lambda: srv.scheduler.active == 1)
        srv.server.should_exit = True
        t.join(20)
    (r,) = got
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"


# ---- hostile text, unhandled errors and long conversations (a review, 2026-12-06 (18)) ------------

def _status_count(app, code: str) -> float:
    from starlette.testclient import TestClient

    text = TestClient(app).get("/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kvblend_requests_total{") and f'status="{code}"' in line)


def test_stream_options_without_stream_is_a_400_naming_the_field(engine):
    """The check spans two fields, so pydantic located its error at the body and ``param`` was null, while every
    other malformed field is named there (README says so)."""
    from starlette.testclient import TestClient

    client = TestClient(create_app(engine, ServeConfig(model=TINY)))
    for stream in (False, None):
        body = {**chat(stream_options={"include_usage": True}), **({} if stream is None else {"stream": stream})}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", r.text


def test_a_lone_surrogate_is_a_400_naming_its_field_and_an_unhandled_error_is_a_counted_500(engine, monkeypatch):
    from starlette.testclient import TestClient

    app = create_app(engine, ServeConfig(model=TINY))
    client = TestClient(app, raise_server_exceptions=False)
    for body, field in ((chat("which \ud800 river?"), "messages.0.content"),
                        ({**chat(), "documents": ["a \udfff b"]}, "documents.0"), ({**chat(), "stop": "\ud800"}, "stop")):
        raw = json.dumps(body).encode()  # JSON escapes the surrogate: valid JSON, not valid text
        r = client.post("/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "lone surrogate" in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == field, r.text  # (it was null: a request-level check has no field)
    import blend.serve.app as app_module

    def broken(*_a, **_kw):
        raise RuntimeError("a bug")

    monkeypatch.setattr(app_module, "prepare", broken)
    before = _status_count(app, "500")
    r = client.post("/v1/chat/completions", json=chat())
    assert r.status_code == 500 and r.json()["error"]["message"] == "internal error: RuntimeError"
    assert _status_count(app, "500") == before + 1  # Starlette sends it from outside the counting middleware


def test_a_conversation_is_never_prepared_on_the_event_loop_and_its_messages_are_bounded(engine, monkeypatch):
    from starlette.testclient import TestClient

    import blend.serve.app as app_module

    app = create_app(engine, ServeConfig(model=TINY, limits=Limits(max_messages=5)))
    seen = []
    real = app_module.run_in_threadpool

    async def spy(fn, *a, **kw):
        seen.append(fn.__name__)
        return await real(fn, *a, **kw)

    monkeypatch.setattr(app_module, "run_in_threadpool", spy)
    with TestClient(app) as client:
        assert client.post("/v1/chat/completions", json=chat()).status_code == 200
        assert "prepare" not in seen  # one short question: tokenized inline
        turns = [{"role": r, "content": f"turn {i}"} for i, r in enumerate(["user", "assistant"] * 2)]
        history = {**chat(), "messages": turns + chat()["messages"]}
        assert client.post("/v1/chat/completions", json=history).status_code == 200
        assert "prepare" in seen  # a conversation: off the event loop (its cost grows faster than its length)
        r = client.post("/v1/chat/completions", json={**chat(), "messages": turns * 2 + chat()["messages"]})
        assert r.status_code == 413 and r.json()["error"]["param"] == "messages"


def test_a_token_named_twice_in_logit_bias_is_refused():
    body = CompletionRequest(prompt="q", logit_bias={"5": 100, "05": 100})
    with pytest.raises(ValueError, match="more than once"):
        body.logit_bias_pairs(259)


def test_completions_top_logprobs_keep_the_most_likely_alternative_of_each_text():
    """Every piece of a multi-byte character decodes to U+FFFD: keyed by text, the least likely one used to win."""
    from blend.logprobs import TokenLogprob
    from blend.serve.protocol import LogprobFormat
    from blend.tiny import byte_tokenizer

    fmt = LogprobFormat(Endpoint.COMPLETIONS, byte_tokenizer(), True)
    entry = TokenLogprob(0xC3, -0.5, ((0xC3, -0.5), (0xE2, -1.0), (ord("a"), -2.0), (0xF0, -3.0)))
    (top,) = fmt.format((entry,))["top_logprobs"]
    assert top == {"\ufffd": -0.5, "a": -2.0}


def test_completions_text_offsets_index_the_answer_text_across_split_characters():
    """A token's text_offset is where its text starts in the answer: adding each token's own decoding (a U+FFFD
    per piece of a split character) ran every later offset past the text."""
    from blend.logprobs import TokenLogprob
    from blend.serve.protocol import LogprobFormat
    from blend.tiny import byte_tokenizer

    tok = byte_tokenizer()
    answer = "é" + "A" + "\u20ac" + "AA"  # 2 + 1 + 3 + 1 + 1 bytes
    ids = tok.encode(answer, add_special_tokens=False)
    cut = LogprobFormat(Endpoint.COMPLETIONS, tok, True)  # a character cut short: its U+FFFD, then the next token
    lead, a = tok.encode("\u20ac", add_special_tokens=False)[0], tok.encode("A", add_special_tokens=False)[0]
    assert cut.format((TokenLogprob(lead, -1.0), TokenLogprob(a, -1.0), TokenLogprob(a, -1.0)))["text_offset"] == \
        [0, 1, 2]  # the text reads "\ufffdAA"
    fmt = LogprobFormat(Endpoint.COMPLETIONS, tok, True)
    got = fmt.format(tuple(TokenLogprob(i, -1.0) for i in ids[:4]))  # in two chunks, as a stream sends them
    more = fmt.format(tuple(TokenLogprob(i, -1.0) for i in ids[4:]))
    offsets, tokens = got["text_offset"] + more["text_offset"], got["tokens"] + more["tokens"]
    assert len(ids) == 8 and offsets == [0, 0, 1, 2, 2, 2, 3, 4]
    for t, off in zip(tokens, offsets):
        assert t == "\ufffd" or answer[off:off + len(t)] == t
    special = LogprobFormat(Endpoint.COMPLETIONS, tok, True)  # a special token's text is not in the answer
    eos = tok.eos_token_id
    a, b = tok.encode("ab", add_special_tokens=False)
    got = special.format(tuple(TokenLogprob(i, -1.0) for i in (a, eos, b, eos)))["text_offset"]
    assert got == [0, 1, 1, 2]


def test_a_stream_whose_last_chunk_cannot_be_built_ends_with_an_error_not_a_cut(engine, monkeypatch):
    """An exception while building the final chunk (a bug in the report's extension, say) cut the stream
    without an error event or [DONE]: the playground showed "network error"."""
    from starlette.testclient import TestClient

    import blend.serve.app as app_module

    app = create_app(engine, ServeConfig(model=TINY))
    monkeypatch.setattr(app_module, "kvblend_extension", lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("bug")))
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.post("/v1/chat/completions", json={**chat(), "stream": True, "max_tokens": 2})
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "internal error: RuntimeError" in json.loads(events[-2])["error"]["message"]


def test_a_follow_up_is_measured_as_the_prompt_builder_takes_its_texts(engine):
    """The conversation pre-check counted the texts as sent: padding the prompt builder strips refused a
    follow-up over a document the first turn had taken. A message's text parts are joined by a newline
    (as vLLM joins them), not glued into one word."""
    doc = "The ferry is named Marigold." + " \n" * (engine.dims.max_positions + 10)
    first = ChatCompletionRequest(messages=[{"role": "user", "content": "Which ferry?"}], documents=[doc])
    follow = ChatCompletionRequest(messages=[{"role": "user", "content": "Which ferry?"},
                                             {"role": "assistant", "content": "Marigold."},
                                             {"role": "user", "content": "Where to?"}], documents=[doc])
    assert len(_prepare(engine, first).prompt) < 400
    assert len(_prepare(engine, follow).prompt) < 400  # was a 400: "the conversation's texts alone are ..."
    parts = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "Who built"},
                                                                         {"type": "text", "text": "it?"}]}])
    assert parts.messages[0].text() == "Who built\nit?"
