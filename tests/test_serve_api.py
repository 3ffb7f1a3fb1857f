"""The HTTP API: the official openai client, answers equal to the Python API's, and every bad
input a clear 4xx (a server on a free loopback port, tiny model)."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlparse

import httpx
import openai
import pytest

from _serve_util import TINY, one_torch_thread, running_server, tiny_serve_engine  # noqa: F401
from blend.generation import generate
from blend.policy import ReusePolicy
from blend.prompt import Role, Turn
from blend.sampling import GenerationConfig
from blend.serve.config import Limits, SchedulerConfig, ServeConfig
from conftest import make_docs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KEY = "sk-test-key"
DOCS = make_docs(3, words=30, seed=4)
LIMITS = Limits(max_body_bytes=64_000, max_documents=4, max_prompt_tokens=3000, max_tokens=2000,
                default_max_tokens=16)


@pytest.fixture(scope="module")
def srv(one_torch_thread):
    engine = tiny_serve_engine()
    config = ServeConfig(model=TINY, api_key=KEY, limits=LIMITS, scheduler=SchedulerConfig(max_concurrency=4))
    with running_server(engine, config) as running:
        running.engine = engine
        yield running


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)


def post(srv, body, key: str | None = KEY, path: str = "/v1/chat/completions", raw: bytes | None = None):
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(srv.url + path, content=content, headers=headers, timeout=30)


def chat(question: str = "which river?", **kw) -> dict:
    return {"model": TINY, "messages": [{"role": "user", "content": question}], "documents": DOCS,
            "max_tokens": 8, "temperature": 0, **kw}


def test_a_generated_eos_counts_as_a_completion_token(client, srv):
    """The EOS that ends an answer was sampled by a decode step: usage counted 0 tokens for an answer ended
    by a forced EOS (vLLM counts 1), and /metrics' output tokens missed every such token."""
    eos = srv.engine.tokenizer.eos_token_id
    r = client.chat.completions.create(model=TINY, messages=[{"role": "user", "content": "which river?"}],
                                       max_tokens=8, temperature=0, logit_bias={str(eos): 100})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == ""
    assert r.model_extra["kvblend"]["answer_token_ids"] == [] and r.usage.completion_tokens == 1


def test_openai_client_chat_completions_and_streaming(client):
    r = client.chat.completions.create(model=TINY, messages=[{"role": "user", "content": "which river?"}],
                                       max_tokens=8, temperature=0, extra_body={"documents": DOCS})
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    ext = r.model_extra["kvblend"]
    ended_by_a_token = r.choices[0].finish_reason == "stop"  # an EOS: generated, not in the answer
    assert r.usage.completion_tokens == len(ext["answer_token_ids"]) + ended_by_a_token >= 1
    assert r.usage.prompt_tokens == ext["report"]["prompt_tokens"]
    assert [s["kind"] for s in ext["report"]["segments"]] == ["preamble", "document", "document", "document",
                                                               "question"]

    again = client.chat.completions.create(model=TINY, messages=[{"role": "user", "content": "which river?"}],
                                           max_tokens=8, temperature=0, stream=True,
                                           stream_options={"include_usage": True}, extra_body={"documents": DOCS})
    chunks = list(again)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason][0]
    assert final.model_extra["kvblend"]["logits_sha256"] == ext["logits_sha256"]
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.completion_tokens == r.usage.completion_tokens
    # the second time, preamble and documents are exact prefix hits
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - ext["report"]["segments"][-1]["tokens"]


def test_openai_client_completions_and_models(client):
    r = client.completions.create(model=TINY, prompt="which stone?", max_tokens=6, temperature=0,
                                  extra_body={"documents": DOCS[:1]})
    assert r.object == "text_completion" and r.usage.completion_tokens >= 1
    pieces = [c.choices[0].text for c in client.completions.create(
        model=TINY, prompt="which stone?", max_tokens=6, temperature=0, stream=True,
        extra_body={"documents": DOCS[:1]})]
    assert "".join(pieces) == r.choices[0].text
    assert [m.id for m in client.models.list()] == [TINY]


