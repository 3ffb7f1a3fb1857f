"""Shared helpers for the store tests: provenances, random entries, a redis-server."""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from blend.keys import Namespace, Provenance, StoreKey, canonical_key
from blend.store.base import KVEntry

REPO = Path(__file__).resolve().parents[1]
NS = Namespace.CANONICAL


def make_prov(kv_dtype: str = "float32", **kw: str) -> Provenance:
    return Provenance(
        model_arch="llama:test", weights_sha256="w" * 8, tokenizer_sha256="t" * 8, dtype="float32",
        kv_dtype=kv_dtype, device_class="cpu", backend="torch", rope='{"theta":1e5}', **kw,
    )


def rand_entry(prov: Provenance, T: int = 7, seed: int = 0, L: int = 2, H: int = 3, D: int = 8) -> KVEntry:
    g = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, prov.kv_dtype)
    k = torch.randn(L, H, T, D, generator=g).to(dtype)  # (L, Hkv, T, D)
    v = torch.randn(L, H, T, D, generator=g).to(dtype)  # (L, Hkv, T, D)
    return KVEntry(k, v, prov.canonical_json())


def key_for(prov: Provenance, i: int) -> StoreKey:
    return canonical_key(prov, [1, 2, 3], [100 + i, 7])


def other_prov(prov: Provenance) -> Provenance:
    return dataclasses.replace(prov, weights_sha256="x" * 8)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RedisServer:
    """A redis-server process this test run owns."""

    port: int
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not come up on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def own_redis_server() -> RedisServer:
    """Start a private redis-server on a free loopback port, or skip."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server binary not found (apt-get install redis-server)")
    server = RedisServer(free_port())
    server.start()
    return server


def redis_url_for_tests() -> tuple[str, RedisServer | None]:
    """$KVBLEND_TEST_REDIS if set, else a private server; skips if neither is possible."""
    url = os.environ.get("KVBLEND_TEST_REDIS")
    if url:
        return url, None
    server = own_redis_server()
    return server.url, server


def unique_prefix() -> str:
    """Keys of one test never meet another test's keys on a shared server."""
    return f"kvtest-{uuid.uuid4().hex[:12]}"


def run_python(code: str, *args: str) -> subprocess.Popen:
    """Start ``python -c code args...`` with the repository (and these helpers) importable."""
    path = os.pathsep.join([str(REPO), str(REPO / "tests")])
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", code, *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
