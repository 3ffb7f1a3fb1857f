"""What the CLI prints with --json and what the server sends is valid JSON: a figure that does not
exist or could not be measured (NaN, infinity) is null, never Python's ``NaN``/``Infinity`` tokens,
which strict parsers (JavaScript, jq, Go, serde) refuse and Starlette's JSONResponse turns into a 500."""

from __future__ import annotations

import dataclasses
import json
import math
from types import SimpleNamespace

import pytest

from _json_util import strict_loads
from blend import json_text


def test_dumps_writes_null_for_every_non_finite_float_and_leaves_the_rest() -> None:
    obj = {"a": math.nan, "b": [1.5, math.inf, (-math.inf, 2)], "c": {"d": True, "e": "NaN", "f": 3}}
    text = json_text.dumps(obj, indent=1)
    assert strict_loads(text) == {"a": None, "b": [1.5, None, [None, 2]], "c": {"d": True, "e": "NaN", "f": 3}}
    assert obj["a"] != obj["a"] and obj["b"][1] == math.inf  # the caller's value is not changed
    clean = {"x": [1.0, 2], "y": "z"}
    assert json_text.finite(clean) is clean and json_text.dumps(clean) == json.dumps(clean)


def test_finite_keeps_tuples_as_tuples_where_asked() -> None:
    """The eval rows' frozen fields (``ttft_samples``) stay tuples; JSON's copy writes lists."""
    row = (1.5, math.nan, (math.inf, 2.0))
    assert json_text.finite(row) == [1.5, None, [None, 2.0]]
    kept = json_text.finite(row, keep_tuples=True)
    assert kept == (1.5, None, (None, 2.0)) and type(kept) is tuple and type(kept[2]) is tuple
    assert json_text.finite({"a": [math.nan]}, keep_tuples=True) == {"a": [None]}  # a list stays a list
    clean = (1.0, 2.0)
    assert json_text.finite(clean, keep_tuples=True) is clean


def _nan_completion(tiny_engine):
    """A real completion whose report and logprobs carry non-finite figures (a model that overflowed)."""
    from blend.generation import generate
    from blend.logprobs import TokenLogprob
    from blend.sampling import GenerationConfig

    prompt = tiny_engine.build_prompt("Which word?", ["alpha beta gamma", "delta epsilon"])
    c = generate(tiny_engine, prompt, None, GenerationConfig(max_tokens=2, stop_at_newline=False, logprobs=1))
    report = dataclasses.replace(c.report, first_token_margin=math.nan, spent=math.inf)
    lps = tuple(TokenLogprob(e.token_id, math.nan, ((e.token_id, -math.inf),)) for e in c.logprobs)
    return dataclasses.replace(c, report=report, logprobs=lps, ttft_s=math.nan), prompt


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_server_bodies_and_stream_chunks_are_strict_json_with_non_finite_figures(tiny_engine, endpoint) -> None:
    from starlette.responses import JSONResponse

    from blend.serve.protocol import (
        Endpoint, LogprobFormat, ResponseHead, final_chunk, full_body, kvblend_extension, text_chunk,
    )

    c, prompt = _nan_completion(tiny_engine)
    head = ResponseHead.new(Endpoint(endpoint), "tiny-llama")
    fmt = LogprobFormat(head.endpoint, tiny_engine.tokenizer, True)
    ext = kvblend_extension(c, prompt, tiny_engine.tokenizer, return_tokens=False)
    body = strict_loads(JSONResponse(full_body(head, c, ext, fmt)).body.decode())  # refused NaN: a 500
    assert body["kvblend"]["report"]["first_token_margin"] is None and body["kvblend"]["ttft_s"] is None
    assert body["kvblend"]["report"]["spent"] is None
    chunks = [text_chunk(head, "x", first=True, logprobs=fmt.format(c.logprobs)),
              final_chunk(head, c, ext, logprobs=fmt.format(c.logprobs))]
    for event in chunks:
        assert event.startswith("data: ")
        strict_loads(event[len("data: "):])
    last = strict_loads(chunks[-1][len("data: "):])
    assert last["kvblend"]["report"]["first_token_margin"] is None


def test_cli_ask_json_writes_null_for_a_non_finite_figure(tiny_engine, tmp_path, monkeypatch, capsys) -> None:
    import blend.cli as C

    doc = tmp_path / "doc.txt"
    doc.write_text("alpha beta gamma")
    real = C.generate_answer
    monkeypatch.setattr(C, "engine_from_args", lambda args: tiny_engine)
    monkeypatch.setattr(C, "generate_answer", lambda *a: dataclasses.replace(
        real(*a), ttft_s=math.inf, report=dataclasses.replace(real(*a).report, first_token_margin=math.nan)))
    assert C.main(["ask", "Which word?", "--doc", str(doc), "--model", "tiny-llama", "--json",
                   "--max-new-tokens", "2"]) == 0
    out = strict_loads(capsys.readouterr().out)
    assert out["ttft_s"] is None and out["report"]["first_token_margin"] is None


def test_cli_check_json_writes_null_for_a_check_that_measured_nan(monkeypatch, capsys) -> None:
    import blend.cli as C
    import blend.gate as G

    result = G.GateResult("tiny-llama", "0" * 64, (G.CheckResult.judged(G.CheckName.FIDELITY_KL, math.nan, 0.5, "nan"),))
    monkeypatch.setattr(C, "engine_from_args", lambda args: SimpleNamespace(model_name="tiny-llama"))
    monkeypatch.setattr(G, "run_gate", lambda engine, items, progress: result)
    monkeypatch.setattr(G, "record", lambda engine, result, items: None)
    assert C.main(["check", "--model", "tiny-llama", "--json"]) == 1  # NaN fails its check
    out = strict_loads(capsys.readouterr().out)
    assert out["passed"] is False and out["checks"][0]["figure"] is None


@pytest.mark.parametrize("mode", ["json", "sse"])
def test_the_vllm_chat_rewrite_sends_strict_json(mode) -> None:
    """The documents middleware re-encodes vLLM's completions answer as a chat answer: a non-finite figure in
    what it re-encodes (kvblend's report, a logprob) went out as NaN/-Infinity."""
    import asyncio

    from blend.integrations.vllm.middleware import _ChatSend

    sent: list[dict] = []

    async def send(msg: dict) -> None:
        sent.append(msg)

    body = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "text": "hi", "finish_reason": "stop", "logprobs": None}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            "kv_transfer_params": {"kvblend": {"load_s": math.nan}}, "metrics": {"ttft": math.inf}}
    raw = json.dumps(body).encode()  # as Python's json writes them: NaN, Infinity
    ctype = b"application/json" if mode == "json" else b"text/event-stream"
    payload = raw if mode == "json" else b"data: " + raw + b"\n\ndata: [DONE]\n\n"

    async def run() -> None:
        chat = _ChatSend(send)
        await chat({"type": "http.response.start", "status": 200, "headers": [(b"content-type", ctype)]})
        await chat({"type": "http.response.body", "body": payload, "more_body": False})

    asyncio.run(run())
    out = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body").decode()
    text = out if mode == "json" else out.split("\n\n")[0][len("data: "):]
    got = strict_loads(text)
    assert got["object"].startswith("chat.completion") and got["metrics"]["ttft"] is None
    if mode == "json":
        assert got["kv_transfer_params"]["kvblend"]["load_s"] is None
