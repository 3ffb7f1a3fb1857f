"""The chat API's documents inside vLLM (issue 17): kvblend lays out the prompt, the middleware
rewrites the request into a completions request and the answer back into a chat completion.

No vLLM here: the rewrite is pure, and the middleware runs over a fake completions app.
The real server with the connector is tested in ``tests/vllm_connector``.
"""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

from blend.errors import InvalidRequestError
from blend.integrations.vllm.chat import (
    ChunkConverter, TokenNamer, chat_to_completion, completion_to_chat, is_kvblend_chat,
)
from blend.integrations.vllm.middleware import STREAM_KEY, DocumentsMiddleware
from blend.integrations.vllm.plan import PARAMS_KEY, parse_blend_params, prompt_spans, salt_allows_blend
from blend.prompt import Role, Turn, build_prompt
from blend.tiny import byte_tokenizer

TOK = byte_tokenizer()
DOCS = ["Paris is the capital of France.", {"title": "Rome", "text": "Rome is in Italy."}]
TEXTS = ["Paris is the capital of France.", "Rome\nRome is in Italy."]


def chat_body(**kw) -> dict:
    body = {"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "Where is Rome?"}],
            "documents": DOCS, "kv_transfer_params": {PARAMS_KEY: {"mode": "blend", "ratio": 0.15}},
            "temperature": 0, "max_completion_tokens": 8, "seed": 3, "stop": ["\n"]}
    body.update(kw)
    return body


def test_an_explicit_max_tokens_holds_when_max_completion_tokens_is_null():
    assert chat_to_completion(chat_body(max_completion_tokens=None, max_tokens=50), TOK)["max_tokens"] == 50
    assert chat_to_completion(chat_body(max_tokens=50), TOK)["max_tokens"] == 8  # max_completion_tokens wins


def test_a_blend_chat_becomes_a_completion_over_kvblends_own_prompt():
    rw = chat_to_completion(chat_body(cache_salt="tenant-a"), TOK)
    want = build_prompt(TOK, "Where is Rome?", TEXTS, "Be brief.")
    assert rw["prompt"] == want.token_ids  # the prompt kvblend serve and the Python API build
    spans = prompt_spans([len(s) for s in want.segments])
    params = parse_blend_params(rw["kv_transfer_params"], len(want))
    assert params.spans == tuple(spans) and params.ratio == 0.15
    assert salt_allows_blend(rw["cache_salt"], params, want.token_ids)  # the connector takes the blend
    assert rw["cache_salt"].startswith("tenant-a|")  # the tenant's salt stays in front
    assert rw["max_tokens"] == 8 and rw["seed"] == 3 and rw["stop"] == ["\n"]
    assert rw["temperature"] == 0 and rw["model"] == "m"
    assert not {"messages", "documents", "max_completion_tokens"} & set(rw)


def test_a_chat_may_ask_for_the_near_tie_guard():
    rw = chat_to_completion(chat_body(), TOK)
    assert parse_blend_params(rw["kv_transfer_params"], len(rw["prompt"])).guard_margin is None  # opt-in in vLLM
    on = chat_to_completion(chat_body(kv_transfer_params={PARAMS_KEY: {"mode": "blend", "guard_margin": 0.7}}), TOK)
    p = parse_blend_params(on["kv_transfer_params"], len(on["prompt"]))
    assert p.guard_margin == 0.7 and salt_allows_blend(on["cache_salt"], p, on["prompt"])
    assert on["cache_salt"] != rw["cache_salt"]  # guarded and unguarded blocks never share vLLM's prefix cache


def test_a_chat_may_ask_for_bf16_recomputed_rows():
    from blend.policy import RecomputePrecision

    plain = chat_to_completion(chat_body(), TOK)
    entry = {"mode": "blend", "attention_precision": "bf16", "linear_precision": "bf16"}
    fast = chat_to_completion(chat_body(kv_transfer_params={PARAMS_KEY: entry}), TOK)
    p = parse_blend_params(fast["kv_transfer_params"], len(fast["prompt"]))
    assert p.attention_precision is p.linear_precision is RecomputePrecision.BF16
    assert salt_allows_blend(fast["cache_salt"], p, fast["prompt"]) and fast["cache_salt"] != plain["cache_salt"]
    with pytest.raises(InvalidRequestError, match="attention_precision"):
        chat_to_completion(chat_body(kv_transfer_params={PARAMS_KEY: {"attention_precision": "fp8"}}), TOK)


