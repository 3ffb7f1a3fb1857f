"""The server against ill-behaved clients: answer-changing fields it cannot honour, numbers that are not finite,
bodies that are not JSON, clients that leave before their first token (their prefill stops), and clients that
stop reading their stream (tiny model)."""

from __future__ import annotations

import asyncio
import copy
import json
import socket
import threading
import time
from typing import Iterator, get_args, get_origin

import httpx
import pytest
from pydantic import BaseModel
from starlette.testclient import TestClient

import blend.model
from _serve_util import (  # noqa: F401 - fixtures
    TINY, Collector, make_scheduler, one_torch_thread, running_server, tiny_serve_engine, wait_until,
)
from blend.policy import ReusePolicy
from blend.sampling import GenerationConfig
from blend.serve.app import create_app
from blend.serve.config import Limits, SchedulerConfig, ServeConfig
from blend.serve.jobs import EventKind
from blend.serve.schemas import CHAT_UNDECLARED_NEUTRAL, UNDECLARED_NEUTRAL, ChatCompletionRequest, CompletionRequest
from conftest import make_docs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DOCS = make_docs(2, words=20, seed=4)


def chat(**kw) -> dict:
    return {"model": TINY, "messages": [{"role": "user", "content": "which river?"}], "max_tokens": 2,
            "temperature": 0, **kw}


class HeldPrefill:
    """An engine's prefill that waits, while ``hold`` is set, until the test releases it."""

    def __init__(self, engine) -> None:
        self.real = engine.prefill
        self.hold = False
        self.entered = threading.Event()
        self.release = threading.Event()
        engine.prefill = self

    def __call__(self, *args, **kw):
        if self.hold:
            self.entered.set()
            assert self.release.wait(30)
        return self.real(*args, **kw)


@pytest.fixture(scope="module")
def app_client(one_torch_thread):
    with TestClient(create_app(tiny_serve_engine(), ServeConfig(model=TINY))) as client:
        yield client


# ---- fields that would change the answer: refused, never dropped -------------------------------------------

ASKING = {  # a value of each that asks for something
    "guided_json": {"type": "object"}, "guided_regex": "yes|no", "guided_choice": ["yes", "no"],
    "guided_grammar": "root ::= 'a'", "structured_outputs": {"choice": ["a", "b"]}, "allowed_token_ids": [5, 6],
    "bad_words": ["river"], "prompt_logprobs": 1, "truncate_prompt_tokens": 8, "return_tokens_as_token_ids": True,
    "logits_processors": ["pkg.Processor"],
    "echo": True, "add_generation_prompt": False, "continue_final_message": True, "chat_template": "{{ 1 }}",
    "chat_template_kwargs": {"enable_thinking": False}, "mm_processor_kwargs": {"fps": 1}, "reasoning_effort": "low",
    "function_call": {"name": "lookup"}, "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"], "web_search_options": {}, "verbosity": "low",
}


