"""An answer that ends inside a multi-byte character ends with its U+FFFD, the same in the Python API
(streamed or not), the server's streamed and whole responses and ``Engine.generate``; its text is
``decode(token_ids)``, so usage and logprobs count no token that has no text."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from _serve_util import TINY, one_torch_thread, running_server, tiny_serve_engine  # noqa: F401
from blend.generation import FinishReason, TokenStream, generate, stream
from blend.policy import ReusePolicy
from blend.sampling import GenerationConfig
from blend.tiny import byte_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOK = byte_tokenizer()
EOS = 258
LEAD = 0xE6  # the first byte of a three-byte character ("æ..." in UTF-8): alone, it decodes to U+FFFD


def forced(token: int) -> torch.Tensor:
    x = torch.full((259,), -10.0)  # (V,)
    x[token] = 10.0
    return x


def feed(data: list[int], **cfg) -> tuple[TokenStream, list[str]]:
    s = TokenStream(TOK, {EOS}, GenerationConfig(**{"max_tokens": 100, **cfg}))
    deltas = [s.step(forced(t)) for t in data if not s.finished]
    return s, deltas


@pytest.mark.parametrize("data, cfg, reason", [
    (list(b"ab\xe6"), {"max_tokens": 3}, FinishReason.LENGTH),  # max_tokens inside a character
    (list(b"ab\xe6\x97") + [EOS], {}, FinishReason.STOP),  # EOS inside one
    (list(b"ab\xe6"), {"max_tokens": 3, "stop": ("zz",)}, FinishReason.LENGTH),  # a stop string that never came
])
def test_an_answer_ending_inside_a_character_keeps_its_replacement_character(data, cfg, reason):
    s, deltas = feed(data, **cfg)
    assert s.finish_reason is reason
    assert s.text == "ab\ufffd" == "".join(deltas) == TOK.decode(s.tokens, skip_special_tokens=True)
    assert deltas[-1] == "\ufffd"  # held back while the character could complete, flushed at the end


def test_a_character_completed_before_the_end_is_streamed_whole():
    s, deltas = feed(list("ab\u00e6".encode()), max_tokens=4)
    assert s.text == "ab\u00e6" and [d for d in deltas if d] == ["a", "b", "\u00e6"]


def test_the_python_apis_agree_on_an_answer_cut_inside_a_character(tiny_engine):
    prompt = tiny_engine.build_prompt("which river?", [])
    cfg = GenerationConfig(max_tokens=3, temperature=0, logit_bias=((LEAD, 100.0),), logprobs=0)
    g = stream(tiny_engine, prompt, config=cfg)
    pieces = list(g)
    done = g.result()
    assert done.token_ids == [LEAD] * 3 and done.finish_reason is FinishReason.LENGTH
    assert done.text == "".join(pieces) == tiny_engine.tokenizer.decode(done.token_ids) == "\ufffd" * 3
    assert generate(tiny_engine, prompt, config=cfg).text == done.text
    assert len(done.logprobs) == done.usage.completion_tokens == 3


def test_the_server_streams_and_answers_the_same_text_as_the_python_api():
    engine = tiny_serve_engine()
    body = {"model": TINY, "prompt": "which river?", "max_tokens": 1, "temperature": 0,
            "logit_bias": {str(LEAD): 100}, "logprobs": 0}
    with running_server(engine) as s:
        whole = httpx.post(s.url + "/v1/completions", json=body, timeout=60).json()
        events = httpx.post(s.url + "/v1/completions", json={**body, "stream": True}, timeout=60).text
        chat = httpx.post(s.url + "/v1/chat/completions", timeout=60, json={
            "model": TINY, "messages": [{"role": "user", "content": "which river?"}], "max_tokens": 1,
            "temperature": 0, "logit_bias": {str(LEAD): 100}}).json()
    choice = whole["choices"][0]
    assert choice["text"] == "\ufffd" and choice["finish_reason"] == "length"
    assert whole["usage"]["completion_tokens"] == 1 and whole["kvblend"]["answer_token_ids"] == [LEAD]
    lp = choice["logprobs"]
    assert lp["tokens"] == ["\ufffd"] and lp["text_offset"] == [0]  # the token's text is in the answer
    chunks = [json.loads(e[len("data: "):]) for e in events.split("\n\n") if e and e != "data: [DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "\ufffd"
    assert chat["choices"][0]["message"]["content"] == "\ufffd"
    ref = generate(engine, engine.build_prompt("which river?", []), ReusePolicy.exact(),
                   GenerationConfig(max_tokens=1, temperature=0, logit_bias=((LEAD, 100.0),)))
    assert ref.text == "\ufffd"
