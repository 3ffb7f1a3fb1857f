"""Shared helpers for the server tests: an in-process server on a free loopback port."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import pytest
import torch
import uvicorn

from _store_util import free_port
from blend.engine import Engine
from blend.serve.app import create_app
from blend.serve.config import SchedulerConfig, ServeConfig
from blend.serve.connection import uvicorn_options
from blend.serve.flight import FlightStore
from blend.serve.jobs import EventKind
from blend.serve.scheduler import Scheduler
from blend.serve.shutdown import DrainingServer
from blend.store.memory import MemoryStore

TINY = "tiny-llama"


def tiny_serve_engine(model: str = TINY, store=None, **kw) -> Engine:
    """A tiny engine whose store is wrapped for single-flight, as ``kvblend serve`` builds it."""
    kw.setdefault("quality_gate", False)
    return Engine.load(model, store=FlightStore(store if store is not None else MemoryStore()), **kw)


@dataclass
class Running:
    url: str  # http://127.0.0.1:PORT
    app: object
    server: uvicorn.Server

    @property
    def scheduler(self):
        return self.app.state.scheduler


@contextmanager
def running_server(engine: Engine, config: ServeConfig | None = None) -> Iterator[Running]:
    """Serve ``engine`` with uvicorn in a thread; stop it on exit."""
    config = config or ServeConfig(model=TINY)
    app = create_app(engine, config)
    port = free_port()
    options = {**uvicorn_options(config, app.state.metrics), "host": "127.0.0.1", "port": port,
               "timeout_graceful_shutdown": 2}
    server = DrainingServer(uvicorn.Config(app, log_level="warning", **options), app.state.scheduler)
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("test server did not start")
        time.sleep(0.01)
    try:
        yield Running(f"http://127.0.0.1:{port}", app, server)
    finally:
        server.should_exit = True
        thread.join(15)


@pytest.fixture(scope="module", autouse=False)
def one_torch_thread():
    """Run a module with one intra-op thread (restored after): the server's threads and the
    reference run with the same count (prefill numbers depend on it), and a loaded machine
    does not make OpenMP threads spin."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---- the scheduler's tests (test_serve_scheduler, test_serve_refine) ----

def wait_until(cond, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


class Collector:
    """Events of several requests, by request index."""

    def __init__(self) -> None:
        self.events: dict[int, list] = {}
        self.lock = threading.Lock()
        self.done = threading.Condition(self.lock)

    def sink(self, i: int):
        def put(ev) -> None:
            with self.lock:
                self.events.setdefault(i, []).append((time.monotonic(), ev))
                self.done.notify_all()
        return put

    def wait(self, n: int, timeout: float = 60) -> None:
        with self.lock:
            assert self.done.wait_for(lambda: sum(
                1 for evs in self.events.values() if evs[-1][1].kind in (EventKind.DONE, EventKind.FAILED)) >= n,
                timeout)

    def last(self, i: int):
        return self.events[i][-1][1]


@pytest.fixture
def make_scheduler():
    made = []

    def make(engine, **cfg) -> Scheduler:
        s = Scheduler(engine, SchedulerConfig(**cfg))
        s.start()
        made.append(s)
        return s

    threads = torch.get_num_threads()
    yield make
    for s in made:
        s.close()
    torch.set_num_threads(threads)  # a scheduler thread's setting also becomes torch's default for new threads
