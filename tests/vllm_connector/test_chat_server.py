"""vLLM's OpenAI server with the connector and kvblend's documents middleware (issue 17): the chat
API's ``documents`` reach the connector as document spans of kvblend's own prompt.

One ``vllm.entrypoints.openai.api_server`` process (its engine core in a second one, vLLM's default)
on a free loopback port (start-up ~30-60 s),
prefix caching on (so the blend's salt is exercised), driven by the official ``openai`` client.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from blend.evals.data import load_items  # noqa: E402
from blend.integrations.vllm.plan import PARAMS_KEY  # noqa: E402
from blend.models import SMOLLM2, convert_gguf  # noqa: E402
from blend.prompt import build_prompt  # noqa: E402

pytestmark = pytest.mark.real
DATA = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "musique_dev.json")
CONNECTOR = ('{"kv_connector": "KVBlendConnector", "kv_connector_module_path": "blend.integrations.vllm", '
             '"kv_role": "kv_both", "kv_connector_extra_config": {"store": "memory", "force": true}}')
START_S = 300
API_KEY = "kvblend-test-key"  # the server authenticates: the middleware must leave a wrong key to vLLM's 401


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model, port = str(convert_gguf(SMOLLM2)), _free_port()
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    # the engine core in its own process, as vLLM serves by default (the in-process LLM tests run without)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", "float32",
           "--enforce-eager", "--max-model-len", "4096", "--host", "127.0.0.1", "--port", str(port),
           "--kv-transfer-config", CONNECTOR, "--api-key", API_KEY, "--middleware", "blend.integrations.vllm.middleware.DocumentsMiddleware"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0)
    deadline = time.monotonic() + START_S
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM server exited: {log.read_text()[-3000:]}")
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                if time.monotonic() > deadline:
                    pytest.fail(f"vLLM server did not start in {START_S} s: {log.read_text()[-3000:]}")
                time.sleep(1)
        yield client, model
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _item(i: int):
    it = load_items(DATA, None, 5)[i]
    return it.question, [t[:480] for t in it.document_texts()]


def _chat(client, model, question, docs, stream=False, **kw):
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}], temperature=0, max_tokens=12,
        stream=stream, extra_body={"documents": [{"text": d} for d in docs],
                                   "kv_transfer_params": {PARAMS_KEY: {"mode": "blend", "ratio": 0.15}}, **kw})


def test_a_chat_with_documents_is_blended_over_kvblends_prompt(server):
    from transformers import AutoTokenizer

    client, model = server
    question, docs = _item(7)
    prompt = build_prompt(AutoTokenizer.from_pretrained(model), question, docs)
    r = _chat(client, model, question, docs)
    rep = r.model_extra["kv_transfer_params"][PARAMS_KEY]
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert rep["claim"] == "blend" and "error" not in rep  # the salt the middleware set was accepted
    assert rep["claimed_tokens"] == len(prompt) - len(prompt.question)  # every row before the question
    assert len(rep["classes"]) == len(prompt.segments)
    assert r.usage.prompt_tokens == len(prompt)
    # the same prompt and blend through /v1/completions as token ids: the same answer
    from blend.integrations.vllm import blend_request, prompt_spans
    from blend.integrations.vllm.plan import blend_salt

    params = blend_request(prompt.token_ids, prompt_spans([len(s) for s in prompt.segments]), ratio=0.15)
    c = client.completions.create(model=model, prompt=prompt.token_ids, temperature=0, max_tokens=12,
                                  extra_body={"kv_transfer_params": params,
                                              "cache_salt": blend_salt(params, prompt.token_ids)})
    assert c.choices[0].text == r.choices[0].message.content and r.choices[0].message.content
    # logprobs: vLLM's completions logprobs, in the chat form
    lp = _chat(client, model, question, docs, logprobs=True, top_logprobs=2).choices[0].logprobs
    assert lp is not None and len(lp.content) > 0
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
               and t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-4) for t in lp.content)  # greedy


def test_a_streamed_chat_with_documents_equals_the_whole_answer(server):
    client, model = server
    question, docs = _item(8)
    r = _chat(client, model, question, list(reversed(docs)))
    whole, rep = r.choices[0].message.content, r.model_extra["kv_transfer_params"][PARAMS_KEY]
    # another tenant's salt: vLLM's prefix cache does not answer it, so the stream is blended afresh
    parts = [ch for ch in _chat(client, model, question, list(reversed(docs)), stream=True, cache_salt="t2")]
    assert all(p.object == "chat.completion.chunk" for p in parts)
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == whole
    assert parts[0].choices[0].delta.role == "assistant"
    # vLLM's stream carries no kv_transfer_params; the middleware puts the report in the finishing chunk
    reported = [(bool(p.choices and p.choices[0].finish_reason), p.model_extra["kv_transfer_params"][PARAMS_KEY])
                for p in parts if (p.model_extra or {}).get("kv_transfer_params")]
    assert len(reported) == 1 and reported[0][0]  # once, in the chunk with the finish reason
    reported = [r for _, r in reported]
    assert reported[0]["claim"] == "blend" and reported[0]["claimed_tokens"] == rep["claimed_tokens"]
    # the whole request stored its preamble and documents' chunks under its own tenant; the stream's tenant
    # shares none of them (kvblend's keys take the tenant part of the salt), so it computes every one afresh,
    # and the same canonical KV gives the same answer
    classes = reported[0]["classes"]  # [preamble | documents | question (vLLM computes it)]
    assert len(classes) == len(rep["classes"]) and set(classes[:-1]) == {"computed"}


def test_a_malformed_kvblend_chat_is_a_400_and_a_plain_chat_is_vllms_own(server):
    client, model = server
    question, docs = _item(9)
    with pytest.raises(openai.BadRequestError, match="last message must be the user's question"):
        client.chat.completions.create(
            model=model, max_tokens=4, messages=[{"role": "user", "content": question},
                                                 {"role": "assistant", "content": "b"}],
            extra_body={"documents": docs, "kv_transfer_params": {PARAMS_KEY: {"mode": "blend"}}})
    plain = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                           max_tokens=4, temperature=0)
    assert plain.object == "chat.completion" and not (plain.model_extra.get("kv_transfer_params") or {}).get(
        PARAMS_KEY, {}).get("claim") == "blend"


def test_a_kvblend_chat_with_a_wrong_key_gets_vllms_401(server):
    client, model = server
    question, docs = _item(0)
    wrong = client.with_options(api_key="not-the-key")
    with pytest.raises(openai.AuthenticationError):
        _chat(wrong, model, question, docs)
