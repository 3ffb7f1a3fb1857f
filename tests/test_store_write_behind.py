"""Write-behind (blend/store/write_behind.py): persistent tiers written off the request's path,
with a barrier (flush) before a request finishes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import pytest

from blend.store.base import LookupStatus, flush_writes
from blend.store.disk import DiskStore
from blend.store.memory import MemoryStore
from blend.store.spec import open_store
from blend.store.tiered import TieredStore
from blend.store.write_behind import BackgroundWriter

from _store_util import NS, REPO, key_for, make_prov, rand_entry


class GatedTier(MemoryStore):
    """A lower tier whose puts wait on a gate (a slow disk or network), or fail on demand."""

    def __init__(self) -> None:
        super().__init__(None)
        self.name = "gated"
        self.gate = threading.Event()
        self.started = threading.Event()
        self.fail = False

    def put(self, ns, key, entry) -> None:
        self.started.set()
        self.gate.wait(10)
        if self.fail:
            raise RuntimeError("tier down")
        super().put(ns, key, entry)


def test_put_returns_before_the_slow_tier_and_flush_waits_for_it():
    prov = make_prov()
    slow = GatedTier()
    store = TieredStore([MemoryStore(None), slow])
    entry = rand_entry(prov)
    t0 = time.perf_counter()
    store.put(NS, key_for(prov, 0), entry)
    assert time.perf_counter() - t0 < 1.0  # the gate is closed: the lower tier has not written
    got = store.get(NS, key_for(prov, 0), prov.canonical_json())
    assert got.status is LookupStatus.HIT  # this process finds it at once (first tier)
    assert slow.started.wait(5) and not slow.contains(NS, key_for(prov, 0))
    assert store.stats().extra["pending_writes"] == 1
    assert store.flush(timeout=0.05) is False  # still pending
    slow.gate.set()
    assert store.flush(timeout=5) is True
    assert slow.contains(NS, key_for(prov, 0)) and store.stats().extra["pending_writes"] == 0


def test_write_through_when_asked():
    prov = make_prov()
    slow = GatedTier()
    slow.gate.set()
    store = TieredStore([MemoryStore(None), slow], write_behind=False)
    store.put(NS, key_for(prov, 1), rand_entry(prov))
    assert store.writer is None and slow.contains(NS, key_for(prov, 1)) and store.flush(0)


def test_a_failed_background_write_is_counted_and_the_writer_goes_on():
    prov = make_prov()
    slow = GatedTier()
    slow.fail = True
    slow.gate.set()
    store = TieredStore([MemoryStore(None), slow])
    store.put(NS, key_for(prov, 2), rand_entry(prov))
    assert store.flush(5)
    assert store.stats().extra["background_write_failures"] == 1
    slow.fail = False
    store.put(NS, key_for(prov, 3), rand_entry(prov, seed=3))
    assert store.flush(5) and slow.contains(NS, key_for(prov, 3))


def test_delete_and_clear_wait_for_pending_writes():
    """A write still queued must not land after a delete (the entry would come back)."""
    prov = make_prov()
    slow = GatedTier()
    store = TieredStore([MemoryStore(None), slow])
    store.put(NS, key_for(prov, 4), rand_entry(prov))
    threading.Timer(0.2, slow.gate.set).start()
    assert store.delete(NS, key_for(prov, 4))
    assert not store.contains(NS, key_for(prov, 4)) and not slow.contains(NS, key_for(prov, 4))
    store.put(NS, key_for(prov, 5), rand_entry(prov))
    store.clear()
    assert not slow.contains(NS, key_for(prov, 5))


def test_the_queue_is_bounded():
    """A producer faster than the slow tier waits for room instead of queueing without limit."""
    writer = BackgroundWriter("bounded", max_pending=2)
    gate = threading.Event()
    done: list[int] = []
    for i in range(3):  # one running, two queued
        writer.submit(lambda i=i: (gate.wait(10), done.append(i)))
    blocked = threading.Thread(target=writer.submit, args=(lambda: done.append(3),))
    blocked.start()
    blocked.join(0.2)
    assert blocked.is_alive()  # waiting for room
    gate.set()
    blocked.join(5)
    assert writer.flush(5) and done == [0, 1, 2, 3]  # in submission order
    writer.close()
    writer.submit(lambda: done.append(4))  # after close: inline
    assert done[-1] == 4
    with pytest.raises(ValueError):
        BackgroundWriter("bad", max_pending=0)


def test_flush_writes_on_any_store():
    assert flush_writes(MemoryStore(None)) is True  # nothing in the background
    store = TieredStore([MemoryStore(None), MemoryStore(None)])
    assert flush_writes(store, 1.0) is True


def test_a_process_that_exits_with_writes_pending_finishes_them(tmp_path):
    """No flush, no close: the entry is on disk after the process ends (atexit)."""
    code = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(REPO / 'tests')!r})
        from _store_util import NS, key_for, make_prov, rand_entry
        from blend.store.spec import open_store
        store = open_store("disk:{tmp_path}")
        prov = make_prov()
        store.put(NS, key_for(prov, 0), rand_entry(prov, T=4000))
        assert store.writer is not None
    """)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=120)
    prov = make_prov()
    got = DiskStore(tmp_path).get(NS, key_for(prov, 0), prov.canonical_json())
    assert got.status is LookupStatus.HIT


def test_open_store_chains_write_behind_by_default(tmp_path):
    chain = open_store(f"disk:{tmp_path}")
    assert isinstance(chain, TieredStore) and chain.writer is not None
    assert open_store(f"disk:{tmp_path}", write_behind=False).writer is None
    assert not hasattr(open_store("memory"), "writer")  # one tier: nothing behind it
    chain.close()