@pytest.mark.parametrize("salt, kvblend, sampling", [
    ("case-exact-greedy", {"reuse": "exact"}, {"temperature": 0}),
    ("case-blend-v", {"reuse": "blend", "ratio": 0.3, "selector": "v"}, {"temperature": 0}),
    ("case-exact-sampled", {"reuse": "exact"}, {"temperature": 0.9, "top_p": 0.9, "top_k": 40, "seed": 1234}),
    ("case-blend-sampled", {"reuse": "blend", "ratio": 0.15}, {"temperature": 0.7, "seed": 99, "stop": ["q"]}),
    # the guard always fires
    ("case-blend-guard", {"reuse": "blend", "ratio": 0.15, "guard_margin": 1e9}, {"temperature": 0}),
])
def test_server_answers_equal_the_python_api(srv, salt, kvblend, sampling):
    """Each case keys its KV under its own cache salt: the server's store is shared by the module, and
    an exact chain an earlier case stored for DOCS would turn a later blend into the exact path (no
    blend, no guard). A blend case's canonical chunks are stored first, so the server and the Python
    API both run the same warm blend."""
    engine = srv.engine
    blend = kvblend["reuse"] == "blend"
    if blend:
        engine.precompute_chunks(DOCS, salt=salt)
    body = chat("which harbor?", max_tokens=12, kvblend=kvblend, cache_salt=salt, **sampling)
    got = post(srv, body).json()
    ext = got["kvblend"]
    # the reference policy with the server's defaults: an option the request leaves out is the default
    # (the default near-tie guard included), not None
    options = {k: v for k, v in kvblend.items() if k != "reuse"}
    policy = ReusePolicy.blend(**options, cache_salt=salt) if blend else ReusePolicy.exact(cache_salt=salt)
    cfg = GenerationConfig(max_tokens=12, temperature=sampling["temperature"], top_p=sampling.get("top_p", 1.0),
                           top_k=sampling.get("top_k", 0), seed=sampling.get("seed"),
                           stop=tuple(sampling.get("stop", ())))
    ref = generate(engine, engine.build_prompt("which harbor?", DOCS), policy, cfg)
    assert ext["logits_sha256"] == ref.logits_sha256()
    assert ext["answer_token_ids"] == ref.token_ids
    assert ext["steps_sha256"] == ref.steps_sha256  # alone in the batch: the very same numbers
    assert got["choices"][0]["message"]["content"] == ref.text
    report = ext["report"]
    classes = [s["class"] for s in report["segments"]]
    if blend:  # really blended, not the all-documents-exact path (which reports no first-token gap):
        # blended rows, or the near-tie guard, which fires only on a blend that kept re-positioned KV (a
        # guard ratio not above the request's, as 0.3 under the default guard, recomputes on the exact path)
        assert report["first_token_margin"] is not None, report
        assert "blended" in classes or report["guard"], report
        assert report["policy"] == ref.report.policy  # the same settings, defaults included
        assert report["segments"] == ref.report.to_dict()["segments"]
        if kvblend.get("guard_margin") == 1e9:  # re-blended at the guard's 0.3: blended rows still
            assert report["guard"] and "blended" in classes, report
    else:  # the server's request was the salt's first: cold; the Python API's found its exact chain
        assert classes == ["computed"] * len(classes), classes
        assert [s.reuse_class.value for s in ref.report.segments[:-1]] == ["exact"] * (len(classes) - 1)


def test_a_conversation_is_answered_as_the_python_api_answers_it(srv):
    turns = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "which harbor?"},
             {"role": "assistant", "content": "The north one."}, {"role": "user", "content": "and which river?"}]
    body = {**chat(max_tokens=6, kvblend={"reuse": "blend", "ratio": 0.15, "guard_margin": None}), "messages": turns}
    got = post(srv, body)
    assert got.status_code == 200, got.text
    engine = srv.engine
    history = (Turn(Role.USER, "which harbor?"), Turn(Role.ASSISTANT, "The north one."))
    prompt = engine.build_prompt("and which river?", DOCS, "Answer briefly.", history)
    ref = generate(engine, prompt, ReusePolicy.blend(ratio=0.15, guard_margin=None),
                   GenerationConfig(max_tokens=6, temperature=0))
    ext = got.json()["kvblend"]
    assert ext["logits_sha256"] == ref.logits_sha256() and ext["answer_token_ids"] == ref.token_ids
    assert got.json()["usage"]["prompt_tokens"] == len(prompt)
    kinds = [s["kind"] for s in ext["report"]["segments"]]
    assert kinds == ["preamble"] + ["document"] * len(DOCS) + ["question"]


def test_a_chat_reuses_its_earlier_turns_through_the_server(client):
    """Exact reuse (the default) over three turns with the openai client: each turn's answer joins
    the messages; from the third turn on everything but the last answer and the new question is
    cached, and ``cached_tokens`` says so."""
    messages = [{"role": "system", "content": "Answer in a few words."}]
    seen = []
    for question in ("which quay?", "and the lamp?", "who lit it?"):
        messages.append({"role": "user", "content": question})
        r = client.chat.completions.create(model=TINY, messages=messages, max_tokens=5, temperature=0,
                                           extra_body={"documents": DOCS, "cache_salt": "turns-test"})
        rows = r.model_extra["kvblend"]["report"]["segments"]
        seen.append(rows)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})  # "" too: OpenAI takes it
        assert r.usage.prompt_tokens_details.cached_tokens == sum(x["tokens"] for x in rows
                                                                  if x["class"] == "exact")
    assert [x["kind"] for x in seen[0]][-1] == "question"
    assert [(x["kind"], x["class"]) for x in seen[2][-3:]] == [("turn", "exact"), ("turn", "exact"),
                                                               ("question", "computed")]


