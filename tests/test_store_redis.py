"""Redis tier against a real redis-server: round trip, TTL and prefixes, corruption,
outages (down, dying mid-request, hung) and recovery, promotion to memory."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import tracemalloc
from typing import Iterator

import pytest
import redis
import torch

from blend.keys import Namespace, StoreKey
from blend.store.base import LookupStatus
from blend.store.codec import encode
from blend.store.memory import MemoryStore
import blend.store.redis_logs as redis_logs
from blend.store.redis_store import RedisStore
from blend.store.tiered import TieredStore
from _store_util import NS, RedisServer, key_for, make_prov, other_prov, own_redis_server, rand_entry
from _store_util import redis_url_for_tests, unique_prefix

PROV = make_prov()
J = PROV.canonical_json()


@pytest.fixture
def store(redis_url: str) -> Iterator[RedisStore]:
    s = RedisStore(redis_url, prefix=unique_prefix())
    yield s
    s.clear()
    s.close()


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("blend.store")]


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
def test_roundtrip(store: RedisStore, kv_dtype: str) -> None:
    prov = make_prov(kv_dtype)
    entry = rand_entry(prov, T=9)
    store.put(NS, key_for(prov, 0), entry)
    got = store.get(NS, key_for(prov, 0), prov.canonical_json())
    assert got.status is LookupStatus.HIT and got.tier == "redis" and got.entry is not None
    assert torch.equal(got.entry.k, entry.k) and torch.equal(got.entry.v, entry.v)
    assert store.contains(NS, key_for(prov, 0)) and list(store.keys(NS)) == [key_for(prov, 0)]
    info = store.info(NS, key_for(prov, 0))
    assert info is not None and info.shape == (2, 3, 9, 8) and info.dtype == kv_dtype
    assert store.delete(NS, key_for(prov, 0)) and not store.contains(NS, key_for(prov, 0))


def test_stats_skip_a_key_of_another_type_not_the_namespace(redis_url: str) -> None:
    store = RedisStore(redis_url, prefix=unique_prefix())
    for i in range(3):
        store.put(Namespace.APPROX, key_for(PROV, i), rand_entry(PROV))
    redis.Redis.from_url(redis_url).rpush(store.rkey(Namespace.APPROX, key_for(PROV, 9)), b"x")  # a list, not a blob
    st = store.stats()
    assert st.entries == 3 and st.bytes > 0
    store.clear()
    with pytest.raises(ValueError, match="at least 1 second"):
        RedisStore(redis_url, ttl_s=0)


def test_prefix_per_namespace_and_ttl(redis_url: str) -> None:
    prefix = unique_prefix()
    store = RedisStore(redis_url, prefix=prefix, ttl_s=300)
    key = key_for(PROV, 0)
    store.put(Namespace.APPROX, key, rand_entry(PROV))
    raw = redis.Redis.from_url(redis_url)
    assert raw.exists(f"{prefix}:approx:{key.hex()}".encode())
    assert 0 < raw.ttl(store.rkey(Namespace.APPROX, key)) <= 300
    assert store.get(Namespace.EXACT, key, J).status is LookupStatus.MISS
    assert list(store.keys(Namespace.EXACT)) == [] and list(store.keys(Namespace.APPROX)) == [key]
    other = RedisStore(redis_url, prefix=unique_prefix())  # another deployment on the same server
    assert other.get(Namespace.APPROX, key, J).status is LookupStatus.MISS
    assert store.clear() == 1


def _flip(b: bytes) -> bytes:
    out = bytearray(b)
    out[-5] ^= 0x01
    return bytes(out)


@pytest.mark.parametrize(
    "tamper,reason",
    [
        (lambda b: b[: len(b) // 2], "truncated"),
        (_flip, "checksum"),
        (lambda b: b"garbage", "truncated"),
    ],
)
def test_corrupt_blob_is_rejected_and_verify_finds_it(
    store: RedisStore, tamper, reason: str, caplog: pytest.LogCaptureFixture  # type: ignore[no-untyped-def]
) -> None:
    key = key_for(PROV, 0)
    store.put_raw(NS, key, tamper(encode(NS, key, rand_entry(PROV))))
    with caplog.at_level(logging.WARNING, logger="blend.store"):
        got = store.get(NS, key, J)
    assert got.status is LookupStatus.REJECTED and got.reason.startswith(reason)
    assert any("rejected" in w for w in _warnings(caplog))
    assert store.verify(NS, key).invalid and store.verify(NS, key).reason.startswith(reason)


def test_collision_is_rejected(store: RedisStore) -> None:
    store.put(NS, key_for(PROV, 0), rand_entry(other_prov(PROV)))
    got = store.get(NS, key_for(PROV, 0), J)
    assert got.status is LookupStatus.REJECTED and got.reason == "provenance mismatch"


def test_redis_hit_is_promoted_to_memory(store: RedisStore) -> None:
    store.put(NS, key_for(PROV, 0), rand_entry(PROV))
    chain = TieredStore([MemoryStore(), store])
    assert chain.get(NS, key_for(PROV, 0), J).tier == "redis"
    assert chain.get(NS, key_for(PROV, 0), J).tier == "memory"


def test_down_then_up(caplog: pytest.LogCaptureFixture) -> None:
    server = own_redis_server()  # this test kills its server, so it never uses a shared one
    try:
        store = RedisStore(server.url, retry_after_s=0.3)
        chain = TieredStore([MemoryStore(), store])
        store.put(NS, key_for(PROV, 0), rand_entry(PROV))
        assert store.get(NS, key_for(PROV, 0), J).status is LookupStatus.HIT
        server.stop()
        with caplog.at_level(logging.WARNING, logger="blend.store"):
            t0 = time.perf_counter()
            for i in range(20):
                assert store.get(NS, key_for(PROV, i), J).status is LookupStatus.MISS
                store.put(NS, key_for(PROV, i), rand_entry(PROV))  # no exception
                assert chain.get(NS, key_for(PROV, 99), J).status is LookupStatus.MISS
            elapsed = time.perf_counter() - t0
        assert elapsed < 1.0, elapsed  # a dead server costs milliseconds
        outage = [w for w in _warnings(caplog) if "unreachable" in w]
        assert len(outage) == 1, _warnings(caplog)  # warned once per outage
        assert store.stats().extra["available"] == 0.0

        server.start()  # same port; a fresh, empty server
        time.sleep(0.35)  # past the back-off
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="blend.store"):
            store.put(NS, key_for(PROV, 1), rand_entry(PROV, seed=1))
        assert any("reachable again" in w for w in _warnings(caplog))
        got = store.get(NS, key_for(PROV, 1), J)
        assert got.status is LookupStatus.HIT and got.entry is not None
        assert torch.equal(got.entry.k, rand_entry(PROV, seed=1).k)
    finally:
        server.stop()


class _FakeServer:
    """A TCP server that plays Redis until a GET, then dies mid-reply (or never answers)."""

    def __init__(self, hang: bool) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port = self.sock.getsockname()[1]
        self.hang = hang
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                while data := conn.recv(65536):
                    if b"GET" in data:
                        if self.hang:
                            time.sleep(2.0)
                        else:
                            conn.sendall(b"$100000\r\n" + b"x" * 1000)  # a reply cut short
                        break
                    if b"HELLO" in data:  # the RESP3 handshake redis-py opens with
                        conn.sendall(b"%1\r\n$5\r\nproto\r\n:3\r\n")
                        continue
                    n = data.count(b"\r\n*") + data.startswith(b"*")
                    conn.sendall(b"+OK\r\n" * max(n, 1))

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("hang", [False, True], ids=["dies-mid-reply", "hangs"])
def test_server_failing_mid_request_is_a_miss(hang: bool, caplog: pytest.LogCaptureFixture) -> None:
    fake = _FakeServer(hang)
    try:
        store = RedisStore(f"redis://127.0.0.1:{fake.port}/0", socket_timeout_s=0.2, retry_after_s=30)
        with caplog.at_level(logging.WARNING, logger="blend.store"):
            t0 = time.perf_counter()
            got = store.get(NS, key_for(PROV, 0), J)
            first = time.perf_counter() - t0
            t0 = time.perf_counter()
            again = store.get(NS, key_for(PROV, 0), J)  # inside the back-off: no network at all
            second = time.perf_counter() - t0
        assert got.status is LookupStatus.MISS and again.status is LookupStatus.MISS
        assert first < 1.0 and second < 0.01, (first, second)
        assert len([w for w in _warnings(caplog) if "unreachable" in w]) == 1
    finally:
        fake.close()


def test_record_log_appends_reads_and_clears_with_everything(store: RedisStore) -> None:
    assert store.read_records("donors-x") == []
    store.append_record("donors-x", b'{"a":1}')
    store.append_record("donors-x", b'{"b":2}')
    assert store.read_records("donors-x") == [b'{"a":1}', b'{"b":2}']
    store.clear(NS)  # one namespace: logs stay
    assert len(store.read_records("donors-x")) == 2
    store.clear()
    assert store.read_records("donors-x") == []


def test_record_log_during_an_outage_is_empty_not_an_error() -> None:
    down = RedisStore("redis://127.0.0.1:1/0", prefix=unique_prefix(), connect_timeout_s=0.05)
    down.append_record("donors-x", b"{}")
    assert down.read_records("donors-x") == []


def test_record_log_rewrite_is_compare_and_swap(store: RedisStore) -> None:
    for i in range(3):
        store.append_record("donors-x", b'{"n":%d}' % i)
    lines = store.read_records("donors-x")
    assert store.rewrite_records("donors-x", lines[:2], [b"a"]) is False
    assert store.read_records("donors-x") == lines
    assert store.rewrite_records("donors-x", lines, [b"a", b"b"]) is True
    assert store.read_records("donors-x") == [b"a", b"b"]
    assert store.rewrite_records("donors-x", [b"a", b"b"], []) is True
    assert store.read_records("donors-x") == []


def test_record_log_reads_in_pages_and_trims_an_oversized_list_to_its_newest_records(
        store: RedisStore, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A list over MAX_LOG_BYTES was never read (nor compacted) again: every process loaded no donor, for
    good. Its newest records within OVERSIZED_KEEP_BYTES are kept (the list trimmed to them) and read."""
    monkeypatch.setattr(redis_logs, "LOG_PAGE", 3)
    lines = [f"record {i}".encode() for i in range(10)]
    for ln in lines:
        store.append_record("donors", ln)
    assert store.read_records("donors") == lines  # four pages, in order
    monkeypatch.setattr(redis_logs, "MAX_LOG_BYTES", 40)  # the ten records hold 80 bytes
    monkeypatch.setattr(redis_logs, "OVERSIZED_KEEP_BYTES", 20)  # two and a half records
    monkeypatch.setattr(redis_logs, "LOG_OVERHEAD_BYTES", 1 << 30)  # let the paged count decide
    with caplog.at_level(logging.WARNING, logger="blend.store.redis_store"):
        assert store.read_records("donors") == lines[-2:]
    assert "older records were dropped" in caplog.text
    monkeypatch.setattr(redis_logs, "MAX_LOG_BYTES", 10)
    monkeypatch.setattr(redis_logs, "OVERSIZED_KEEP_BYTES", 8)  # one record
    monkeypatch.setattr(redis_logs, "LOG_OVERHEAD_BYTES", 0)  # now the server's size figure says it is too big
    assert store.read_records("donors") == lines[-1:]
    monkeypatch.setattr(redis_logs, "MAX_LOG_BYTES", 1 << 20)
    assert store.read_records("donors") == lines[-1:]  # the list itself was trimmed
    assert store.available  # an oversized log is not an outage