def test_a_conversation_keeps_its_turns_and_the_documents_spans():
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is Paris?"},
             {"role": "assistant", "content": "France."}, {"role": "user", "content": "Where is Rome?"}]
    rw = chat_to_completion(chat_body(messages=turns), TOK)
    want = build_prompt(TOK, "Where is Rome?", TEXTS, "Be brief.",
                        (Turn(Role.USER, "Where is Paris?"), Turn(Role.ASSISTANT, "France.")))
    assert rw["prompt"] == want.token_ids
    params = parse_blend_params(rw["kv_transfer_params"], len(want))
    assert params.spans == tuple(prompt_spans([len(s) for s in want.segments]))
    single = build_prompt(TOK, "Where is Rome?", TEXTS, "Be brief.")
    assert params.spans == tuple(prompt_spans([len(s) for s in single.segments]))  # the same chunks, same places


def test_an_exact_chat_keeps_its_salt_and_names_no_spans():
    rw = chat_to_completion(chat_body(cache_salt="t", kv_transfer_params={PARAMS_KEY: {"mode": "exact"}}), TOK)
    assert rw["cache_salt"] == "t" and rw["kv_transfer_params"] == {PARAMS_KEY: {"mode": "exact"}}
    assert rw["prompt"] == build_prompt(TOK, "Where is Rome?", TEXTS, "Be brief.").token_ids


def test_only_chats_with_documents_and_a_kvblend_entry_are_rewritten():
    assert is_kvblend_chat(chat_body())
    assert not is_kvblend_chat(chat_body(documents=None))
    assert not is_kvblend_chat(chat_body(documents=[]))
    assert not is_kvblend_chat(chat_body(kv_transfer_params=None))
    assert not is_kvblend_chat(chat_body(kv_transfer_params={"other": 1}))
    assert not is_kvblend_chat([1, 2])


@pytest.mark.parametrize("change, message", [
    ({"kv_transfer_params": {PARAMS_KEY: {"documents": [[1, 4]]}}}, "finds their token spans"),
    ({"kv_transfer_params": {PARAMS_KEY: {"ratio": 2.0}}}, "ratio"),
    ({"kv_transfer_params": {PARAMS_KEY: {"ration": 0.2}}}, "unknown kvblend option"),
    ({"kv_transfer_params": {PARAMS_KEY: {"mode": "none"}}}, "mode"),
    ({"kv_transfer_params": {PARAMS_KEY: {"selector": "nope"}}}, "selector"),
    ({"kv_transfer_params": {PARAMS_KEY: 3}}, "must be an object"),
    ({"tools": [{"type": "function"}]}, "'tools' is not supported"),
    ({"top_logprobs": 2}, "top_logprobs needs logprobs: true"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs must be an integer"),
    ({"logprobs": "yes"}, "logprobs must be true or false"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
     "last message must be the user's question"),
    ({"messages": "hi"}, "messages"),
    ({"documents": ["ok", "   "]}, "document 2 is empty"),
    ({"documents": [{"txt": "x"}]}, "documents"),
    ({"cache_salt": 5}, "cache_salt"),
])
def test_a_malformed_kvblend_chat_is_refused_clearly(change, message):
    with pytest.raises(InvalidRequestError, match=message):
        chat_to_completion(chat_body(**change), TOK)


COMPLETION = {"id": "cmpl-abc", "object": "text_completion", "created": 7, "model": "m",
              "choices": [{"index": 0, "text": "Italy", "finish_reason": "stop", "stop_reason": None}],
              "usage": {"prompt_tokens": 90, "completion_tokens": 2, "total_tokens": 92},
              "kv_transfer_params": {PARAMS_KEY: {"claim": "blend"}}}


def test_a_completion_answer_goes_back_as_a_chat_completion():
    chat = completion_to_chat(COMPLETION)
    assert chat["id"] == "chatcmpl-abc" and chat["object"] == "chat.completion"
    assert chat["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Italy"}, "logprobs": None,
                                "finish_reason": "stop", "stop_reason": None}]
    assert chat["usage"] == COMPLETION["usage"] and chat["kv_transfer_params"] == COMPLETION["kv_transfer_params"]


