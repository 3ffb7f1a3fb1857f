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
from blend.serve.config import ServeConfig
from blend.serve.flight import FlightStore
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
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=2))
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
