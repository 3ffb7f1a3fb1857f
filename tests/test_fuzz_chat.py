"""Fuzz: the vLLM documents middleware and its chat rewrite over hostile request bodies (issues 15, 17).

A chat body is untrusted bytes from any client of a vLLM server that loads the
middleware. Properties: :func:`chat_to_completion` returns a completions body that
serialises, or raises :class:`InvalidRequestError`, nothing else; the middleware
answers every body (bytes mutated, JSON structurally rewritten, nesting past the
JSON decoder's recursion limit) with either vLLM's answer (passed on) or its own
400, within the fuzz suite's time and memory bounds, and never raises.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from blend.errors import InvalidRequestError
from blend.integrations.vllm.chat import chat_to_completion, is_kvblend_chat
from blend.integrations.vllm.middleware import DocumentsMiddleware
from blend.integrations.vllm.plan import PARAMS_KEY
from blend.tiny import byte_tokenizer
from _fuzz_util import FUZZ, bounded, dumps_mutated, json_values, mutate_bytes, mutate_json
from test_vllm_chat import FakeSamplingParams, request_body

TOK = byte_tokenizer()
BODY: dict[str, Any] = {
    "model": "m", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where?"}],
    "documents": ["Paris is in France.", {"title": "Rome", "text": "Rome is in Italy."}],
    "kv_transfer_params": {PARAMS_KEY: {"mode": "blend", "ratio": 0.15, "selector": "probe"}},
    "temperature": 0, "max_completion_tokens": 8, "stream": False, "cache_salt": "t",
}
RAW = json.dumps(BODY).encode()
DEEP = b'{"documents": ["a"], "kv_transfer_params": {"kvblend": {}}, "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


def _rewrite_or_refuse(body: Any) -> None:
    try:
        out = chat_to_completion(body, TOK)
    except InvalidRequestError:
        return
    json.dumps(out)  # what the middleware sends on must serialise
    assert isinstance(out["prompt"], list) and all(isinstance(t, int) for t in out["prompt"])


@FUZZ
@given(data=st.data())
def test_the_chat_rewrite_returns_a_body_or_its_own_error(data):
    body = mutate_json(json.loads(RAW), data)
    if is_kvblend_chat(body):
        with bounded():
            _rewrite_or_refuse(body)


async def _vllm(scope, receive, send) -> None:
    """Stands for vLLM: reads the whole body, answers 200 without parsing it."""
    await request_body(receive)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"vllm"})


def _post(raw: bytes) -> int:
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(msg):
        sent.append(msg)

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
    asyncio.run(DocumentsMiddleware(_vllm, tokenizer=TOK)(scope, receive, send))
    return sent[0]["status"]


@FUZZ
@given(data=st.data(), how=st.sampled_from(["json", "text", "bytes"]))
def test_the_middleware_answers_every_body_with_vllms_answer_or_a_400(data, how):
    if how == "json":
        raw = json.dumps(mutate_json(json.loads(RAW), data)).encode()
    else:
        raw = dumps_mutated(json.loads(RAW), data) if how == "text" else mutate_bytes(RAW, data)
    with bounded():
        assert _post(raw) in (200, 400)


def test_a_body_nested_past_the_json_decoders_limit_goes_to_vllm():
    with bounded():
        assert _post(DEEP) == 200  # passed on unparsed (RecursionError is not a crash of the middleware)


def test_bodies_nested_just_under_the_decoders_limit_are_rewritten_or_refused():
    deep = json.loads("[" * 900 + "]" * 900)
    for field in ("documents", "messages", "metadata", "stop"):
        body = {**json.loads(RAW), field: deep}
        with bounded():
            if is_kvblend_chat(body):
                _rewrite_or_refuse(body)
            assert _post(json.dumps(body).encode()) in (200, 400)


class _Engine:
    async def generate(self, prompt, sampling_params, request_id):
        yield type("Out", (), {"finished": True, "kv_transfer_params": None})()


@FUZZ
@given(params=json_values)
def test_the_stream_report_wrapper_passes_any_clients_kv_transfer_params(params):
    """vLLM's engine client, once wrapped, serves every request (not only kvblend's): whatever a client
    put in kv_transfer_params, generate yields vLLM's outputs and raises nothing of its own."""
    from blend.integrations.vllm.middleware import STREAM_KEY, StreamReports

    engine, reports = _Engine(), StreamReports()
    assert reports.watch(engine)
    live = reports.open()

    async def run(extra):
        return [o async for o in engine.generate([1], FakeSamplingParams(extra), "r")]

    for extra in ({"kv_transfer_params": params}, {"kv_transfer_params": {STREAM_KEY: params}},
                  {"kv_transfer_params": {STREAM_KEY: live, "x": params}}, params):
        with bounded():
            assert len(asyncio.run(run(extra))) == 1