LOGPROBS = {"tokens": ["It", "aly"], "token_logprobs": [-0.1, -0.5], "text_offset": [0, 2],
            "top_logprobs": [{"It": -0.1, "The": -2.5, "A": -3.0}, {"aly": -0.5, "al": -1.0}]}


def test_logprobs_become_completions_logprobs_and_come_back_in_the_chat_form():
    assert chat_to_completion(chat_body(logprobs=True, top_logprobs=2), TOK)["logprobs"] == 2
    assert chat_to_completion(chat_body(logprobs=True), TOK)["logprobs"] == 0
    assert "logprobs" not in chat_to_completion(chat_body(logprobs=False), TOK)
    resp = {**COMPLETION, "choices": [{**COMPLETION["choices"][0], "logprobs": LOGPROBS}]}
    lp = completion_to_chat(resp, top_logprobs=2)["choices"][0]["logprobs"]
    assert [c["token"] for c in lp["content"]] == ["It", "aly"] and lp["refusal"] is None
    assert [c["logprob"] for c in lp["content"]] == [-0.1, -0.5]
    assert [[t["token"] for t in c["top_logprobs"]] for c in lp["content"]] == [["It", "The"], ["aly", "al"]]
    assert lp["content"][0]["bytes"] == list(b"It")
    assert completion_to_chat(resp)["choices"][0]["logprobs"] is None  # not asked for
    chunk = ChunkConverter(1)({"id": "cmpl-1", "choices": [{"index": 0, "text": "It", "logprobs": {
        "tokens": ["It"], "token_logprobs": [-0.1], "top_logprobs": [{"It": -0.1, "The": -2.5}]}}]})
    assert chunk["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == [
        {"token": "It", "logprob": -0.1, "bytes": list(b"It")}]


def _stream(texts: list[str]) -> bytes:
    events = [{"id": "cmpl-s", "object": "text_completion", "created": 1, "model": "m",
               "choices": [{"index": 0, "text": t, "finish_reason": "stop" if i == len(texts) - 1 else None}]}
              for i, t in enumerate(texts)]
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


async def request_body(receive) -> bytes:
    """The whole request body a fake app's ``receive`` delivers, however it is split."""
    raw = b""
    while True:
        msg = await receive()
        raw += msg.get("body", b"")
        if not msg.get("more_body"):
            return raw


class FakeVllm:
    """A completions endpoint: records what reached it; streams in pieces of ``piece`` bytes."""

    def __init__(self, piece: int = 0) -> None:
        self.seen: list[tuple[str, dict]] = []
        self.piece = piece

    async def __call__(self, scope, receive, send):
        raw = await request_body(receive)
        try:
            body = json.loads(raw)
        except ValueError:  # vLLM's own answer to malformed JSON
            self.seen.append((scope["path"], raw))
            await send({"type": "http.response.start", "status": 400, "headers": []})
            await send({"type": "http.response.body", "body": b"bad json"})
            return
        self.seen.append((scope["path"], body))
        if scope["path"] == "/v1/chat/completions":  # a chat that is not kvblend's: vLLM's own answer
            out, ctype = json.dumps({"object": "chat.completion", "untouched": True}).encode(), b"application/json"
        elif body.get("stream"):
            out, ctype = _stream(["It", "aly", ""]), b"text/event-stream"
        else:
            out, ctype = json.dumps(COMPLETION).encode(), b"application/json"
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", ctype), (b"content-length", str(len(out)).encode())]})
        step = self.piece or len(out)
        for i in range(0, len(out), step):
            await send({"type": "http.response.body", "body": out[i:i + step], "more_body": i + step < len(out)})


def test_the_middleware_rewrites_a_kvblend_chat_and_answers_in_chat_form():
    fake = FakeVllm()
    client = TestClient(DocumentsMiddleware(fake, tokenizer=TOK))
    r = client.post("/v1/chat/completions", json=chat_body())
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"
    assert r.json()["choices"][0]["message"]["content"] == "Italy"
    assert r.json()["kv_transfer_params"] == {PARAMS_KEY: {"claim": "blend"}}
    path, sent = fake.seen[-1]
    assert path == "/v1/completions" and sent == chat_to_completion(chat_body(), TOK)
    plain = {k: v for k, v in chat_body().items() if k != "kv_transfer_params"}
    assert client.post("/v1/chat/completions", json=plain).json() == {"object": "chat.completion", "untouched": True}
    assert fake.seen[-1] == ("/v1/chat/completions", plain)  # passed through byte for byte


