"""Fuzz: `kvblend serve` over hostile request bodies (issues 15, 16).

Every body a client can send to the OpenAI endpoints (mutated bytes of a valid
request, structurally rewritten JSON: wrong types, huge or negative numbers,
JSON texts json.dumps never writes: too many digits, NaN, a key twice,
missing and extra fields, deep nesting) is answered with a 2xx or a 4xx, never a
500, and the server keeps serving. A real server on a loopback port (tiny model),
the fuzz suite's per-example time bound.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from _fuzz_util import FUZZ, bounded, dumps_mutated, mutate_bytes, mutate_json
from _serve_util import TINY, one_torch_thread, running_server, tiny_serve_engine  # noqa: F401
from blend.serve.config import Limits, SchedulerConfig, ServeConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DOCS = ["Paris is the capital of France.", {"title": "Rome", "text": "Rome is the capital of Italy."}]
CHAT = {"model": TINY, "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where?"}],
        "documents": DOCS, "kvblend": {"reuse": "blend", "ratio": 0.15, "selector": "probe"},
        "max_tokens": 3, "temperature": 0.7, "top_p": 0.9, "seed": 1, "stop": ["\n"], "stream": False,
        "cache_salt": "t"}
COMPLETION = {"model": TINY, "prompt": "Where is Rome?", "documents": DOCS, "kvblend": {"reuse": "exact"},
              "max_tokens": 3, "temperature": 0, "stream": False}
BODIES = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETION}
LIMITS = Limits(max_body_bytes=256_000, max_documents=8, max_prompt_tokens=4000, max_tokens=16, default_max_tokens=4)
ALLOC_CAP = 1 << 30  # the server's threads allocate too (tracemalloc sees every thread)


@pytest.fixture(scope="module")
def srv(one_torch_thread):
    config = ServeConfig(model=TINY, limits=LIMITS, scheduler=SchedulerConfig(max_concurrency=2))
    with running_server(tiny_serve_engine(), config) as running:
        yield running


def _post(srv, path: str, raw: bytes) -> httpx.Response:
    return httpx.post(srv.url + path, content=raw, headers={"Content-Type": "application/json"}, timeout=30)


def test_the_valid_bodies_are_answered(srv):
    for path, body in BODIES.items():
        assert _post(srv, path, json.dumps(body).encode()).status_code == 200, path


@FUZZ
@given(data=st.data(), path=st.sampled_from(sorted(BODIES)), how=st.sampled_from(["json", "text", "bytes"]))
def test_every_body_gets_a_2xx_or_a_4xx_and_the_server_keeps_serving(srv, data, path, how):
    raw = json.dumps(BODIES[path]).encode()
    if how == "json":
        raw = json.dumps(mutate_json(json.loads(raw), data)).encode()
    elif how == "text":
        raw = dumps_mutated(BODIES[path], data)
    else:
        raw = mutate_bytes(raw, data)
    with bounded(max_bytes=ALLOC_CAP):
        r = _post(srv, path, raw)
        assert r.status_code < 500, (r.status_code, r.text[:300], raw[:300])
        if r.status_code >= 400:
            assert "error" in r.json()  # OpenAI's error shape, with a message


def test_after_the_fuzz_the_server_still_answers(srv):
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
    assert _post(srv, "/v1/chat/completions", json.dumps(CHAT).encode()).status_code == 200
