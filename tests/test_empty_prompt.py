"""``/v1/completions`` with ``"prompt": ""`` (OpenAI accepts it): a model with a BOS token generates
from the BOS token alone; one without gets a 400 that says why (it was a 400 "the question is empty"
for every model)."""

from __future__ import annotations

import httpx
import pytest

from _serve_util import TINY, one_torch_thread, running_server, tiny_serve_engine  # noqa: F401
from blend.errors import InvalidRequestError
from blend.generation import generate
from blend.policy import ReusePolicy
from blend.prompt import bos_prompt
from blend.sampling import GenerationConfig
from blend.tiny import byte_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def completion(url: str, **kw) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=60,
                      json={"model": TINY, "prompt": "", "max_tokens": 4, "temperature": 0, **kw})


def test_an_empty_prompt_generates_from_bos_streamed_or_not_under_any_reuse():
    engine = tiny_serve_engine()
    bos = engine.tokenizer.bos_token_id
    assert bos is not None
    ref = generate(engine, bos_prompt(engine.tokenizer), ReusePolicy.none(), GenerationConfig(max_tokens=4))
    with running_server(engine) as s:
        r = completion(s.url)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["prompt_tokens"] == 1 and body["kvblend"]["answer_token_ids"] == ref.token_ids
        assert body["choices"][0]["text"] == ref.text
        as_list = completion(s.url, prompt=[""]).json()  # a one-element list is one prompt
        assert as_list["kvblend"]["answer_token_ids"] == ref.token_ids
        for reuse in ("exact", "blend"):  # nothing to reuse: the same tokens, nothing stored
            again = completion(s.url, kvblend={"reuse": reuse}).json()
            assert again["kvblend"]["answer_token_ids"] == ref.token_ids, again
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        events = completion(s.url, stream=True)
        assert events.status_code == 200 and events.text.rstrip().endswith("data: [DONE]")
        with_docs = completion(s.url, documents=["a document"])
        assert with_docs.status_code == 400 and "prompt is empty" in with_docs.json()["error"]["message"]
        assert with_docs.json()["error"]["param"] == "prompt"
    assert engine.store.inner.stats().entries == 0  # a lone question is never stored


def test_a_blend_of_the_bos_prompt_is_refused_and_computes_it_once(tiny_engine):
    prompt = bos_prompt(tiny_engine.tokenizer)
    blended = generate(tiny_engine, prompt, ReusePolicy.blend(ratio=0.3), GenerationConfig(max_tokens=4))
    plain = generate(tiny_engine, prompt, ReusePolicy.none(), GenerationConfig(max_tokens=4))
    assert blended.token_ids == plain.token_ids  # the BOS row once (a blend laid it as preamble and question)
    assert "no document to blend" in blended.report.gate and sum(s.tokens for s in blended.report.segments) == 1


def test_without_a_bos_token_an_empty_prompt_is_a_400_that_says_so():
    no_bos = byte_tokenizer()
    no_bos.bos_token = None
    assert no_bos.bos_token_id is None
    with pytest.raises(InvalidRequestError, match="no BOS token"):
        bos_prompt(no_bos)
    engine = tiny_serve_engine()
    engine.tokenizer = no_bos
    with running_server(engine) as s:
        r = completion(s.url)
        ok = completion(s.url, prompt="which river?")
    assert r.status_code == 400 and "no BOS token" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "prompt"
    assert ok.status_code == 200, ok.text
