"""Several processes on one store: a writer SIGKILLed mid-put, two writers of one key."""

from __future__ import annotations

import random
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch

from blend.store.base import InspectableStore, LookupStatus
from blend.store.disk import DiskStore
from blend.store.redis_store import RedisStore
from _store_util import NS, RedisServer, key_for, make_prov, redis_url_for_tests, run_python, unique_prefix

PROV = make_prov()
SHAPE = (30, 3, 600, 64)  # one SmolLM2 chunk: 13.8 MB per tensor in fp32

# argv: store kind ("disk"/"redis"), location, prefix, mode, writer id, puts (0: forever)
WRITER = r"""
import os, sys, time, torch
from blend.store.base import KVEntry
from blend.store import disk as disk_mod
from blend.store.disk import DiskStore
from blend.store.redis_store import RedisStore
from _store_util import NS, key_for, make_prov

kind, where, prefix, mode, wid, n = sys.argv[1:7]
prov, shape = make_prov(), (30, 3, 600, 64)
store = DiskStore(where) if kind == "disk" else RedisStore(where, prefix=prefix, socket_timeout_s=10)

def stall():
    print("stalled", flush=True)
    time.sleep(600)

if mode == "stall-rename":  # killed after the data is written, before the rename
    disk_mod.os.fsync = lambda fd: stall()
if mode == "stall-data":  # killed with half the tensor bytes written
    real = disk_mod.encode_parts
    class Stalling(list):
        def __iter__(self):
            for i, part in enumerate(list.__iter__(self)):
                if i == 2:
                    stall()
                yield part
    disk_mod.encode_parts = lambda *a: Stalling(real(*a))

print("ready", flush=True)
i = 0
while int(n) == 0 or i < int(n):
    i += 1
    fill = float(int(wid) * 100000 + i)
    k = torch.full(shape, fill)
    store.put(NS, key_for(prov, 0), KVEntry(k, k.clone(), prov.canonical_json()))
"""


def _assert_absent_or_valid(store: InspectableStore) -> LookupStatus:
    got = store.get(NS, key_for(PROV, 0), PROV.canonical_json())
    assert got.status in (LookupStatus.MISS, LookupStatus.HIT), got.reason
    if got.entry is not None:
        k, v = got.entry.k, got.entry.v
        assert tuple(k.shape) == SHAPE
        assert torch.equal(k, torch.full_like(k, k.flatten()[0].item()))  # one write, not a mix
        assert torch.equal(k, v)
    return got.status


def _start(kind: str, where: str, mode: str, wid: int = 1, n: int = 0, prefix: str = "kvblend") -> subprocess.Popen:
    proc = run_python(WRITER, kind, where, prefix, mode, str(wid), str(n))
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == b"ready", proc.stderr.read() if proc.stderr else line  # type: ignore[union-attr]
    return proc


def _kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.parametrize("mode", ["stall-data", "stall-rename"])
def test_sigkill_at_a_known_point_leaves_no_valid_looking_entry(tmp_path: Path, mode: str) -> None:
    proc = _start("disk", str(tmp_path), mode)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"stalled"
    _kill(proc)
    store = DiskStore(tmp_path)
    assert len(store.temp_files()) == 1  # the interrupted write is there ...
    assert _assert_absent_or_valid(store) is LookupStatus.MISS  # ... and never read
    assert list(store.keys(NS)) == []


def test_sigkill_at_random_points_disk(tmp_path: Path) -> None:
    rng = random.Random(0)
    statuses = []
    for _ in range(4):
        proc = _start("disk", str(tmp_path), "loop")
        time.sleep(rng.uniform(0.05, 0.6))
        _kill(proc)
        statuses.append(_assert_absent_or_valid(DiskStore(tmp_path)))
    assert LookupStatus.HIT in statuses  # the writer did complete puts between kills


def test_two_disk_writers_of_one_key_leave_one_valid_entry(tmp_path: Path) -> None:
    procs = [run_python(WRITER, "disk", str(tmp_path), "-", "loop", str(w), "6") for w in (1, 2)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()
    store = DiskStore(tmp_path)
    assert _assert_absent_or_valid(store) is LookupStatus.HIT
    assert list(store.keys(NS)) == [key_for(PROV, 0)] and store.temp_files() == []


def test_redis_sigkill_and_concurrent_writers(redis_url: str) -> None:
    prefix = unique_prefix()
    store = RedisStore(redis_url, prefix=prefix)
    rng = random.Random(1)
    for _ in range(3):
        proc = _start("redis", redis_url, "loop", prefix=prefix)
        time.sleep(rng.uniform(0.05, 0.5))
        _kill(proc)
        _assert_absent_or_valid(store)
    procs = [run_python(WRITER, "redis", redis_url, prefix, "loop", str(w), "6") for w in (1, 2)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()
    assert _assert_absent_or_valid(store) is LookupStatus.HIT
    assert list(store.keys(NS)) == [key_for(PROV, 0)]
    assert store.clear() == 1


# argv: disk folder. A kvblend command (`check`, stood in for) queues slow write-behind puts, then waits.
QUEUED_WRITES = r"""
import sys, time
import blend.cli
from blend.store import disk as disk_mod
from blend.store.spec import open_store
from _store_util import NS, key_for, make_prov, rand_entry

real_put = disk_mod.DiskStore.put
def slow_put(self, *a, **kw):
    time.sleep(0.05)
    return real_put(self, *a, **kw)
disk_mod.DiskStore.put = slow_put

def queue_and_wait(args):
    store = open_store("disk:" + sys.argv[1])
    for i in range(10):
        store.put(NS, key_for(make_prov(), i), rand_entry(make_prov(), seed=i))
    print("queued", flush=True)
    time.sleep(60)

blend.cli.run_check = queue_and_wait
sys.exit(blend.cli.main(["check"]))
"""


def test_sigterm_flushes_a_commands_queued_store_writes(tmp_path: Path) -> None:
    """SIGTERM (`docker stop`, a supervisor) ended a kvblend command at once: no atexit hook ran, so the
    write-behind queue's pending puts were lost without a word. It now unwinds as Ctrl-C does."""
    proc = run_python(QUEUED_WRITES, str(tmp_path))
    assert proc.stdout.readline().strip() == b"queued"
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=60)
    assert rc == 128 + signal.SIGTERM and b"kvblend: terminated" in proc.stderr.read()
    store = DiskStore(tmp_path)
    assert sorted(store.keys(NS)) == sorted(key_for(PROV, i) for i in range(10))