def test_the_deadline_watchdog_fires_late_alarms_only_and_survives_a_fork() -> None:
    from blend.store.redis_deadline import Watchdog

    dog, fired = Watchdog(), []
    early = dog.arm(0.05, lambda: fired.append("early"))
    kept = dog.arm(0.3, lambda: fired.append("disarmed"))
    assert dog.disarm(kept) is False
    time.sleep(0.15)
    assert dog.disarm(early) is True and fired == ["early"]
    time.sleep(0.25)
    assert fired == ["early"]  # a disarmed alarm never fires
    pid = os.fork()
    if pid == 0:  # the child's watchdog starts a thread of its own (the parent's is not there)
        got: list[int] = []
        dog.arm(0.02, lambda: got.append(1))
        time.sleep(0.3)
        os._exit(0 if got else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0


def _peak(fn):
    """(fn(), the most bytes Python held at once while it ran)."""
    tracemalloc.start()
    try:
        return fn(), tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


READ_BUFFER = 1 << 20  # the client's socket read size: every call may hold this much


def test_trimming_an_oversized_log_never_reads_the_records_it_drops(
        store: RedisStore, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A log of a few huge records (a hostile peer's, or a broken writer's) was read whole, page by page, to
    find that none of them fit: 17 MB read under a 1 MB cap. The server now measures them; only the kept
    record is read."""
    raw = redis.Redis.from_url(redis_url)
    rk = f"{store.prefix}:log:donors-x".encode()
    raw.rpush(rk, b"x" * (8 << 20), b"y" * (8 << 20), b'{"newest":1}')
    monkeypatch.setattr(redis_logs, "MAX_LOG_BYTES", 1 << 20)
    monkeypatch.setattr(redis_logs, "OVERSIZED_KEEP_BYTES", 256 << 10)
    got, peak = _peak(lambda: store.read_records("donors-x"))
    assert got == [b'{"newest":1}'] and peak < 2 * READ_BUFFER, peak
    assert raw.lrange(rk, 0, -1) == [b'{"newest":1}']  # the list trimmed to it
    raw.close()


def test_an_oversized_log_on_a_server_without_scripts_is_deleted_unread(
        store: RedisStore, redis_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    raw = redis.Redis.from_url(redis_url)
    rk = f"{store.prefix}:log:donors-x".encode()
    raw.rpush(rk, b"x" * (8 << 20), b'{"newest":1}')
    monkeypatch.setattr(redis_logs, "MAX_LOG_BYTES", 1 << 20)
    monkeypatch.setattr(redis_logs, "_LENGTHS", "this is not lua")  # EVAL fails as where scripting is off
    with caplog.at_level(logging.WARNING, logger="blend.store"):
        got, peak = _peak(lambda: store.read_records("donors-x"))
    assert got == [] and peak < 2 * READ_BUFFER, peak
    assert not raw.exists(rk) and "cannot measure the records" in caplog.text
    raw.close()


def test_a_log_rewrite_reads_no_more_than_the_records_it_expects(store: RedisStore, redis_url: str) -> None:
    """The compare-and-swap read the whole list to compare it: another writer's huge record (pushed since the
    log was read, or a hostile peer's) was read whole. Now its length, the server's size figure and the
    pages are compared in turn."""
    raw = redis.Redis.from_url(redis_url)
    rk = f"{store.prefix}:log:donors-x".encode()
    small = [b'{"n":%d}' % i for i in range(3)]
    raw.rpush(rk, *small, b"x" * (8 << 20))  # one record more than expected
    ok, peak = _peak(lambda: store.rewrite_records("donors-x", small, [b"new"]))
    assert ok is False and peak < 2 * READ_BUFFER, peak
    raw.delete(rk)
    raw.rpush(rk, *small[:2], b"x" * (8 << 20))  # as many records, one of them huge
    ok, peak = _peak(lambda: store.rewrite_records("donors-x", small, [b"new"]))
    assert ok is False and peak < 2 * READ_BUFFER, peak
    assert raw.llen(rk) == 3
    raw.delete(rk)
    raw.rpush(rk, *small)
    assert store.rewrite_records("donors-x", small, [b"new"]) is True
    assert raw.lrange(rk, 0, -1) == [b"new"]
    raw.close()


def test_a_put_the_server_refuses_is_counted_not_raised(caplog) -> None:
    """A server at its memory limit (noeviction, Redis's default policy) answers SET with an error:
    the write is lost like a disk write that failed, and counted as one (``put_errors``). It is logged
    once per cause (every later refused put logged a line of its own: one per chunk)."""
    server = own_redis_server()
    try:
        admin = redis.Redis.from_url(server.url)
        admin.config_set("maxmemory", int(admin.info("memory")["used_memory"]) + (1 << 20))  # 1 MB free
        admin.config_set("maxmemory-policy", "noeviction")
        store = RedisStore(server.url, prefix=unique_prefix())
        store.put(NS, key_for(PROV, 0), rand_entry(PROV, T=200))  # 77 KB: fits
        with caplog.at_level(logging.WARNING, logger="blend.store"):
            for i in range(1, 6):
                store.put(NS, key_for(PROV, i), rand_entry(PROV, T=20000))  # 7.7 MB: refused
        stats = store.stats()
        assert stats.puts == 1 and stats.extra.get("put_errors") == 5 and stats.extra.get("refused_calls") == 5
        assert len([w for w in _warnings(caplog) if "put failed" in w]) == 1
        assert store.get(NS, key_for(PROV, 1), J).status is LookupStatus.MISS
        store.close()
        admin.close()
    finally:
        server.stop()


def test_a_redis_password_never_reaches_logs_or_messages(caplog) -> None:
    from blend.store.redis_link import redacted_url
    from blend.store.spec import StoreSpecError, parse_store_spec, redacted_spec

    assert redacted_url("redis://alice:S3cretPass@h:6379/0") == "redis://alice:***@h:6379/0"
    assert redacted_url("rediss://u:p@[::1]:7/0") == "rediss://u:***@[::1]:7/0"
    assert redacted_url("redis://h:6379/0") == "redis://h:6379/0"
    assert redacted_url("redis://127.0.0.1:1/0?password=hunter2&x=1") == "redis://127.0.0.1:1/0?password=***&x=1"
    assert redacted_url("unix:///tmp/r.sock?password=s3") == "unix:///tmp/r.sock?password=***"  # spelled as given

    assert redacted_spec("memory,redis://:pw@h/0,disk:/x") == "memory,redis://:***@h/0,disk:/x"
    with pytest.raises(StoreSpecError) as err:
        parse_store_spec("redis://:hunter2@127.0.0.1:6379/zero")
    assert "hunter2" not in str(err.value)
    store = RedisStore("redis://alice:S3cretPass@127.0.0.1:1/0", connect_timeout_s=0.05)
    with caplog.at_level("WARNING"):
        store.contains(Namespace.CANONICAL, StoreKey(b"\0" * 32))
        why = store.check_reachable()
    assert why and "S3cretPass" not in why and "S3cretPass" not in caplog.text and "***" in why