@pytest.mark.parametrize("piece", [0, 1, 7, 50])
def test_a_streamed_answer_goes_back_as_chat_chunks_however_it_is_split(piece):
    client = TestClient(DocumentsMiddleware(FakeVllm(piece), tokenizer=TOK))
    r = client.post("/v1/chat/completions", json=chat_body(stream=True))
    events = [e for e in r.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert [c["object"] for c in chunks] == ["chat.completion.chunk"] * 3
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "It"}
    assert [c["choices"][0]["delta"].get("content") for c in chunks] == ["It", "aly", ""]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


# "é" is the bytes C3 A9: two tokens of the byte tokenizer, each decoding alone to U+FFFD (as vLLM names them)
ID_LOGPROBS = {"tokens": ["token_id:195", "token_id:169"], "token_logprobs": [-0.1, -0.2], "text_offset": [0, 0],
               "top_logprobs": [{"token_id:195": -0.1, "token_id:196": -2.5}, {"token_id:169": -0.2}]}


def test_logprobs_carry_each_tokens_own_bytes_and_keep_alternatives_apart():
    """vLLM names a piece of a multi-byte character U+FFFD: its UTF-8 is not the token's bytes, and two
    such alternatives share one key of a text-keyed top_logprobs. The forwarded request asks for
    ``token_id:N`` placeholders, which come back as each token's text and exact bytes."""
    assert chat_to_completion(chat_body(logprobs=True), TOK)["return_tokens_as_token_ids"] is True
    assert "return_tokens_as_token_ids" not in chat_to_completion(chat_body(), TOK)
    resp = {**COMPLETION, "choices": [{**COMPLETION["choices"][0], "logprobs": ID_LOGPROBS}]}
    lp = completion_to_chat(resp, top_logprobs=2, namer=TokenNamer(TOK))["choices"][0]["logprobs"]["content"]
    assert [(c["token"], c["bytes"]) for c in lp] == [("\ufffd", [0xC3]), ("\ufffd", [0xA9])]
    assert bytes(b for c in lp for b in c["bytes"]).decode("utf-8") == "\u00e9"
    assert [(t["bytes"], t["logprob"]) for t in lp[0]["top_logprobs"]] == [([0xC3], -0.1), ([0xC4], -2.5)]
    as_ids = completion_to_chat(resp, 2, TokenNamer(TOK, as_ids=True))["choices"][0]["logprobs"]["content"]
    assert [(c["token"], c["bytes"]) for c in as_ids] == [("token_id:195", [0xC3]), ("token_id:169", [0xA9])]
    plain = completion_to_chat({**COMPLETION, "choices": [{**COMPLETION["choices"][0], "logprobs": LOGPROBS}]}, 2,
                               TokenNamer(TOK))["choices"][0]["logprobs"]["content"]
    assert [(c["token"], c["bytes"]) for c in plain] == [("It", list(b"It")), ("aly", list(b"aly"))]  # no placeholders
    chunk = ChunkConverter(1, TokenNamer(TOK))({"id": "cmpl-1", "choices": [{"index": 0, "text": "", "logprobs": {
        "tokens": ["token_id:195"], "token_logprobs": [-0.1], "top_logprobs": [{"token_id:195": -0.1}]}}]})
    assert chunk["choices"][0]["logprobs"]["content"][0]["bytes"] == [0xC3]


def test_the_middleware_resolves_placeholders_unless_the_client_asked_for_them():
    class IdVllm(FakeVllm):
        async def __call__(self, scope, receive, send):
            body = json.loads(await request_body(receive))
            self.seen.append((scope["path"], body))
            out = json.dumps({**COMPLETION, "choices": [{**COMPLETION["choices"][0], "logprobs": ID_LOGPROBS}]}).encode()
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": out})

    fake = IdVllm()
    client = TestClient(DocumentsMiddleware(fake, tokenizer=TOK))
    lp = client.post("/v1/chat/completions", json=chat_body(logprobs=True)).json()["choices"][0]["logprobs"]
    assert fake.seen[-1][1]["return_tokens_as_token_ids"] is True
    assert [(c["token"], c["bytes"]) for c in lp["content"]] == [("\ufffd", [0xC3]), ("\ufffd", [0xA9])]
    lp = client.post("/v1/chat/completions", json=chat_body(logprobs=True, return_tokens_as_token_ids=True)).json()
    assert [c["token"] for c in lp["choices"][0]["logprobs"]["content"]] == ["token_id:195", "token_id:169"]


