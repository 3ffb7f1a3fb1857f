"""Two `kvblend serve` processes over one Redis share chunk KV; Redis gone degrades to computing."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest

from _serve_util import TINY, one_torch_thread, running_server, tiny_serve_engine  # noqa: F401
from _store_util import REPO, free_port, own_redis_server, redis_url_for_tests, unique_prefix
from blend.serve.config import ServeConfig
from blend.store.spec import open_store
from conftest import make_docs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DOCS = make_docs(3, words=25, seed=21)


def start_replica(store: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "blend.cli", "serve", "--model", TINY, "--store", store,
                             "--port", str(port), "--log-level", "warning", "--torch-threads", "1"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return proc, f"http://127.0.0.1:{port}"


def wait_up(proc: subprocess.Popen, url: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"replica exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError("replica did not come up")


def ask(url: str, question: str, **kw) -> dict:
    r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": TINY, "messages": [{"role": "user", "content": question}], "documents": DOCS, "max_tokens": 4,
        "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def test_two_replicas_share_chunk_kv_through_redis():
    url, server = redis_url_for_tests()
    store = f"{url}?prefix={unique_prefix()}"
    replicas = [start_replica(store) for _ in range(2)]
    try:
        for proc, base in replicas:
            wait_up(proc, base)
        (_, a), (_, b) = replicas
        on_a = ask(a, "which river?")
        assert on_a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # A computes and stores
        on_b = ask(b, "which river?")  # B has never seen these documents
        segs = on_b["kvblend"]["report"]["segments"]
        assert [s["class"] for s in segs] == ["exact"] * 4 + ["computed"]
        assert on_b["usage"]["prompt_tokens_details"]["cached_tokens"] == sum(s["tokens"] for s in segs[:4])
        assert on_b["kvblend"]["logits_sha256"] == on_a["kvblend"]["logits_sha256"]  # cold == warm across replicas
        assert on_b["kvblend"]["answer_token_ids"] == on_a["kvblend"]["answer_token_ids"]
    finally:
        for proc, _ in replicas:
            proc.terminate()
        for proc, _ in replicas:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
        if server is not None:
            server.stop()


def test_redis_gone_degrades_to_computing_never_500(one_torch_thread):
    server = own_redis_server()  # our own server: this test kills it
    try:
        engine = tiny_serve_engine(store=open_store(f"{server.url}?prefix={unique_prefix()}"))
        with running_server(engine, ServeConfig(model=TINY)) as srv:
            first = ask(srv.url, "which stone?")
            server.stop()
            again = ask(srv.url, "which stone?")  # the in-process tier still has it
            assert again["kvblend"]["logits_sha256"] == first["kvblend"]["logits_sha256"]
            fresh = ask(srv.url, "which stone?", documents=make_docs(2, seed=99))  # Redis down: computed
            assert [s["class"] for s in fresh["kvblend"]["report"]["segments"]][1:] == ["computed"] * 3
            blend = ask(srv.url, "which stone?", documents=make_docs(2, seed=98),
                        kvblend={"reuse": "blend", "ratio": 0.2})
            assert blend["choices"][0]["finish_reason"] in ("stop", "length")
            assert httpx.get(srv.url + "/health").json()["status"] == "ok"
    finally:
        server.stop()
