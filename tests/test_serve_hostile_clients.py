"""The server against ill-behaved clients: answer-changing fields it cannot honour, bodies that are not JSON,
clients that leave before their first token, and clients that stop reading their stream (tiny model)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import httpx
import pytest
from starlette.testclient import TestClient

from _serve_util import (  # noqa: F401 - fixtures
    TINY, make_scheduler, one_torch_thread, running_server, tiny_serve_engine, wait_until,
)
from blend.policy import ReusePolicy
from blend.sampling import GenerationConfig
from blend.serve.app import create_app
from blend.serve.config import Limits, SchedulerConfig, ServeConfig
from blend.serve.schemas import CHAT_UNDECLARED_NEUTRAL, UNDECLARED_NEUTRAL
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
    "modalities": ["text", "audio"], "web_search_options": {},
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