def test_a_malformed_kvblend_chat_gets_a_400_and_never_reaches_vllm():
    fake = FakeVllm()
    client = TestClient(DocumentsMiddleware(fake, tokenizer=TOK))
    r = client.post("/v1/chat/completions", json=chat_body(tools=[{"type": "function"}]))
    assert r.status_code == 400 and "'tools' is not supported" in r.json()["error"]["message"]
    assert not fake.seen
    r = client.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.text == "bad json"  # malformed JSON is vLLM's to answer, as sent
    assert fake.seen == [("/v1/chat/completions", b"{not json")]


def test_a_body_too_large_to_rewrite_reaches_vllm_whole(monkeypatch):
    """Past the middleware's read limit the body is not rewritten, and vLLM gets every byte of it."""
    import asyncio

    import blend.integrations.vllm.middleware as mw

    monkeypatch.setattr(mw, "MAX_BODY_BYTES", 64)
    raw = json.dumps(chat_body()).encode()
    msgs = [{"type": "http.request", "body": raw[i:i + 40], "more_body": i + 40 < len(raw)}
            for i in range(0, len(raw), 40)]
    sent: list[dict] = []

    async def receive():
        return msgs.pop(0) if msgs else {"type": "http.disconnect"}

    async def send(msg):
        sent.append(msg)

    fake = FakeVllm()
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
    asyncio.run(DocumentsMiddleware(fake, tokenizer=TOK)(scope, receive, send))
    assert fake.seen == [("/v1/chat/completions", chat_body())] and sent[0]["status"] == 200


class _WithArgs:
    """What vLLM's FastAPI app puts in every request's scope: ``scope["app"].state.args``."""

    def __init__(self, inner, api_key, engine_client=None) -> None:
        self.inner = inner
        self.state = type("State", (), {"args": type("Args", (), {"api_key": api_key})(),
                                        "engine_client": engine_client})()

    async def __call__(self, scope, receive, send):
        await self.inner({**scope, "app": self}, receive, send)


class _CountingTokenizer:
    def __init__(self) -> None:
        self.calls = 0

    def __getattr__(self, name):
        self.calls += 1
        return getattr(TOK, name)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return TOK(*args, **kwargs)


@pytest.mark.parametrize("where", ["args", "env", "one string"])
def test_a_request_without_vllms_api_key_is_never_laid_out(where, monkeypatch):
    """vLLM authenticates after this middleware: a request without a valid key passes through unread
    (vLLM's own check answers it 401) and costs no tokenizer work; the right key is rewritten."""
    fake, tok = FakeVllm(), _CountingTokenizer()
    if where == "env":
        monkeypatch.setenv("VLLM_API_KEY", "sesame")
    keys = {"args": ["other", "sesame"], "env": None, "one string": "sesame"}[where]
    app = _WithArgs(DocumentsMiddleware(fake, tokenizer=tok), keys)
    client = TestClient(app)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic sesame"}):
        client.post("/v1/chat/completions", json=chat_body(tools=[{"type": "function"}]), headers=headers)
        assert fake.seen[-1][0] == "/v1/chat/completions"  # unread: even a malformed one is vLLM's to answer
    assert tok.calls == 0 and len(fake.seen) == 3
    r = client.post("/v1/chat/completions", json=chat_body(), headers={"Authorization": "Bearer sesame"})
    assert r.status_code == 200 and fake.seen[-1][0] == "/v1/completions" and tok.calls > 0