@pytest.mark.parametrize("name", sorted({**UNDECLARED_NEUTRAL, **CHAT_UNDECLARED_NEUTRAL}))
def test_an_answer_changing_field_the_server_cannot_honour_is_a_400_naming_it(app_client, name):
    """These fields were not declared by the request schemas, so pydantic dropped them and the request was
    answered as if they had not been sent: vLLM's guided_choice ["yes", "no"] got free text, OpenAI's
    audio output a text answer, function_call a plain reply."""
    r = app_client.post("/v1/chat/completions", json=chat(**{name: ASKING[name]}))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == name and f"{name} is not supported" in err["message"]
    if name in UNDECLARED_NEUTRAL:  # both endpoints
        body = {"model": TINY, "prompt": "which river?", "max_tokens": 2, name: ASKING[name]}
        r = app_client.post("/v1/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == name


def test_those_fields_at_values_that_ask_for_nothing_are_accepted(app_client):
    for pick in (0, -1):  # null, then each one's other neutral value
        neutral = {name: values[pick] for name, values in {**UNDECLARED_NEUTRAL, **CHAT_UNDECLARED_NEUTRAL}.items()}
        assert app_client.post("/v1/chat/completions", json=chat(**neutral)).status_code == 200
    # hints that change nothing kvblend computes stay accepted and ignored
    assert app_client.post("/v1/chat/completions", json=chat(user="u", metadata={"k": "v"}, store=False,
                                                               prediction={"type": "content", "content": "x"},
                                                               parallel_tool_calls=True, priority=0)).status_code == 200


def test_verbosity_other_than_openais_default_is_refused(app_client):
    """OpenAI's verbosity (low, medium, high) sets how long and detailed an answer its models write: it was
    dropped unread, so "low" got the answer "high" would. Its default, "medium", asks for nothing."""
    for value in ("low", "high"):
        r = app_client.post("/v1/chat/completions", json=chat(verbosity=value))
        assert r.status_code == 400 and r.json()["error"]["param"] == "verbosity", r.text
    assert app_client.post("/v1/chat/completions", json=chat(verbosity="medium")).status_code == 200


def _answer(client, **kw) -> str:
    r = client.post("/v1/chat/completions", json={**chat(max_tokens=12, ignore_eos=True), "documents": DOCS, **kw})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_spaces_between_special_tokens_changes_nothing_and_is_accepted_either_way(app_client):
    """vLLM's option is about spaces around special tokens in the text; kvblend's text never holds one
    (skip_special_tokens is true) and its decoding has no such option: both values give the same answer."""
    plain = _answer(app_client)
    assert _answer(app_client, spaces_between_special_tokens=False) == plain
    assert _answer(app_client, spaces_between_special_tokens=True) == plain
    r = app_client.post("/v1/chat/completions", json=chat(spaces_between_special_tokens="no"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "spaces_between_special_tokens"


def test_add_special_tokens_true_is_refused_only_where_the_tokenizer_would_add_one(app_client):
    """vLLM's add_special_tokens: true puts the tokenizer's special tokens (Llama's BOS) in front of the prompt;
    it was dropped unread. The tiny model's tokenizer, like SmolLM2's and Qwen2's, adds none: both values give
    the answer kvblend gives without it. One that adds a BOS refuses true and takes false."""
    from tokenizers import processors

    plain = _answer(app_client)
    assert _answer(app_client, add_special_tokens=True) == _answer(app_client, add_special_tokens=False) == plain
    engine = tiny_serve_engine()
    tok = engine.tokenizer = copy.deepcopy(engine.tokenizer)
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{tok.bos_token} $A", special_tokens=[(tok.bos_token, tok.bos_token_id)])
    assert tok("a")["input_ids"] == [tok.bos_token_id, *tok("a", add_special_tokens=False)["input_ids"]]
    with TestClient(create_app(engine, ServeConfig(model=TINY))) as client:
        for endpoint, body in (("/v1/chat/completions", chat()),
                               ("/v1/completions", {"model": TINY, "prompt": "which river?", "max_tokens": 2})):
            r = client.post(endpoint, json={**body, "add_special_tokens": True})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "add_special_tokens" and "BOS" in r.json()["error"]["message"]
            assert client.post(endpoint, json={**body, "add_special_tokens": False}).status_code == 200
            assert client.post(endpoint, json=body).status_code == 200


def test_add_special_tokens_is_probed_once_per_tokenizer_not_per_request(monkeypatch):
    """Each request sending add_special_tokens: true tokenized a probe text twice to learn what the
    tokenizer does; that is a property of the tokenizer, now probed once with its other derived state (its
    control tokens). Every such request is still refused where the tokenizer adds a BOS."""
    from tokenizers import processors

    engine = tiny_serve_engine()
    tok = engine.tokenizer = copy.deepcopy(engine.tokenizer)  # a tokenizer of its own, which adds a BOS
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{tok.bos_token} $A", special_tokens=[(tok.bos_token, tok.bos_token_id)])
    probes = []  # calls of this tokenizer that ask for its special tokens (the layout never does)
    real = type(tok).__call__

    def counting(self, *args, **kw):
        if self is tok and kw.get("add_special_tokens", True):
            probes.append(args)
        return real(self, *args, **kw)

    monkeypatch.setattr(type(tok), "__call__", counting)
    with TestClient(create_app(engine, ServeConfig(model=TINY))) as client:
        for _ in range(3):
            for endpoint, body in (("/v1/chat/completions", chat()),
                                   ("/v1/completions", {"model": TINY, "prompt": "which river?", "max_tokens": 2})):
                r = client.post(endpoint, json={**body, "add_special_tokens": True})
                assert r.status_code == 400 and r.json()["error"]["param"] == "add_special_tokens", r.text
                assert client.post(endpoint, json={**body, "add_special_tokens": False}).status_code == 200
    assert len(probes) == 1, probes  # six requests asked; one probe


# ---- bodies that are not JSON: a 400 that says why ---------------------------------------------------------------

@pytest.mark.parametrize("content, headers, needle", [
    (json.dumps(chat()).encode(), {"content-type": "text/plain"}, "Content-Type: application/json' (got 'text/plain')"),
    (json.dumps(chat()).encode(), {"content-type": "application/x-www-form-urlencoded"}, "(got 'application/x-www"),
    (json.dumps(chat()).encode(), {}, "no Content-Type was sent"),
    (b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
     {"content-type": "application/json"}, "not valid UTF-8 (byte 0xff at offset 66)"),
    (b"[" * 50_000 + b"]" * 50_000, {"content-type": "application/json"}, "nested too deeply"),
    (b"[1, 2]", {"content-type": "application/json"}, "the request body must be a JSON object"),
    (b"", {"content-type": "application/json"}, "must be a JSON object (it is empty)"),
])
def test_a_body_that_is_not_a_json_object_gets_a_400_saying_why(app_client, content, headers, needle):
    """Each was a 400 that named no cause: "body: Input should be a valid dictionary or object to extract
    fields from" for JSON sent as text/plain, form-encoded (``curl -d`` without a header) or with no
    Content-Type, "There was an error parsing the body" for bytes that are not UTF-8 or nest too deeply."""
    r = app_client.post("/v1/chat/completions", content=content, headers=headers)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error"
    assert app_client.post("/v1/chat/completions", json=chat()).status_code == 200  # JSON stays the way in


# ---- numbers that are not finite: a 400 that says so -----------------------------------------------------------

def _float_paths(annotation, path: tuple[str, ...]) -> Iterator[tuple[str, ...]]:
    """Where a float sits in a field's type: the field itself, a dict's values (under key "5"), a nested model's
    fields."""
    if annotation is float:
        yield path
    elif isinstance(annotation, type) and issubclass(annotation, BaseModel):
        for name, field in annotation.model_fields.items():
            yield from _float_paths(field.annotation, (*path, name))
    elif get_origin(annotation) is dict:
        yield from _float_paths(get_args(annotation)[1], (*path, "5"))
    else:
        for arg in get_args(annotation):
            yield from _float_paths(arg, path)


def _with(body: dict, path: tuple[str, ...], value) -> dict:
    body = json.loads(json.dumps(body))
    at = body
    for key in path[:-1]:
        at = at.setdefault(key, {})
    at[path[-1]] = value
    return body


FLOAT_PATHS = {endpoint: sorted(set(_float_paths(model, ()))) for endpoint, model in
               (("/v1/chat/completions", ChatCompletionRequest), ("/v1/completions", CompletionRequest))}


@pytest.mark.parametrize("endpoint", sorted(FLOAT_PATHS))
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_every_number_field_refuses_nan_and_infinity_as_not_finite(app_client, endpoint, value):
    """Python's JSON reads NaN, Infinity and -Infinity; a float field without its own finiteness check failed its
    range check instead: "temperature": NaN was told "Input should be less than or equal to 2", Infinity in a
    logit_bias "must be in [-100, 100], got inf", and a NaN min_p "is not supported"."""
    paths = FLOAT_PATHS[endpoint]
    assert {("temperature",), ("top_p",), ("presence_penalty",), ("frequency_penalty",), ("logit_bias", "5"),
            ("min_p",), ("repetition_penalty",), ("kvblend", "ratio"), ("kvblend", "guard_margin"),
            ("kvblend", "candidates"), ("kvblend", "reused_temperature")} <= set(paths)
    base = chat() if endpoint == "/v1/chat/completions" else {"model": TINY, "prompt": "which river?", "max_tokens": 2}
    for path in paths:
        content = json.dumps(_with(base, path, float(value)))  # NaN / Infinity / -Infinity as JSON tokens
        assert value in content
        r = app_client.post(endpoint, content=content, headers={"content-type": "application/json"})
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        assert err["param"] == ".".join(path), (path, err)
        assert f"{'.'.join(path)}: Input should be a finite number" in err["message"], (path, err)
    for name in ("seed", "max_tokens", "top_k"):  # integers: a float is not one
        content = json.dumps({**base, name: float(value)})
        r = app_client.post(endpoint, content=content, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "Input should be a valid integer" in r.json()["error"]["message"], r.text


# ---- a client that leaves before its first token --------------------------------------------------------------

@pytest.mark.parametrize("max_tokens", [1, 40])
def test_a_request_whose_client_leaves_during_its_prefill_is_not_answered_and_counts_as_cancelled(
        make_scheduler, max_tokens):
    """After its prefill, a request whose client had left was sent its first token and went on into a
    decode-pool slot (its KV copied there) until the decode loop's next iteration retired it, and a
    one-token answer was counted completed. It is retired at once now (its prefill, cancelled before its
    first layer here, stops there)."""
    engine = tiny_serve_engine()
    held = HeldPrefill(engine)
    sched = make_scheduler(engine, max_concurrency=2)
    held.hold = True
    events = []
    config = GenerationConfig(max_tokens=max_tokens, ignore_eos=True)
    ticket = sched.submit(engine.build_prompt("q?", DOCS), ReusePolicy.exact(), config, events.append)
    assert held.entered.wait(30)
    ticket.cancel()  # its client went away
    held.release.set()
    wait_until(lambda: sched.active == 0)
    assert (sched.cancelled, sched.completed, sched.failed) == (1, 0, 0)
    assert events == []  # nobody to tell
    assert sched.pool.free_slots == sched.pool.slots and sched.flight.claimed() == 0


class SlowLayers:
    """A hook on the model's layer function, which every prefill pass runs (the decode loop's batched step has
    its own): counts the layers run, each taking ``delay_s`` longer (a long prefill on a tiny model)."""

    def __init__(self, monkeypatch, delay_s: float = 0.0) -> None:
        real = blend.model.layer_forward
        self.calls, self.delay_s = 0, delay_s

        def layer(*args, **kw):
            self.calls += 1
            time.sleep(self.delay_s)
            return real(*args, **kw)

        monkeypatch.setattr(blend.model, "layer_forward", layer)


LONG_DOCS = make_docs(4, words=40, seed=9)


def _answer_tokens(sched, prompt, policy) -> tuple[int, ...]:
    got = Collector()
    sched.submit(prompt, policy, GenerationConfig(max_tokens=8, ignore_eos=True), got.sink(0))
    got.wait(1)
    assert got.last(0).kind is EventKind.DONE
    return tuple(got.last(0).completion.token_ids)


@pytest.mark.parametrize("policy", [ReusePolicy.exact(), ReusePolicy.blend(ratio=0.3), ReusePolicy.none()],
                         ids=["exact", "blend", "none"])
def test_a_prefill_whose_client_leaves_stops_at_its_next_layer(make_scheduler, monkeypatch, policy):
    """A running prefill was not interrupted when its client left: every layer of every segment still ran, for
    nobody. The scheduler now runs it cancellable, and it stops before its next layer; nothing of it is left
    half done: the same request asked again gets the answer of an engine that never saw it."""
    layers = SlowLayers(monkeypatch)
    reference = make_scheduler(tiny_serve_engine(), max_concurrency=2)
    prompt = reference.engine.build_prompt("which river?", LONG_DOCS)
    expected = _answer_tokens(reference, prompt, policy)
    whole = layers.calls  # the layers one uninterrupted prefill runs (a few decode steps run no layer_forward)
    assert whole >= 12
    engine = tiny_serve_engine()
    sched = make_scheduler(engine, max_concurrency=2)
    layers.calls, layers.delay_s = 0, 0.05
    events = []
    ticket = sched.submit(engine.build_prompt("which river?", LONG_DOCS), policy,
                          GenerationConfig(max_tokens=8, ignore_eos=True), events.append)
    wait_until(lambda: layers.calls >= 2)
    ticket.cancel()  # its client went away
    at_cancel = layers.calls
    wait_until(lambda: sched.active == 0)
    assert layers.calls <= at_cancel + 1 < whole  # the layer running then finished; no other began
    assert sched.interrupted_prefills == 1 and (sched.cancelled, sched.completed, sched.failed) == (1, 0, 0)
    assert events == [] and sched.pool.free_slots == sched.pool.slots and sched.flight.claimed() == 0
    d, held = engine.dims, engine.runner.kv_pool.stats()
    own_cache = 2 * d.num_layers * d.num_kv_heads * (len(prompt) + 8) * d.head_dim * engine.runner.dtype.itemsize
    assert held.pending_bytes == 0 and held.free_bytes >= own_cache  # its cache went back to the pool
    layers.delay_s = 0.0
    assert _answer_tokens(sched, prompt, policy) == expected  # what it stored (the segments it finished) is whole
    assert sched.dead_threads() == []


def test_a_client_that_leaves_during_a_long_prefill_stops_it_and_the_server_stays_healthy(monkeypatch):
    layers = SlowLayers(monkeypatch, delay_s=0.05)
    config = ServeConfig(model=TINY, scheduler=SchedulerConfig(max_concurrency=2))
    with running_server(tiny_serve_engine(), config) as srv:
        sched = srv.scheduler
        sock = _raw_request(srv.url, {**chat(max_tokens=8, ignore_eos=True, stream=True), "documents": LONG_DOCS})
        wait_until(lambda: layers.calls >= 2)
        sock.close()  # before its first token: the prefill had ~24 layers to go
        wait_until(lambda: sched.active == 0)
        assert layers.calls <= 6 and sched.interrupted_prefills == 1 and sched.cancelled == 1
        assert _gauge(srv.url, "kvblend_interrupted_prefills_total") == 1
        assert _gauge(srv.url, "kvblend_active_requests") == 0 and sched.flight.claimed() == 0
        layers.delay_s = 0.0
        assert httpx.get(srv.url + "/health").json()["status"] == "ok"
        r = httpx.post(srv.url + "/v1/chat/completions", json={**chat(max_tokens=8, ignore_eos=True),
                                                             "documents": LONG_DOCS}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8


def _gauge(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    return float(next(line for line in text.splitlines() if line.startswith(name + " ")).split()[-1])


def _raw_request(url: str, body: dict, rcvbuf: int | None = None) -> socket.socket:
    """A connection that sent one chat request (and reads nothing), with a receive buffer of ``rcvbuf`` bytes."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    if rcvbuf is not None:  # before connecting: the window it offers follows it
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect((host, int(port)))
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return sock


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_during_its_prefill_frees_its_slot_claims_and_gauges(stream):
    engine = tiny_serve_engine()
    held = HeldPrefill(engine)
    config = ServeConfig(model=TINY, scheduler=SchedulerConfig(max_concurrency=2))
    with running_server(engine, config) as srv:
        sched = srv.scheduler
        held.hold = True
        sock = _raw_request(srv.url, {**chat(max_tokens=30, ignore_eos=True, stream=stream), "documents": DOCS})
        assert held.entered.wait(30)
        assert sched.flight.claimed() > 0 and _gauge(srv.url, "kvblend_active_requests") == 1
        sock.close()  # before its first token (a stream has not even its headers)
        wait_until(lambda: all(job.cancelled.is_set() for job in list(sched.book.prefilling_jobs)))
        held.release.set()
        wait_until(lambda: sched.active == 0)
        assert (sched.cancelled, sched.completed) == (1, 0)
        assert sched.flight.claimed() == 0 and sched.pool.free_slots == sched.pool.slots
        assert _gauge(srv.url, "kvblend_active_requests") == 0 and _gauge(srv.url, "kvblend_queue_depth") == 0
        held.hold = False  # its prefill stopped before its first layer: it stored nothing
        assert sched.interrupted_prefills == 1 and _gauge(srv.url, "kvblend_interrupted_prefills_total") == 1
        r = httpx.post(srv.url + "/v1/chat/completions", json={**chat(), "documents": DOCS}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


# ---- a client that stops reading its stream -----------------------------------------------------------------

def _scope(body: bytes) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
            "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2),
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}


def test_a_client_that_stops_reading_its_stream_holds_up_no_other_request():
    """Backpressure is per connection: a stream whose client reads nothing more (its next write waits to drain,
    for ever, and it never disconnects) keeps decoding to its end, which frees its slot and KV, and another
    request is answered meanwhile. (Run through the ASGI app: a socket's buffers would take megabytes.)"""
    app = create_app(tiny_serve_engine(), ServeConfig(model=TINY, limits=Limits(max_tokens=2000)))
    sched = app.state.scheduler
    sched.start()

    async def run() -> None:
        body = json.dumps(chat(max_tokens=300, ignore_eos=True, stream=True)).encode()
        requested, stalled = False, asyncio.Event()

        async def receive() -> dict:
            nonlocal requested
            if not requested:
                requested = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # connected, silent
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            if message["type"] == "http.response.body":
                stalled.set()
                await asyncio.Event().wait()  # the first chunk's write never drains

        slow = asyncio.ensure_future(app(_scope(body), receive, send))
        await asyncio.wait_for(stalled.wait(), 30)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client:
            r = await client.post("/v1/chat/completions", json=chat(max_tokens=50, ignore_eos=True), timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 50
        for _ in range(3000):  # the stalled stream's request decodes on to its end
            if sched.completed == 2:
                break
            await asyncio.sleep(0.01)
        assert (sched.completed, sched.cancelled, sched.active) == (2, 0, 0)
        assert sched.pool.free_slots == sched.pool.slots and not slow.done()  # its writer still waits
        slow.cancel()

    try:
        asyncio.run(run())
    finally:
        sched.close()


WRITE_TIMEOUT_S = 1.0
CHUNKED_END = b"\r\n0\r\n\r\n"  # the last chunk of a chunked (streamed) body


@pytest.fixture
def small_buffer_server():
    """A server whose connections have small socket buffers (a few KB each way, with the client's receive buffer
    set small too), so an answer of ~200 KB fills them: its write timeout is WRITE_TIMEOUT_S, its connection cap 2."""
    config = ServeConfig(model=TINY, limits=Limits(max_tokens=400, write_timeout_s=WRITE_TIMEOUT_S, max_connections=2))
    with running_server(tiny_serve_engine(), config) as srv:
        listener = srv.server.servers[0].sockets[0]
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # accepted connections inherit it
        yield srv


def _long_answer(stream: bool) -> dict:
    """~1.4 KB per token with 20 alternatives each: 150 tokens are ~210 KB, past every buffer on the way."""
    return chat(max_tokens=150, ignore_eos=True, stream=stream, logprobs=True, top_logprobs=20)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_stops_reading_is_cut_after_the_write_timeout_and_its_slot_freed(small_buffer_server, stream):
    """A client that stopped reading but stayed connected kept its connection after its answer was decoded: the
    stream's next write (or a finished response's close) waited for its socket to drain, for ever, so its slot under
    --max-connections, its buffers and its queued text were held until it left, and enough such clients locked
    everyone out. Once it takes no bytes for the write timeout, the connection is aborted and counted."""
    srv = small_buffer_server
    sched, connections = srv.scheduler, srv.server.server_state.connections
    t0 = time.monotonic()
    sock = _raw_request(srv.url, _long_answer(stream), rcvbuf=4096)
    wait_until(lambda: sched.completed + sched.cancelled == 1)  # decoded to its end (or cut before, on a slow box)
    decoded = time.monotonic()
    wait_until(lambda: not connections, timeout=20)
    closed = time.monotonic()
    assert WRITE_TIMEOUT_S <= closed - t0  # not before the client had the whole timeout
    assert closed - decoded <= 1.25 * WRITE_TIMEOUT_S + 1.0  # once nothing moves: the timeout (a quarter to notice)
    assert _gauge(srv.url, "kvblend_write_timeouts_total") == 1
    assert sched.active == 0 and sched.pool.free_slots == sched.pool.slots
    got = b""
    sock.settimeout(5)
    try:
        while chunk := sock.recv(1 << 16):
            got += chunk
    except ConnectionResetError:
        pass
    sock.close()
    assert got and not got.endswith(CHUNKED_END if stream else b"}")  # cut: the rest of its answer was dropped
    r = httpx.post(srv.url + "/v1/chat/completions", json=chat(), timeout=30)  # its slot is free
    assert r.status_code == 200


@pytest.mark.parametrize("stream", [True, False])
def test_a_slow_client_that_keeps_reading_gets_its_whole_answer(small_buffer_server, stream):
    """The write timeout is between two takes, not for the whole answer: a client that reads in bursts, pausing
    under the timeout each time but for far longer than it in all, is never cut. (A stream's writes pause and
    resume as it reads; a whole JSON body is written at once and goes down a burst at a time.)"""
    srv = small_buffer_server
    body = {**_long_answer(stream), **({"stream_options": {"include_usage": True}} if stream else {})}
    sock = _raw_request(srv.url, body, rcvbuf=4096)
    got, paused, closed = b"", 0.0, False
    sock.settimeout(5)

    def whole() -> bool:
        head, _, content = got.partition(b"\r\n\r\n")
        if stream:
            return got.endswith(CHUNKED_END)
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), None)
        return length is not None and len(content) == length

    while not (closed or whole()):
        time.sleep(0.6 * WRITE_TIMEOUT_S)  # the server waits on it meanwhile (its buffers are full)
        paused += 0.6 * WRITE_TIMEOUT_S
        burst = len(got) + 48 * 1024  # then it takes 48 KB (about a quarter of the answer)
        while len(got) < burst and not (closed or whole()):
            chunk = sock.recv(burst - len(got))
            closed = not chunk
            got += chunk
    sock.close()
    assert got.startswith(b"HTTP/1.1 200") and whole(), got[-200:]
    if stream:
        assert got.endswith(b"data: [DONE]\n\n" + CHUNKED_END) and b'"completion_tokens":150,' in got
    else:
        assert json.loads(got.partition(b"\r\n\r\n")[2])["usage"]["completion_tokens"] == 150
    assert paused > 2 * WRITE_TIMEOUT_S  # it kept the server waiting longer than the timeout, in all
    assert _gauge(srv.url, "kvblend_write_timeouts_total") == 0
    assert srv.scheduler.completed == 1 and srv.scheduler.cancelled == 0