def test_penalties_and_logit_bias_are_the_python_apis(srv, client):
    engine = srv.engine
    plain = generate(engine, engine.build_prompt("which river?", DOCS), ReusePolicy.exact(),
                     GenerationConfig(max_tokens=8, temperature=0))
    banned = plain.token_ids[0]
    cfg = GenerationConfig(max_tokens=8, temperature=0, presence_penalty=1.5, frequency_penalty=0.5,
                           logit_bias=((banned, -100.0),))
    ref = generate(engine, engine.build_prompt("which river?", DOCS), ReusePolicy.exact(), cfg)
    r = client.chat.completions.create(model=TINY, messages=[{"role": "user", "content": "which river?"}],
                                       max_tokens=8, temperature=0, presence_penalty=1.5, frequency_penalty=0.5,
                                       logit_bias={str(banned): -100}, extra_body={"documents": DOCS})
    got = r.model_extra["kvblend"]["answer_token_ids"]
    assert got == ref.token_ids and banned not in got
    nulls = post(srv, chat(max_tokens=8, presence_penalty=None, frequency_penalty=None, logit_bias=None,
                           logprobs=None, top_logprobs=None, tools=None, response_format=None, n=None,
                           stream=None, seed=None, stop=None, user=None, ignore_eos=None,
                           stream_options=None))
    assert nulls.status_code == 200, nulls.text  # OpenAI's optional fields sent as null: their defaults
    assert nulls.json()["kvblend"]["answer_token_ids"] == plain.token_ids
    streamed = post(srv, chat(max_tokens=8, stream=True, stream_options={"include_usage": None}))
    assert streamed.status_code == 200, streamed.text
    comp = post(srv, {"model": TINY, "prompt": "which river?", "max_tokens": 2, "echo": None, "ignore_eos": None},
                path="/v1/completions")
    assert comp.status_code == 200, comp.text
    assert r.model_extra["kvblend"]["logits_sha256"] == plain.logits_sha256()  # the model's logits: unchanged


def test_logprobs_are_the_python_apis_in_openais_shapes_streamed_or_not(srv, client):
    engine = srv.engine
    cfg = GenerationConfig(max_tokens=8, temperature=0, logprobs=3)
    ref = generate(engine, engine.build_prompt("which river?", DOCS), ReusePolicy.exact(), cfg)
    assert len(ref.logprobs) == len(ref.token_ids) > 0
    r = client.chat.completions.create(model=TINY, messages=[{"role": "user", "content": "which river?"}],
                                       max_tokens=8, temperature=0, logprobs=True, top_logprobs=3,
                                       extra_body={"documents": DOCS})
    content = r.choices[0].logprobs.content
    assert [c.logprob for c in content] == [e.logprob for e in ref.logprobs]
    assert [c.token for c in content] == [engine.tokenizer.decode([t]) for t in ref.token_ids]
    for c, e in zip(content, ref.logprobs):
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob == c.logprob  # greedy: the argmax
        assert [t.logprob for t in c.top_logprobs] == [lp for _, lp in e.top]
        assert c.bytes == ([e.token_id] if e.token_id < 256 else list(c.token.encode("utf-8")))  # its own bytes
    parts = list(client.chat.completions.create(
        model=TINY, messages=[{"role": "user", "content": "which river?"}], max_tokens=8, temperature=0,
        logprobs=True, top_logprobs=3, stream=True, extra_body={"documents": DOCS}))
    streamed = [c for p in parts for ch in p.choices if ch.logprobs for c in ch.logprobs.content]
    assert [c.logprob for c in streamed] == [c.logprob for c in content]
    plain = client.chat.completions.create(model=TINY, messages=[{"role": "user", "content": "which river?"}],
                                           max_tokens=8, temperature=0, extra_body={"documents": DOCS})
    assert plain.choices[0].logprobs is None
    done = client.completions.create(model=TINY, prompt="which river?", max_tokens=8, temperature=0, logprobs=2,
                                     extra_body={"documents": DOCS})
    lp = done.choices[0].logprobs
    assert lp.token_logprobs == [e.logprob for e in ref.logprobs]
    assert len(lp.tokens) == len(lp.top_logprobs) == len(lp.text_offset) == len(ref.token_ids)
    text = done.choices[0].text  # each offset is where its token's text starts in the answer
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(text)
    assert all(t == "\ufffd" or text[o:o + len(t)] == t for t, o in zip(lp.tokens, lp.text_offset))
    assert all(len(alts) <= 2 for alts in lp.top_logprobs)