def test_without_a_configured_key_every_request_is_laid_out(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    fake = FakeVllm()
    client = TestClient(_WithArgs(DocumentsMiddleware(fake, tokenizer=TOK), None))
    assert client.post("/v1/chat/completions", json=chat_body()).status_code == 200
    assert fake.seen[-1][0] == "/v1/completions"


class _Output:
    def __init__(self, text: str, finished: bool, params: dict | None) -> None:
        self.text, self.finished, self.kv_transfer_params = text, finished, params


class FakeSamplingParams:
    def __init__(self, extra_args: dict) -> None:
        self.extra_args = extra_args


class FakeEngineClient:
    """vLLM's engine client as the completions server uses it: ``generate`` yields outputs, the last one
    finished and carrying the connector's report in ``kv_transfer_params``."""

    def __init__(self) -> None:
        self.closed = 0

    async def generate(self, prompt, sampling_params, request_id):
        try:
            yield _Output("It", False, None)
            yield _Output("aly", True, {PARAMS_KEY: {"claim": "blend", "recomputed_tokens": 7}})
        finally:
            self.closed += 1


async def _engine_backed_vllm(scope, receive, send):
    """A completions endpoint that streams what the engine client yields, as vLLM's does: the
    stream itself carries no kv_transfer_params."""
    body = json.loads(await request_body(receive))
    sp = FakeSamplingParams({"kv_transfer_params": body.get("kv_transfer_params")})
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    async for out in scope["app"].state.engine_client.generate(body["prompt"], sp, "cmpl-x-0"):
        chunk = {"id": "cmpl-x", "object": "text_completion", "created": 1, "model": "m",
                 "choices": [{"index": 0, "text": out.text, "finish_reason": "stop" if out.finished else None}]}
        await send({"type": "http.response.body", "body": b"data: " + json.dumps(chunk).encode() + b"\n\n",
                    "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


def test_a_streamed_kvblend_chat_gets_the_reuse_report_in_its_finishing_chunk(monkeypatch):
    """vLLM's streams carry no kv_transfer_params: the middleware catches the report from the engine
    client's final output and puts it in the chat chunk with the finish reason; nothing is left pending."""
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    engine = FakeEngineClient()
    mw = DocumentsMiddleware(_engine_backed_vllm, tokenizer=TOK)
    client = TestClient(_WithArgs(mw, None, engine))
    for _ in range(2):  # the engine client is wrapped once
        r = client.post("/v1/chat/completions", json=chat_body(stream=True))
        events = [json.loads(e[len("data: "):]) for e in r.text.split("\n\n") if e and e != "data: [DONE]"]
        assert [c["choices"][0]["delta"].get("content") for c in events] == ["It", "aly"]
        assert "kv_transfer_params" not in events[0]
        assert events[-1]["kv_transfer_params"] == {PARAMS_KEY: {"claim": "blend", "recomputed_tokens": 7}}
    assert engine.closed == 2 and not mw.stream_reports._pending

    # a plain (non-kvblend) stream through the same wrapped client is not marked and gets no report
    plain_sp = FakeSamplingParams({"kv_transfer_params": {STREAM_KEY: "not-ours"}})

    async def drain():
        return [o.kv_transfer_params async for o in engine.generate([1], plain_sp, "r")]

    import asyncio

    assert asyncio.run(drain())[-1] == {PARAMS_KEY: {"claim": "blend", "recomputed_tokens": 7}}
    for odd in ([1], {"a": 1}, None, 3):  # any client can put anything under the key: never an error
        plain_sp = FakeSamplingParams({"kv_transfer_params": {STREAM_KEY: odd}})
        assert asyncio.run(drain())[-1] == {PARAMS_KEY: {"claim": "blend", "recomputed_tokens": 7}}
    assert not mw.stream_reports._pending


def test_a_streamed_kvblend_chat_that_fails_midway_leaves_nothing_pending(monkeypatch):
    """An error inside vLLM's stream (or a client gone) ends the response: its nonce is dropped and
    vLLM's own generator is closed (which is how vLLM aborts a request)."""
    import asyncio

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    engine = FakeEngineClient()
    mw = DocumentsMiddleware(_engine_backed_vllm, tokenizer=TOK)
    app = _WithArgs(mw, None, engine)
    raw = json.dumps(chat_body(stream=True)).encode()
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(msg):
        sent.append(msg)
        if len(sent) == 2:  # the first chunk went out: the client goes away
            raise OSError("client disconnected")

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
    with pytest.raises(OSError):
        asyncio.run(app(scope, receive, send))
    assert not mw.stream_reports._pending and engine.closed == 1
