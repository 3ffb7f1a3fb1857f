"""A bounded load test on loopback: N concurrent clients send a fixed number of requests, every one
is answered, and memory after 1,000 requests is within 10% of memory after 100."""

from __future__ import annotations

import gc
import os
import threading

import httpx
import pytest

from _serve_util import TINY, one_torch_thread, running_server, tiny_serve_engine  # noqa: F401
from blend.serve.config import SchedulerConfig, ServeConfig
from conftest import make_docs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CLIENTS = 8
WARMUP, TOTAL = 100, 1000


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def body(i: int) -> dict:
    docs = make_docs(2, words=12, seed=i % 5)  # a fixed corpus: the store stops growing
    return {"model": TINY, "messages": [{"role": "user", "content": f"question {i % 17}?"}], "documents": docs,
            "max_tokens": 2, "ignore_eos": True, "temperature": 0.0 if i % 2 else 0.8, "seed": i, "stream": i % 3 == 0,
            "kvblend": {"reuse": "blend", "ratio": 0.2} if i % 4 == 0 else {"reuse": "exact"}}


def run_load(url: str, start: int, stop: int) -> dict[int, str]:
    """Requests start..stop-1 from CLIENTS threads; returns request index -> answer check."""
    results: dict[int, str] = {}
    lock = threading.Lock()
    todo = iter(range(start, stop))

    def client() -> None:
        with httpx.Client(base_url=url, timeout=60) as http:
            while True:
                with lock:
                    i = next(todo, None)
                if i is None:
                    return
                b = body(i)
                r = http.post("/v1/chat/completions", json=b)
                if r.status_code != 200:
                    outcome = f"status {r.status_code}"
                elif b["stream"]:
                    lines = [ln for ln in r.text.splitlines() if ln.startswith("data: ")]
                    outcome = "ok" if lines[-1] == "data: [DONE]" and '"finish_reason":"length"' in r.text else r.text
                else:
                    outcome = "ok" if r.json()["usage"]["completion_tokens"] == 2 else r.text
                with lock:
                    results[i] = outcome

    threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return results


def test_no_request_lost_and_memory_is_flat(one_torch_thread):
    engine = tiny_serve_engine()
    config = ServeConfig(model=TINY, scheduler=SchedulerConfig(max_concurrency=CLIENTS, max_queue=4 * CLIENTS))
    with running_server(engine, config) as srv:
        first = run_load(srv.url, 0, WARMUP)
        gc.collect()
        after_100 = rss_bytes()
        rest = run_load(srv.url, WARMUP, TOTAL)
        gc.collect()
        after_1000 = rss_bytes()
        print(f"RSS {after_100 / 2**20:.1f} MiB after {WARMUP}, {after_1000 / 2**20:.1f} MiB after {TOTAL}")
        sched = srv.scheduler
        assert sched.active == 0 and sched.queue_depth == 0
        assert engine.store.claimed() == 0
    results = {**first, **rest}
    assert sorted(results) == list(range(TOTAL))  # every request answered once
    bad = {i: o for i, o in results.items() if o != "ok"}
    assert not bad, list(bad.items())[:3]
    assert sched.completed == TOTAL and sched.failed == 0
    assert sched.steps < TOTAL * 3  # decode steps were batched across clients
    growth = (after_1000 - after_100) / after_100
    assert growth < 0.10, f"RSS {after_100 / 2**20:.0f} MiB after {WARMUP} -> {after_1000 / 2**20:.0f} MiB after {TOTAL}"