@pytest.mark.parametrize("body, status, needle", [
    (b"{not json", 400, "malformed JSON"),
    ({"model": TINY, "messages": "hello"}, 400, "messages"),
    (chat(temperature="hot"), 400, "temperature"),
    (chat(kvblend={"reuse": "fast"}), 400, "kvblend.reuse"),
    (chat(kvblend={"reuse": "blend", "ratoi": 0.2}), 400, "kvblend.ratoi"),
    (chat(kvblend={"reuse": "blend", "ratio": 1.5}), 400, "kvblend.ratio"),
    (chat(kvblend={"reuse": "blend", "selector": "best"}), 400, "kvblend.selector"),
    (chat(kvblend={"reuse": "blend", "guard_margin": -1}), 400, "kvblend.guard_margin"),
    (chat(kvblend={"reuse": "blend", "semantic": True}), 400, "--experimental-semantic"),
    # a blend setting beside exact or no reuse: refused, not dropped (ratio 0.3 under "exact" answered as exact)
    (chat(kvblend={"reuse": "exact", "ratio": 0.3}), 400, "ratio is a blend option"),
    (chat(kvblend={"reuse": "none", "guard_margin": None}), 400, "guard_margin is a blend option"),
    (chat(kvblend={"reuse": "exact", "selector": "v"}), 400, "selector is a blend option"),
    # a guard setting with the guard off, a probe setting beside a selector that runs no probe: refused, not ignored
    (chat(kvblend={"reuse": "blend", "guard_margin": None, "guard_ratio": 0.5}), 400,
     "guard_ratio is a setting of the near-tie guard, which is off"),
    (chat(kvblend={"reuse": "blend", "guard_margin": None, "guard_mode": "widen"}), 400,
     "guard_mode is a setting of the near-tie guard"),
    (chat(kvblend={"reuse": "blend", "selector": "v", "candidates": None}), 400,
     "candidates is a setting of the query probe, which selector 'v' never runs"),
    (chat(kvblend={"reuse": "blend", "selector": "combo", "probe_precision": "bf16"}), 400,
     "probe_precision is a setting of the query probe"),
    (chat(documents=["a"] * 5), 413, "at most 4"),
    (chat(documents=["word " * 700]), 413, "exceeds the limit of 3000"),
    (chat(documents=["word " * 500], max_tokens=2000), 400, "context of 4096"),
    (chat(max_tokens=5000), 400, "limit of 2000"),
    (chat(max_tokens=0), 400, "max_tokens"),
    (chat(documents=[" "]), 400, "document 1 is empty"),
    (chat(documents=[{"text": "x", "page": 3}]), 400, "documents.0"),
    (chat(n=2), 400, "n:"),
    (chat(stream_options={"include_usage": True}), 400, "stream_options is only allowed when stream is true"),
    (chat(stream=False, stream_options={"include_usage": True}), 400, "stream_options"),
    (chat(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    (chat(top_logprobs=2), 400, "top_logprobs needs logprobs: true"),
    (chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools is not supported"),
    (chat(tool_choice="required"), 400, "tool_choice is not supported"),
    (chat(response_format={"type": "json_object"}), 400, "response_format is not supported"),
    (chat(presence_penalty=2.5), 400, "presence_penalty"),
    (chat(logit_bias={"abc": 1}), 400, "'abc' is not a token id"),
    (chat(logit_bias={"\u00b2": 1}), 400, "is not a token id"),
    (chat(logit_bias={"9" * 5000: 1}), 400, "is not a token id"),
    (chat(logit_bias={"99999999": 1}), 400, "not a token id of this model"),
    (chat(logit_bias={"5": 101}), 400, "must be in [-100, 100]"),
    (chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    (chat(logprobs=2), 400, "logprobs"),
    ({"model": TINY, "prompt": "a", "logprobs": True}, 400, "logprobs"),
    ({"model": TINY, "prompt": "a", "echo": True}, 400, "echo is not supported"),
    ({"model": TINY, "prompt": "a", "best_of": 3}, 400, "best_of is not supported"),
    # vLLM's sampling fields kvblend does not implement: a 400 naming them, never accepted and ignored
    (chat(best_of=3), 400, "best_of is not supported"),
    (chat(min_tokens=50), 400, "min_tokens is not supported"),
    (chat(min_p=0.5), 400, "min_p is not supported"),
    (chat(repetition_penalty=2.0), 400, "repetition_penalty is not supported"),
    (chat(stop_token_ids=[5]), 400, "stop_token_ids is not supported"),
    (chat(include_stop_str_in_output=True), 400, "include_stop_str_in_output is not supported"),
    ({"model": TINY, "prompt": "a", "skip_special_tokens": False}, 400, "skip_special_tokens is not supported"),
    (chat(use_beam_search=True), 400, "use_beam_search is not supported"),
    (chat(cache_salt=7), 400, "cache_salt"),
    # a JSON boolean or a numeric string is not a number: max_tokens true ran with a budget of 1, seed true as 1
    (chat(max_tokens=True), 400, "max_tokens"),
    (chat(max_tokens="3"), 400, "max_tokens"),
    (chat(max_tokens=3.0), 400, "max_tokens"),
    (chat(max_completion_tokens=True), 400, "max_completion_tokens"),
    (chat(seed=True), 400, "seed"),
    (chat(n=True), 400, "n:"),
    (chat(temperature=True), 400, "temperature"),
    (chat(temperature="0.5"), 400, "temperature"),
    (chat(top_p=False), 400, "top_p"),
    (chat(logit_bias={"5": True}), 400, "logit_bias"),
    (chat(kvblend={"reuse": "blend", "ratio": True}), 400, "ratio"),
    ({**chat(), "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}, 400,
     "last message must be the user's question"),
    ({**chat(), "messages": [{"role": "system", "content": "s"}]}, 400, "last message must be the user's question"),
    ({**chat(), "messages": [{"role": "user", "content": " "}, {"role": "assistant", "content": "b"},
                             {"role": "user", "content": "c"}]}, 400, "history turn 1 (user) is empty"),
    ({**chat(), "messages": [{"role": "tool", "content": "a"}, {"role": "user", "content": "c"}]}, 400, "messages"),
    ({**chat(), "messages": [{"role": "user", "content": "   "}]}, 400, "question is empty"),
    (chat(model="gpt-4o"), 404, "not served here"),
    ({"model": TINY, "prompt": ["a", "b"]}, 400, "exactly one prompt"),
])
def test_bad_requests_get_a_clear_4xx_and_the_server_keeps_serving(srv, body, status, needle):
    path = "/v1/completions" if isinstance(body, dict) and "prompt" in body else "/v1/chat/completions"
    r = post(srv, None if isinstance(body, bytes) else body, raw=body if isinstance(body, bytes) else None, path=path)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"]
    assert post(srv, chat(max_tokens=2)).status_code == 200


def test_vllm_sampling_fields_at_their_neutral_values_are_accepted(srv):
    neutral = dict(best_of=1, min_tokens=0, min_p=0.0, repetition_penalty=1.0, stop_token_ids=[],
                   include_stop_str_in_output=False, skip_special_tokens=True, use_beam_search=False)
    assert post(srv, chat(max_tokens=2, **neutral)).status_code == 200
    assert post(srv, chat(max_tokens=2, **{k: None for k in neutral})).status_code == 200


def test_integer_valued_numbers_are_accepted_where_a_float_is_asked(srv):
    assert post(srv, chat(max_tokens=2, temperature=0, top_p=1, kvblend={"reuse": "blend", "ratio": 1})).status_code == 200


def test_api_key_is_checked_before_anything_else(srv):
    for key in (None, "wrong"):
        r = post(srv, chat(), key=key)
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
        assert r.headers["www-authenticate"] == "Bearer"
        assert post(srv, None, key=key, raw=b"{not json").status_code == 401
    assert httpx.get(srv.url + "/v1/models").status_code == 401
    assert httpx.get(srv.url + "/health").json()["status"] == "ok"  # health and metrics stay open
    assert httpx.get(srv.url + "/metrics").status_code == 200


def test_an_oversized_body_is_refused_without_reading_it(srv):
    r = post(srv, None, raw=b"x" * (LIMITS.max_body_bytes + 1))
    assert r.status_code == 413 and "exceeds 64000 bytes" in r.json()["error"]["message"]


def test_unknown_path_and_method_are_json_errors(srv):
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.get(srv.url + "/v1/nothing", headers=auth)
    assert r.status_code == 404 and r.json()["error"]["message"]
    assert httpx.get(srv.url + "/nothing").status_code == 404
    assert httpx.get(srv.url + "/v1/chat/completions", headers=auth).status_code == 405


def test_cache_salt_isolates_tenants(srv):
    docs = make_docs(2, seed=31)
    def cached(salt: str) -> int:
        r = post(srv, chat(documents=docs, cache_salt=salt, max_tokens=2)).json()
        return r["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0  # another salt finds nothing, not even the preamble
    assert cached("tenant-a") > 0


def test_client_disconnect_cancels_the_request(srv):
    sched = srv.scheduler
    before = sched.cancelled
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=chat(max_tokens=1900, stream=True, ignore_eos=True),
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        next(lines)
        lines.close()  # the client goes away mid-stream
    with pytest.raises(httpx.ReadTimeout):  # a non-streamed request whose client gives up
        httpx.post(srv.url + "/v1/chat/completions", json=chat(max_tokens=1900, ignore_eos=True),
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=0.5)
    deadline = time.monotonic() + 20
    while (sched.cancelled < before + 2 or sched.active) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sched.cancelled == before + 2 and sched.active == 0


def _metric(text: str, name: str) -> float:
    return float(next(line for line in text.splitlines() if line.startswith(name + " ")).split()[-1])


def test_metrics_expose_requests_latency_reuse_and_store(srv):
    post(srv, chat(max_tokens=2))
    post(srv, chat(max_tokens=2))
    assert post(srv, chat(max_tokens=0)).status_code == 400  # a refused request of its own (the test runs alone too)
    guarded_before = _metric(httpx.get(srv.url + "/metrics").text, "kvblend_guarded_requests_total")
    post(srv, chat(max_tokens=2, kvblend={"reuse": "blend", "ratio": 0.2, "guard_margin": None}))  # unguarded
    # documents in a new order (so blended, not exact) and a margin no first token clears: the guard
    # recomputes the request, and the counter says so
    guarded = post(srv, {**chat(max_tokens=2, kvblend={"reuse": "blend", "ratio": 0.2, "guard_margin": 1e9}),
                         "documents": DOCS[::-1]}).json()
    text = httpx.get(srv.url + "/metrics").text
    assert guarded["kvblend"]["report"]["guard"]
    assert _metric(text, "kvblend_guarded_requests_total") == guarded_before + 1
    for needle in ('kvblend_requests_total{endpoint="/v1/chat/completions",status="200"}',
                   'kvblend_requests_total{endpoint="/v1/chat/completions",status="400"}',
                   "kvblend_ttft_seconds_count", "kvblend_e2e_seconds_count", "kvblend_output_tokens_total",
                   "kvblend_output_tokens_per_second", 'kvblend_segments_total{class="exact"}',
                   'kvblend_store_lookups_total{result="hit"}', 'kvblend_store_lookups_total{result="miss"}',
                   "kvblend_recomputed_fraction_count", "kvblend_queue_depth", "kvblend_active_requests",
                   "kvblend_decode_batch_size_count", "kvblend_cached_tokens_total"):
        assert needle in text, needle
    hits = [line for line in text.splitlines() if line.startswith('kvblend_store_lookups_total{result="hit"}')]
    assert float(hits[0].split()[-1]) > 0
    # the model's recycled KV buffers: requests after the first took a finished one's buffers
    assert _metric(text, 'kvblend_kv_pool_buffers_total{source="reused"}') > 0
    assert _metric(text, 'kvblend_kv_pool_bytes{state="free"}') >= 0
    assert 'kvblend_kv_pool_bytes{state="pending"}' in text


def test_a_full_queue_answers_429_with_retry_after(one_torch_thread):
    engine = tiny_serve_engine()
    config = ServeConfig(model=TINY, limits=LIMITS, scheduler=SchedulerConfig(max_concurrency=1, max_queue=0))
    with running_server(engine, config) as s:
        with httpx.stream("POST", s.url + "/v1/chat/completions", json=chat(max_tokens=1900, stream=True, ignore_eos=True),
                          timeout=30) as busy:
            lines = busy.iter_lines()  # keep the iterator: dropping it closes the connection
            next(lines)  # the one slot is taken
            r = httpx.post(s.url + "/v1/chat/completions", json=chat(max_tokens=2), timeout=30)
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
            assert "max_queue=0" in r.json()["error"]["message"]
        deadline = time.monotonic() + 20
        while s.scheduler.active and time.monotonic() < deadline:
            time.sleep(0.02)
        assert httpx.post(s.url + "/v1/chat/completions", json=chat(max_tokens=2), timeout=30).status_code == 200


def test_semantic_reuse_needs_the_server_flag_and_then_works(one_torch_thread):
    engine = tiny_serve_engine(experimental_semantic=True)
    with running_server(engine, ServeConfig(model=TINY, experimental_semantic=True)) as s:
        docs = make_docs(2, words=40, seed=8)
        edited = [docs[0], docs[1].replace("(doc 1)", "(doc one)")]
        first = httpx.post(s.url + "/v1/chat/completions", timeout=60, json=chat(
            documents=docs, kvblend={"reuse": "blend", "ratio": 0.2, "semantic": True})).json()
        assert first["kvblend"]["report"]["policy"].startswith("blend")
        again = httpx.post(s.url + "/v1/chat/completions", timeout=60, json=chat(
            documents=edited, kvblend={"reuse": "blend", "ratio": 0.2, "semantic": True})).json()
        classes = [seg["class"] for seg in again["kvblend"]["report"]["segments"]]
        assert classes[2] == "semantic"  # the edited document reused its near-duplicate's KV
        salted = httpx.post(s.url + "/v1/chat/completions", timeout=60, json=chat(
            documents=edited, cache_salt="t", kvblend={"reuse": "blend", "semantic": True}))
        assert salted.status_code == 400 and "cache_salt" in salted.json()["error"]["message"]


def test_chat_logprob_bytes_are_each_tokens_own_bytes_so_split_characters_join_up():
    """OpenAI's ``bytes`` is the token's UTF-8 bytes, so that a character spread over several tokens
    can be put back together: the pieces' bytes, joined, are the answer's text (a piece's own text
    is U+FFFD, whose bytes would join up to garbage)."""
    from blend.logprobs import TokenLogprob
    from blend.serve.protocol import Endpoint, LogprobFormat
    from blend.tiny import byte_tokenizer

    text = "aé😀 東"
    ids = list(text.encode("utf-8"))  # the byte tokenizer: one token per byte
    entries = tuple(TokenLogprob(t, -1.0, ((t, -1.0), (ord("x"), -2.0))) for t in ids)
    content = LogprobFormat(Endpoint.CHAT, byte_tokenizer(), True).format(entries)["content"]
    assert [c["bytes"] for c in content] == [[b] for b in ids]
    assert bytes(b for c in content for b in c["bytes"]).decode("utf-8") == text
    assert [c["top_logprobs"][0]["bytes"] for c in content] == [[b] for b in ids]  # alternatives too
    assert content[0]["token"] == "a" and content[1]["token"] == "\ufffd"  # the token's text: its own decoding


def test_a_long_conversation_that_cannot_fit_is_refused_before_it_is_laid_out(srv):
    """Laying out a conversation re-renders it per turn (quadratic): one whose texts alone exceed the
    context is refused first (255 such messages took 30-60 s of CPU, then a 400 anyway)."""
    import time as _time
    big = "word " * (srv.engine.dims.max_positions // 4)
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": big} for i in range(11)]
    t = _time.perf_counter()
    r = post(srv, {**chat(), "messages": messages})
    # over this server's --max-prompt-tokens (3000) as well as the context: a 413, as without history
    assert r.status_code == 413 and "texts alone" in r.json()["error"]["message"], r.text
    assert _time.perf_counter() - t < 30


def _raw_request(srv, head: bytes, body: bytes = b"", wait_s: float = 5.0) -> bytes:
    """Send a request's head (and part of its body) on a raw socket; what the server answers within wait_s."""
    url = urlparse(srv.url)
    with socket.create_connection((url.hostname, url.port), timeout=wait_s) as s:
        s.sendall(head + body)
        try:
            return s.recv(4096)
        except socket.timeout:
            return b""


def test_a_stalled_body_is_a_408_and_other_routes_never_wait_for_one(one_torch_thread):
    """Nothing timed out receiving a body: a client that sent 10 of 1000 announced bytes held its connection
    and buffers for ever, and a POST to /health (no API key needed) was buffered whole before any check."""
    engine = tiny_serve_engine()
    limits = Limits(max_body_bytes=64_000, body_timeout_s=0.5)
    with running_server(engine, ServeConfig(model=TINY, api_key=KEY, limits=limits)) as srv:
        head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 1000\r\n\r\n")
        t0 = time.monotonic()
        answer = _raw_request(srv, head, b'{"model": "')
        assert answer.startswith(b"HTTP/1.1 408") and time.monotonic() - t0 < 4.0
        other = b"POST /health HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n"
        assert _raw_request(srv, other, wait_s=3.0).split(b" ")[1] in (b"404", b"405")  # at once: nothing read
        assert post(srv, chat(max_tokens=2)).status_code == 200  # still serving


def _read_until_closed(s: socket.socket, limit_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection (or ``limit_s`` passes), and when."""
    t0, got = time.monotonic(), b""
    s.settimeout(limit_s)
    try:
        while chunk := s.recv(4096):
            got += chunk
    except (socket.timeout, ConnectionResetError):
        pass
    return got, time.monotonic() - t0


def test_a_request_head_that_never_completes_ends_its_connection_and_frees_its_slot(one_torch_thread):
    """uvicorn had no deadline for a request's line and headers: connections that sent nothing, or a head
    a few bytes at a time, were held for ever, and --max-connections of them made every request a 503."""
    engine = tiny_serve_engine()
    limits = Limits(head_timeout_s=0.6, max_connections=4)
    with running_server(engine, ServeConfig(model=TINY, api_key=KEY, limits=limits)) as srv:
        url = urlparse(srv.url)
        silent = [socket.create_connection((url.hostname, url.port)) for _ in range(4)]
        trickle, t0 = socket.create_connection((url.hostname, url.port)), time.monotonic()
        for b in b"POST":  # a byte every 0.1 s: under any per-read timeout, never a whole head
            trickle.sendall(bytes([b]))
            time.sleep(0.1)
        answer, _ = _read_until_closed(trickle, 5.0)
        assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer
        assert time.monotonic() - t0 < 2.0
        for s in silent:
            got, after_s = _read_until_closed(s, 5.0)
            assert got == b"" and after_s < 2.0  # closed, nothing said: no request had begun
            s.close()
        trickle.close()
        assert post(srv, chat(max_tokens=2)).status_code == 200  # the slots are free again
        with socket.create_connection((url.hostname, url.port)) as s:  # keep-alive: the next head is timed too
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            first = s.recv(4096)
            while not first.endswith(b"}"):  # the whole response (head and JSON body)
                first += s.recv(4096)
            assert first.startswith(b"HTTP/1.1 200")
            s.sendall(b"GET /hea")
            got, after_s = _read_until_closed(s, 10.0)  # uvicorn's own keep-alive timer stops at the first byte
            assert got.startswith(b"HTTP/1.1 408") and after_s < 2.0
        with socket.create_connection((url.hostname, url.port)) as s:  # a slow head within the deadline is served
            for part in (b"GET /health HTTP/1.1\r\n", b"Host: x\r\n", b"\r\n"):
                s.sendall(part)
                time.sleep(0.15)
            assert s.recv(4096).startswith(b"HTTP/1.1 200")


def test_a_body_still_arriving_after_its_request_was_answered_has_the_head_deadline_too(one_torch_thread):
    """A request answered before its body ended (a 401 needs no body) left the connection in the body's
    state, where no deadline ran: the rest trickled in for ever, then the connection idled untimed."""
    engine = tiny_serve_engine()
    limits = Limits(head_timeout_s=0.6, max_connections=4)
    with running_server(engine, ServeConfig(model=TINY, api_key=KEY, limits=limits)) as srv:
        url = urlparse(srv.url)
        with socket.create_connection((url.hostname, url.port)) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
            t0 = time.monotonic()
            first = s.recv(4096)
            assert first.startswith(b"HTTP/1.1 401")  # no key: answered before the body
            closed = False
            try:
                for _ in range(40):  # a body byte every 0.1 s: over 4 s if nothing cuts it
                    s.sendall(b"x")
                    time.sleep(0.1)
            except (BrokenPipeError, ConnectionResetError):
                closed = True
            if not closed:
                got, _ = _read_until_closed(s, 3.0)
                closed = got == b"" or got.endswith(b"}")
            assert closed and time.monotonic() - t0 < 3.0
        with socket.create_connection((url.hostname, url.port)) as s:  # a partial head behind a pipelined one
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /hea")
            got, after_s = _read_until_closed(s, 5.0)
            assert got.startswith(b"HTTP/1.1 200") and b"HTTP/1.1 408" in got and after_s < 2.0


@pytest.mark.parametrize("field", ["head_timeout_s", "body_timeout_s", "write_timeout_s"])
@pytest.mark.parametrize("value", [0.0, -1.0, float("nan")])
def test_a_timeout_must_be_positive(field, value):
    with pytest.raises(ValueError, match="timeouts must be > 0"):
        Limits(**{field: value})  # a negative body timeout made every request a 408


def test_document_titles_count_toward_preparing_a_large_request_off_the_event_loop():
    from blend.serve.schemas import ChatCompletionRequest

    body = ChatCompletionRequest(messages=[{"role": "user", "content": "q"}], documents=[{"title": "t" * 50_000, "text": "x"}])
    assert body.text_chars() >= 50_001  # titles were not counted: 1 MB of them was tokenized inline


def test_a_short_conversation_too_long_for_the_context_is_refused_before_its_layout(srv):
    """Only conversations of over 8 earlier turns were counted before their layout, which renders the
    conversation once per turn: an 8-turn one of 880 KB took 3.6 s to be refused."""
    big = "word " * 500  # 5 tokens a word (the tiny byte tokenizer): 2500, ~3130 with the documents
    body = {**chat(), "messages": [{"role": "user", "content": big}, {"role": "assistant", "content": "ok"},
                                   {"role": "user", "content": "and?"}]}
    r = post(srv, body)  # over the server's --max-prompt-tokens (3000), under the model's context: a 413
    assert r.status_code == 413 and "texts alone" in r.json()["error"]["message"], r.text
    body["messages"][0]["content"] = "word " * 900  # 4500 tokens: over both; the server's limit first, as
    r = post(srv, body)  # a request without history gets it
    assert r.status_code == 413, r.text
    no_history = post(srv, {**chat(), "messages": [{"role": "user", "content": "word " * 900}]})
    assert no_history.status_code == 413, no_history.text


def test_on_loopback_without_a_key_only_loopback_host_names_are_answered(one_torch_thread):
    """Nothing checked Host: a page whose own name an attacker resolved to 127.0.0.1 (DNS rebinding) called the
    API as same-origin and read the answers."""
    from blend.serve.cli import build_parser, config_from_args
    from blend.serve.config import default_allowed_hosts, host_name

    config = config_from_args(build_parser().parse_args(["--model", TINY]))
    assert config.allowed_hosts == ("localhost", "127.0.0.1", "::1")
    with running_server(tiny_serve_engine(), ServeConfig(model=TINY, allowed_hosts=config.allowed_hosts)) as srv:
        port = urlparse(srv.url).port
        assert httpx.get(srv.url + "/v1/models").status_code == 200  # Host: 127.0.0.1:PORT
        assert httpx.get(srv.url + "/health", headers={"Host": f"localhost:{port}"}).status_code == 200
        r = httpx.get(srv.url + "/v1/models", headers={"Host": f"rebind.example:{port}"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "host_not_allowed"
        assert httpx.get(srv.url + "/", headers={"Host": "rebind.example"}).status_code == 400
    assert default_allowed_hosts("127.0.0.1", None, "box.lan") == ("localhost", "127.0.0.1", "::1", "box.lan")
    assert default_allowed_hosts("127.0.0.1", "key", None) is None  # a key guards it: any name
    assert default_allowed_hosts("0.0.0.0", None, None) is None and default_allowed_hosts("127.0.0.1", None, "*") is None
    assert [host_name(h) for h in ("[::1]:8000", "LocalHost:80", "::1", "a.b")] == ["::1", "localhost", "::1", "a.b"]


def test_openai_edge_values_of_seed_and_top_p_are_accepted(srv):
    """OpenAI's seed is any signed 64-bit integer (tools send -1) and its top_p may be 0 (the most likely token);
    both were 400s. Out of range stays a 400."""
    for extra in ({"seed": -1, "temperature": 0.8}, {"seed": -(2**63), "temperature": 0.8},
                  {"top_p": 0.0, "temperature": 0.8, "seed": 5}):
        r = post(srv, chat(max_tokens=2, **extra))
        assert r.status_code == 200, (extra, r.text)
        assert r.json()["kvblend"]["seed"] == extra["seed"]
    greedy = post(srv, chat(max_tokens=3, temperature=0.0)).json()["choices"][0]["message"]["content"]
    top0 = post(srv, chat(max_tokens=3, temperature=0.9, top_p=0.0, seed=11)).json()["choices"][0]["message"]["content"]
    assert top0 == greedy  # top_p 0 keeps only the most likely token at every step
    assert post(srv, chat(seed=-(2**63) - 1)).status_code == 400
    assert post(srv, chat(top_p=-0.01)).status_code == 400