def test_engine_requests_finish_with_their_chunks_in_every_tier(tiny_engine_factory):
    """generate, stream and precompute return only after the lower tier holds what the request
    computed (its writes are held back 0.3 s here): another process or replica then finds them."""
    from blend.generation import stream
    from blend.policy import ReusePolicy

    slow = GatedTier()
    store = TieredStore([MemoryStore(None), slow])
    engine = tiny_engine_factory(store=store)
    for i, run in enumerate([
        lambda p: engine.generate(p, ReusePolicy.exact(), max_new_tokens=2),
        lambda p: list(stream(engine, p, ReusePolicy.exact())),
        lambda p: engine.precompute(p, ReusePolicy.blend(ratio=0.15)),
    ]):
        prompt = engine.build_prompt(f"q{i}?", [f"alpha beta {i}", f"delta epsilon {i}"])
        slow.gate.clear()
        threading.Timer(0.3, slow.gate.set).start()
        run(prompt)
        assert store.stats().extra["pending_writes"] == 0
        if i < 2:
            keys = engine.segments.prefix_keys(prompt.segments[:-1])
            assert keys and all(slow.contains(ns, k) for ns, k in keys)
    assert slow.stats().entries == 3 + 2 + 2  # preamble and two documents, two more documents, two chunks


def test_a_server_response_ends_after_its_writes():
    """kvblend serve: a whole response, and a stream's final chunk, come after the request's
    chunks reached the lower tier (held back 0.3 s here); the event loop is not blocked meanwhile."""
    import httpx

    from _serve_util import TINY, running_server, tiny_serve_engine

    slow = GatedTier()
    engine = tiny_serve_engine(store=TieredStore([MemoryStore(None), slow]))
    with running_server(engine) as srv:
        for i, stream in enumerate((False, True)):
            slow.gate.clear()
            threading.Timer(0.3, slow.gate.set).start()
            body = {"model": TINY, "messages": [{"role": "user", "content": f"q{i}?"}], "max_tokens": 2,
                    "documents": [f"alpha {i}", f"beta {i}"], "stream": stream}
            r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=30)
            assert r.status_code == 200
            assert httpx.get(f"{srv.url}/health", timeout=5).status_code == 200
            assert slow.stats().entries == 3 * (i + 1) - i  # preamble once, then two documents each


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_the_writer_yields_the_cores_to_compute():
    """The writer runs at the lowest CPU priority: a prefill's torch threads fill both cores."""
    import os

    from blend.store.write_behind import WRITER_NICE

    writer = BackgroundWriter("nice", max_pending=4)
    seen: list[int] = []
    writer.submit(lambda: seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
    assert writer.flush(5) and seen == [WRITER_NICE]
    writer.close()


def test_a_failed_write_after_close_is_counted_too():
    """After close (at exit, say) writes run inline: a failure is still logged and counted."""
    writer = BackgroundWriter("closed", max_pending=2)
    writer.submit(lambda: None)
    writer.close()

    def fail() -> None:
        raise RuntimeError("tier down")

    writer.submit(fail)  # inline: never raised
    assert writer.failures == 1 and writer.pending() == 0


def test_two_concurrent_closes_both_return_after_the_pending_writes():
    """The second of two concurrent close() calls returned at once, before the writes the first was
    waiting for had landed (an exit path and a shutdown hook closing together)."""
    prov = make_prov()
    slow = GatedTier()
    store = TieredStore([MemoryStore(None), slow])
    store.put(NS, key_for(prov, 7), rand_entry(prov))  # held at the gate
    returned: list[bool] = []

    def close() -> None:
        store.close()
        returned.append(slow.contains(NS, key_for(prov, 7)))

    threads = [threading.Thread(target=close) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    assert returned == []  # both wait while the write is held
    slow.gate.set()
    for t in threads:
        t.join(5)
    assert returned == [True, True]


def _sigint_after(seconds: float) -> threading.Timer:
    """A Ctrl-C to this process (the main thread's KeyboardInterrupt) in ``seconds``."""
    import os
    import signal

    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    return timer


def test_ctrl_c_while_a_put_waits_for_room_leaves_flush_working():
    """A submit interrupted while the full queue made it wait (Ctrl-C in a notebook or REPL during a prefill
    on a slow disk) counted a write it never queued: every later flush waited for it forever."""
    gate = threading.Event()
    writer = BackgroundWriter("test", max_pending=1)
    writer.submit(lambda: gate.wait(10))  # the writer thread holds this one
    writer.submit(lambda: None)  # the queue's one place
    timer = _sigint_after(0.3)
    try:
        with pytest.raises(KeyboardInterrupt):
            writer.submit(lambda: None)  # waits for room until Ctrl-C
    finally:
        timer.cancel()
    gate.set()
    assert writer.flush(timeout=5) is True and writer.pending() == 0
    writer.close()


def test_ctrl_c_while_the_exit_flush_waits_gives_the_writes_up_with_one_warning(caplog):
    """A second Ctrl-C while a process finished its queued writes at exit printed Python's 'Exception ignored
    in atexit callback' traceback. An entry is whole or absent either way (temp file, then rename)."""
    import logging
    import weakref

    from blend.store.write_behind import _flush_at_exit

    gate = threading.Event()
    writer = BackgroundWriter("test", max_pending=4)
    writer.submit(lambda: gate.wait(10))
    timer = _sigint_after(0.3)
    try:
        with caplog.at_level(logging.WARNING, logger="blend.store.write_behind"):
            _flush_at_exit(weakref.ref(writer))  # returns: no KeyboardInterrupt out of an atexit hook
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt out of the exit flush (Python prints it as a traceback)")
    finally:
        timer.cancel()
        gate.set()
    assert "interrupted at exit: 1 queued store write(s) given up" in caplog.text
