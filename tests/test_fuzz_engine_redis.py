"""Fuzz, engine level: a damaged entry in the Redis tier is a miss, and the answer is cold's.

The Redis twin of ``test_fuzz_engine_store.py``. Whatever a hostile or broken peer left under one key of a
request (its bytes mutated as ``test_fuzz_store.damage`` does, re-signed or not; a header claiming a huge
shape, another dtype or a header longer than the value; another Redis type: a list, a hash, a set, a sorted
set; the value deleted, retyped, grown, shrunk or swapped between the probe and the read), an engine over
that tier answers with cold's first-token logits bit for bit, the segment that key held is ``rejected`` or
``computed`` (never reused), the good entries around it still hit, and the tier never raised: exact mode
(prefix-chained entries) and blend mode (canonical chunk entries) both. Garbage in the tier's record logs
(the donor index's list) is no donor, never an error; a value of several hundred MB that its header backs is
read once (under the tier's cap) and rejected; a server that dies, stalls or drips its replies mid-request is a
miss within the call's deadline, with one warning.

Runs against ``$KVBLEND_TEST_REDIS`` (a private server otherwise, skipped if neither); every test keeps its
keys under its own prefix.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator
from urllib.parse import urlsplit

import pytest
import redis
import torch
from hypothesis import given
from hypothesis import strategies as st

import blend.store.redis_logs as redis_logs
from blend.donor_records import DonorRecordError, parse_record
from blend.engine import Engine
from blend.keys import Namespace, StoreKey
from blend.policy import ReusePolicy
from blend.report import REUSED_CLASSES, ReuseClass
from blend.store.base import Lookup, LookupStatus
from blend.store.codec import MAX_HEADER_BYTES, EntryError, decode
from blend.store.memory import MemoryStore
from blend.store.redis_store import RedisStore
from conftest import make_docs
from _fuzz_util import bounded, dumps_mutated, fuzz_budget, mutate_bytes, mutate_json, still_the_entry
from _store_util import RedisServer, own_redis_server, unique_prefix
from test_fuzz_store import _join, _split, damage

POLICIES = {"exact": ReusePolicy.exact(), "blend": ReusePolicy.blend(ratio=0.2)}
ENGINE_FUZZ = fuzz_budget(40)  # ~0.1 s an example (a request on the tiny model, a fresh engine over the tier)
HUNDREDS_OF_MB = 400 << 20


@dataclass(repr=False)  # a failing example names its fixture: not its blobs
class Warm:
    eng: Any
    prompt: Any
    cold: dict  # mode -> cold answer
    warm: dict  # mode -> answer over the intact tier
    url: str
    prefix: str
    raw: redis.Redis  # a plain client: what a hostile peer writes with
    pristine: dict[bytes, bytes]  # every key of the tier as filled -> its value

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # how hypothesis shows a failing example's fixture
        printer.text(f"Warm(prefix={self.prefix!r})")

    def restore(self) -> None:
        """Undo an earlier example's damage (and the recomputed entries its request wrote back)."""
        pipe = self.raw.pipeline(transaction=False)
        for rk in self.raw.scan_iter(match=f"{self.prefix}:*", count=1000):
            if rk not in self.pristine:
                pipe.delete(rk)
        for rk, blob in self.pristine.items():
            pipe.delete(rk)
            pipe.set(rk, blob)
        pipe.execute()

    def store(self, **kw: Any) -> RedisStore:
        return RedisStore(self.url, prefix=self.prefix, **kw)

    def read_by(self, mode: str) -> list[bytes]:
        """The keys whose entries the warm request of ``mode`` reused (a damaged one is read, not skipped)."""
        used = {s.key for s in self.warm[mode].report.segments if s.reuse_class in REUSED_CLASSES}
        return sorted(rk for rk in self.pristine if rk.rsplit(b":", 1)[1].decode() in used)


@pytest.fixture(scope="module")
def warm(tiny_engine_factory, redis_url) -> Iterator[Warm]:
    eng = tiny_engine_factory()
    prompt = eng.build_prompt("Which of these is listed?", make_docs(2))
    cold = {mode: eng.with_store(MemoryStore()).generate(prompt, p, max_new_tokens=1) for mode, p in POLICIES.items()}
    prefix = unique_prefix()
    store = RedisStore(redis_url, prefix=prefix)
    filler = eng.with_store(store)
    for p in POLICIES.values():
        filler.generate(prompt, p, max_new_tokens=1)
    filler.close()
    raw = redis.Redis.from_url(redis_url)
    pristine = {rk: raw.get(rk) for rk in raw.scan_iter(match=f"{prefix}:*")}
    namespaces = {rk.split(b":")[1] for rk in pristine}
    assert namespaces >= {Namespace.EXACT.value.encode(), Namespace.CANONICAL.value.encode()}, namespaces
    w = Warm(eng, prompt, cold, {}, redis_url, prefix, raw, pristine)
    for mode, p in POLICIES.items():  # the tier as filled serves every segment but the question
        again = _answer(w, mode)
        assert torch.equal(again.first_logits, cold[mode].first_logits)
        assert ReuseClass.COMPUTED not in [s.reuse_class for s in again.report.segments[:-1]], mode
        w.warm[mode] = again
    yield w
    store.clear()
    store.close()
    raw.close()


def _answer(w: Warm, mode: str, store: RedisStore | None = None) -> Any:
    """The prompt's answer under ``mode`` from a fresh engine over ``store`` (default: a fresh tier of its own)."""
    own = store is None
    store = store or w.store()
    eng = w.eng.with_store(store)
    try:
        return eng.generate(w.prompt, POLICIES[mode], max_new_tokens=1)
    finally:
        eng.close()
        if own:
            store.close()


def _check(w: Warm, mode: str, ans: Any, target: bytes, may_hit: bool) -> None:
    """Cold's answer; the target's segment never reused (unless ``may_hit``), every other one as warm."""
    assert torch.equal(ans.first_logits, w.cold[mode].first_logits)
    assert ans.token_ids == w.cold[mode].token_ids
    hexkey = target.rsplit(b":", 1)[1].decode()
    for seg, was in zip(ans.report.segments, w.warm[mode].report.segments):
        if seg.key == hexkey:
            if not may_hit:
                assert seg.reuse_class in (ReuseClass.REJECTED, ReuseClass.COMPUTED), seg
        elif was.reuse_class in REUSED_CLASSES:  # the good entries around the damaged one still hit
            assert seg.reuse_class is was.reuse_class, (seg, was)


# ---- damage written in place --------------------------------------------------------------------------


def _reclaim(blob: bytes, data: st.DataObject) -> bytes:
    """The header's claims rewritten and re-signed: a huge shape, another dtype, a header length past the value."""
    how = data.draw(st.sampled_from(["tokens", "dims", "dtype", "header length", "provenance"]), label="claim")
    if how == "header length":
        n = data.draw(st.sampled_from([len(blob), MAX_HEADER_BYTES, MAX_HEADER_BYTES + 1, 2**63, 2**64 - 1]),
                      label="n")
        return struct.pack("<Q", n) + blob[8:]
    table, meta, tensors = _split(blob)
    if how == "provenance":  # another engine's (one field changed), or this one's with another kv_dtype
        prov = json.loads(meta["provenance"])
        field = data.draw(st.sampled_from(sorted(prov)), label="field")
        prov[field] = "float16" if field == "kv_dtype" else f"{prov[field]}x"
        meta = {**meta, "provenance": json.dumps(prov, sort_keys=True, separators=(",", ":"))}
        return _join(table, meta, tensors, resign=True)
    L, H, T, D = meta["shape"]
    if how == "tokens":  # several hundred MB claimed over a few KB of value
        shape = [L, H, HUNDREDS_OF_MB // (2 * L * H * D * 4), D]
    elif how == "dims":
        shape = data.draw(st.sampled_from([[2**20 + 1, H, T, D], [L, 2**40, T, D], [L, H, 2**31 + 1, D],
                                           [2**20, 2**20, 2**20, 2**20], [0, H, T, D], [L, H, -1, D]]), label="dims")
    else:
        meta = {**meta, "dtype": data.draw(st.sampled_from(["float16", "bfloat16", "float64", "int8"]), label="dtype")}
        shape = [L, H, T, D]
    meta = {**meta, "shape": shape}
    n = 1
    for d in shape:
        n *= d
    st_dtype = {"float16": "F16", "bfloat16": "BF16"}.get(meta["dtype"], "F32")
    size = n * (2 if st_dtype != "F32" else 4)
    tensors_table = {name: {"dtype": st_dtype, "shape": shape, "data_offsets": [i * size, (i + 1) * size]}
                     for i, name in enumerate(("k", "v"))}
    return _join({**table, **tensors_table}, meta, tensors, resign=True)


def _plant(w: Warm, target: bytes, data: st.DataObject) -> bytes | None:
    """Damage the value at ``target``; the bytes now there (None: no string value)."""
    how = data.draw(st.sampled_from(["bytes", "claim", "type", "empty"]), label="how")
    pristine = w.pristine[target]
    if how == "bytes":
        blob = damage(pristine, data)
    elif how == "claim":
        blob = _reclaim(pristine, data)
    elif how == "empty":
        blob = b""
    else:
        kind = data.draw(st.sampled_from(["list", "hash", "set", "zset", "stream"]), label="type")
        w.raw.delete(target)
        {"list": lambda: w.raw.rpush(target, pristine[:100], b"x"),
         "hash": lambda: w.raw.hset(target, mapping={b"k": pristine[:100]}),
         "set": lambda: w.raw.sadd(target, pristine[:100]),
         "zset": lambda: w.raw.zadd(target, {pristine[:100]: 1.0}),
         "stream": lambda: w.raw.xadd(target, {b"k": pristine[:100]})}[kind]()
        return None
    w.raw.set(target, blob)
    return blob


@ENGINE_FUZZ
@given(data=st.data(), mode=st.sampled_from(sorted(POLICIES)))
def test_a_damaged_entry_in_redis_is_a_miss_and_the_answer_is_colds(warm, data, mode):
    w = warm
    w.restore()
    target = data.draw(st.sampled_from(w.read_by(mode)), label="entry")
    blob = _plant(w, target, data)
    may_hit = blob is not None and still_the_entry(blob, w.pristine[target])
    with bounded(max_bytes=64 << 20):
        _check_tier(w, target, may_hit)
        ans = _answer(w, mode)
    _check(w, mode, ans, target, may_hit)


def _check_tier(w: Warm, target: bytes, may_hit: bool) -> None:
    """The tier itself: a lookup of the damaged key is no hit, ``verify`` says it is not valid, and ``info``
    answers or raises ``EntryError`` (never another exception)."""
    ns, key = Namespace(target.split(b":")[-2].decode()), StoreKey(bytes.fromhex(target.rsplit(b":", 1)[1].decode()))
    store = w.store()
    try:
        got = store.get(ns, key, decode(bytearray(w.pristine[target])).provenance)
        assert may_hit or got.status is not LookupStatus.HIT
        if got.status is LookupStatus.REJECTED and got.reason != "provenance mismatch":  # verify knows no provenance
            assert store.verify(ns, key).invalid
        try:
            store.info(ns, key)
        except EntryError:
            pass
        assert store.check_reachable() == ""  # every call reached the server: no miss came from an outage
    finally:
        store.close()


# ---- damage between the probe and the read ---------------------------------------------------------------


class _Racer:
    """Wraps a store's client: the first GETRANGE after a probe of ``target`` runs ``change`` before it reads
    (another writer's command landing between the tier's two round trips)."""

    def __init__(self, client: redis.Redis, target: bytes, change: Callable[[], None]) -> None:
        self.client, self.target, self.change, self.fired = client, target, change, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    def getrange(self, key: bytes, start: int, end: int) -> Any:
        if key == self.target and not self.fired:
            self.fired = True
            self.change()
        return self.client.getrange(key, start, end)


@ENGINE_FUZZ
@given(data=st.data(), mode=st.sampled_from(sorted(POLICIES)))
def test_a_value_that_changes_between_probe_and_read_is_never_used(warm, data, mode):
    w = warm
    w.restore()
    target = data.draw(st.sampled_from(w.read_by(mode)), label="entry")
    pristine = w.pristine[target]
    other = data.draw(st.sampled_from(sorted(rk for rk in w.pristine if rk != target)), label="other")
    how = data.draw(st.sampled_from(["delete", "list", "grow", "shrink", "another entry", "flip", "same"]),
                    label="change")
    at = data.draw(st.integers(0, len(pristine) - 1), label="at")  # where it flips a bit, or shrinks to
    grow = data.draw(st.integers(1, 1 << 16), label="grow by")
    change = {  # run by the tier's prefetch thread: nothing drawn there
        "delete": lambda: w.raw.delete(target),
        "list": lambda: (w.raw.delete(target), w.raw.rpush(target, b"x")),
        "grow": lambda: w.raw.append(target, b"\0" * grow),
        "shrink": lambda: w.raw.set(target, pristine[:at]),
        "another entry": lambda: w.raw.set(target, w.pristine[other]),
        "flip": lambda: w.raw.setrange(target, at, bytes([pristine[at] ^ 0x10])),
        "same": lambda: w.raw.set(target, pristine),
    }[how]
    store = w.store()
    store._link.client = racer = _Racer(store._link.client, target, change)
    try:
        with bounded(max_bytes=64 << 20):
            ans = _answer(w, mode, store)
    finally:
        store.close()
    assert racer.fired  # the change landed between the probe and the read
    _check(w, mode, ans, target, may_hit=how == "same")


def test_a_value_of_hundreds_of_mb_is_rejected_within_the_cap(warm):
    """A value that really is several hundred MB, its header claiming exactly that (this engine's provenance,
    a shape of 300 MB): under the tier's cap (2 GiB), so it is read, once, and rejected (its checksum); the
    answer is cold's. With another provenance, or a claim the value's length does not back, nothing past the
    header is read (the property tests above)."""
    w = warm
    w.restore()
    target = w.read_by("exact")[0]
    table, meta, _ = _split(w.pristine[target])
    L, H, _, D = meta["shape"]
    shape = [L, H, HUNDREDS_OF_MB * 3 // 4 // (2 * L * H * D * 4), D]
    n = L * H * shape[2] * D * 4
    table = {**table, **{name: {**table[name], "shape": shape, "data_offsets": [i * n, (i + 1) * n]}
                         for i, name in enumerate(("k", "v"))}}
    head = _join(table, {**meta, "shape": shape}, b"", resign=False)
    try:
        w.raw.set(target, head)
        w.raw.setrange(target, len(head) + 2 * n - 1, b"\0")  # zeros up to the claimed size, made by the server
    except redis.ResponseError as e:  # a server with a memory limit
        pytest.skip(f"the server will not hold {2 * n >> 20} MB: {e}")
    try:
        t0 = time.perf_counter()
        with bounded(max_bytes=5 * n, seconds=30):  # the value and one copy of it
            ans = _answer(w, "exact")
        took = time.perf_counter() - t0
    finally:
        w.raw.delete(target)
    _check(w, "exact", ans, target, may_hit=False)
    assert ReuseClass.REJECTED in [s.reuse_class for s in ans.report.segments]
    assert took < 20, took


# ---- a server that goes away, stalls or drips mid-request ----------------------------------------------------


class _SlowProxy:
    """A TCP proxy before a Redis server: requests pass at once; replies pass at once until :attr:`mode` is set,
    then ``stall`` holds them (the server seems hung) and ``drip`` sends them ``DRIP`` bytes at a time, one
    piece every ``DRIP_S`` (each wait under any socket timeout, the whole reply far over it)."""

    DRIP, DRIP_S = 1024, 0.02  # ~50 KB/s: a 280 KB entry takes 5.6 s

    def __init__(self, host: str, port: int) -> None:
        self.upstream = (host, port)
        self.mode = ""
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            threading.Thread(target=self._pass, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pass, args=(server, client, True), daemon=True).start()

    def _pass(self, src: socket.socket, dst: socket.socket, reply: bool) -> None:
        try:
            while not self.closed.is_set() and (data := src.recv(65536)):
                while reply and self.mode == "stall" and not self.closed.is_set():
                    time.sleep(0.01)
                step = self.DRIP if reply and self.mode == "drip" else len(data)
                for i in range(0, len(data), step):
                    if step != len(data):
                        time.sleep(self.DRIP_S)
                    dst.sendall(data[i : i + step])
        except OSError:
            pass
        finally:
            for s in (src, dst):
                s.close()

    def close(self) -> None:
        self.closed.set()
        self.sock.close()


def _outage_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "unreachable" in r.getMessage()]


@pytest.mark.parametrize("mode", ["stall", "drip"])
def test_a_stalled_or_dripping_server_is_a_miss_within_the_deadline(warm, mode, caplog):
    """A drip kept every wait for bytes under the socket timeout: the request took as long as the server liked
    (5-20 s here, under a 0.3 s timeout). Now each call has a deadline (the socket timeout plus its bytes at
    ``min_rate``): the request is cold's, answered in about the timeout, with one line saying why."""
    w = warm
    w.restore()
    where = urlsplit(w.url)
    if where.scheme != "redis" or where.port is None:
        pytest.skip("the proxy needs a redis://HOST:PORT server")
    proxy = _SlowProxy(where.hostname or "127.0.0.1", where.port)
    store = RedisStore(f"redis://127.0.0.1:{proxy.port}{where.path}", prefix=w.prefix, socket_timeout_s=0.3,
                       retry_after_s=60)
    try:
        assert store.available and store.contains(*_first_key(w, "exact"))  # through the proxy, at full speed
        proxy.mode = mode
        with caplog.at_level(logging.WARNING, logger="blend.store"):
            t0 = time.perf_counter()
            ans = _answer(w, "exact", store)
            took = time.perf_counter() - t0
    finally:
        proxy.close()
        store.close()
    assert torch.equal(ans.first_logits, w.cold["exact"].first_logits)
    assert all(s.reuse_class is ReuseClass.COMPUTED for s in ans.report.segments), ans.report.segments
    assert took < 2.0, took
    (line,) = _outage_warnings(caplog)
    assert "during get" in line
    if mode == "drip":
        assert "no whole answer within" in line and "MiB/s" in line


def _first_key(w: Warm, mode: str) -> tuple[Namespace, StoreKey]:
    """(namespace, key) of the first entry the warm request of ``mode`` reused."""
    seg = next(s for s in w.warm[mode].report.segments if s.reuse_class in REUSED_CLASSES)
    rk = next(rk for rk in w.pristine if rk.endswith(seg.key.encode()))
    return Namespace(rk.split(b":")[-2].decode()), StoreKey(bytes.fromhex(seg.key))


class _DyingStore(RedisStore):
    """A Redis tier whose server is shut down right after its ``after``-th lookup."""

    def __init__(self, server: RedisServer, after: int, **kw: Any) -> None:
        super().__init__(server.url, **kw)
        self.server, self.after, self.lookups = server, after, 0
        self.lock = threading.Lock()

    def get(self, ns: Namespace, key: StoreKey, provenance: str) -> Lookup:
        with self.lock:  # the prefetcher looks up from two threads
            self.lookups += 1
            if self.lookups == self.after + 1:
                self.server.stop()
        return super().get(ns, key, provenance)


@pytest.mark.parametrize("mode", sorted(POLICIES))
@pytest.mark.parametrize("after", [0, 1], ids=["between-store-and-load", "mid-request"])
def test_a_server_gone_mid_request_is_a_miss_and_the_answer_is_colds(warm, mode, after, caplog):
    """Shut down between the store and the load (or after the request's first lookup): cold's answer, the
    segments looked up after the shutdown computed, one warning, no wait; the server back, the tier is too."""
    server = own_redis_server()  # this test kills its server, so it never uses a shared one
    try:
        prefix = unique_prefix()
        filler = RedisStore(server.url, prefix=prefix)
        _answer(warm, mode, filler)  # stores the request's entries
        filler.close()
        store = _DyingStore(server, after, prefix=prefix, retry_after_s=0.2)
        with caplog.at_level(logging.WARNING, logger="blend.store"):
            t0 = time.perf_counter()
            ans = _answer(warm, mode, store)
            took = time.perf_counter() - t0
        assert torch.equal(ans.first_logits, warm.cold[mode].first_logits)
        assert ans.token_ids == warm.cold[mode].token_ids
        classes = [s.reuse_class for s in ans.report.segments]
        assert ReuseClass.COMPUTED in classes[after:-1], classes
        assert took < 2.0, took
        assert len(_outage_warnings(caplog)) == 1, caplog.text
        server.start()  # same port, empty (no persistence): the next request computes and stores again
        time.sleep(0.25)  # past the back-off
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="blend.store"):
            again = _answer(warm, mode, store)
        assert torch.equal(again.first_logits, warm.cold[mode].first_logits)
        assert "reachable again" in caplog.text
        store.close()
    finally:
        server.stop()


# ---- garbage in the record log the tier keeps (the donor index's) ------------------------------------------

SEMANTIC = ReusePolicy.blend(ratio=0.2, semantic=True)
LOG_FUZZ = fuzz_budget(15)  # ~0.2 s an example (a fresh semantic engine reads the log, then a request)


@dataclass(repr=False)
class Donors:
    eng: Any  # an engine with semantic reuse on (the same weights)
    prompt: Any  # one document edited: its KV comes from a donor the log names
    with_donor: Any  # the answer over the intact log
    without: Any  # the answer with no log (the edited document computed)
    prefix: str
    log_key: bytes
    records: list[bytes]  # the intact log
    entries: dict[bytes, bytes] = dataclasses.field(default_factory=dict)  # every entry key -> its value

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(f"Donors(prefix={self.prefix!r})")


@pytest.fixture(scope="module")
def donors(warm: Warm) -> Iterator[Donors]:
    eng = Engine(warm.eng.runner, dataclasses.replace(warm.eng.config, experimental_semantic=True))
    docs = make_docs(2)
    words = docs[1].split(" ")
    words[5] = "zebra"
    edited = eng.build_prompt("Which of these is listed?", [docs[0], " ".join(words)])
    prefix = unique_prefix()
    store = RedisStore(warm.url, prefix=prefix)
    filler = eng.with_store(store)
    filler.generate(eng.build_prompt("Which of these is listed?", docs), SEMANTIC, max_new_tokens=1)
    filler.close()
    (log_key,) = list(warm.raw.scan_iter(match=f"{prefix}:log:*"))
    records = warm.raw.lrange(log_key, 0, -1)
    entries = {rk: warm.raw.get(rk) for rk in warm.raw.scan_iter(match=f"{prefix}:*") if rk != log_key}
    d = Donors(eng, edited, None, None, prefix, log_key, records, entries)
    d.with_donor = _semantic_answer(warm, d, entries)
    assert ReuseClass.SEMANTIC in [s.reuse_class for s in d.with_donor.report.segments]
    d.without = _semantic_answer(warm, d, entries, log=[])
    assert ReuseClass.SEMANTIC not in [s.reuse_class for s in d.without.report.segments]
    yield d
    store.clear()
    store.close()


def _semantic_answer(w: Warm, d: Donors, entries: dict[bytes, bytes], log: list[bytes] | None = None,
                     plant: Callable[[], None] | None = None) -> Any:
    """The edited prompt's answer from a fresh semantic engine over the tier: its entries as filled, its log
    ``log`` (default: as filled) or whatever ``plant`` writes there."""
    pipe = w.raw.pipeline(transaction=False)
    for rk in w.raw.scan_iter(match=f"{d.prefix}:*"):
        pipe.delete(rk)
    for rk, blob in entries.items():
        pipe.set(rk, blob)
    lines = d.records if log is None else log
    if lines and plant is None:
        pipe.rpush(d.log_key, *lines)
    pipe.execute()
    if plant is not None:
        plant()
    store = RedisStore(w.url, prefix=d.prefix)
    eng = d.eng.with_store(store)
    try:
        return eng.generate(d.prompt, SEMANTIC, max_new_tokens=1)
    finally:
        eng.close()
        store.close()


def _garbage_record(record: bytes, data: st.DataObject) -> bytes:
    how = data.draw(st.sampled_from(["bytes", "json", "text", "binary", "empty"]), label="record")
    if how == "bytes":
        return mutate_bytes(record, data)
    if how == "json":
        return json.dumps(mutate_json(json.loads(record), data)).encode()
    if how == "text":
        return dumps_mutated(json.loads(record), data)
    return b"" if how == "empty" else data.draw(st.binary(min_size=1, max_size=64), label="bytes")


@LOG_FUZZ
@given(data=st.data())
def test_garbage_in_the_donor_log_is_no_donor_never_an_error(warm, donors, data):
    """Whatever the log's key holds (another type, garbage records among the good ones, a log over its cap), a
    semantic request answers as with the intact log or as with none, bit for bit; where every garbage
    record is unparsable, the good ones still serve (as with the intact log)."""
    w, d = warm, donors
    how = data.draw(st.sampled_from(["type", "records", "oversized"]), label="log")
    lines = list(d.records)
    unparsable = True
    if how == "type":
        kind = data.draw(st.sampled_from(["string", "hash", "set", "zset"]), label="type")
        blob = data.draw(st.binary(max_size=64), label="value") or b"x"
        plant = {"string": lambda: w.raw.set(d.log_key, blob), "hash": lambda: w.raw.hset(d.log_key, b"k", blob),
                 "set": lambda: w.raw.sadd(d.log_key, blob), "zset": lambda: w.raw.zadd(d.log_key, {blob: 1})}[kind]
        unparsable = False  # no records at all: no donor
    else:
        for _ in range(data.draw(st.integers(1, 3), label="garbage")):
            bad = _garbage_record(data.draw(st.sampled_from(d.records), label="of"), data)
            if how == "oversized":
                bad += b" " * (64 << 10)  # over the log cap set below: the log is trimmed to its newest records
            try:
                parse_record(bad)
                unparsable = False
            except DonorRecordError:
                pass
            lines.insert(data.draw(st.integers(0, len(lines)), label="at"), bad)
        unparsable = unparsable and how == "records"  # a trim may drop the good records

        def plant() -> None:
            w.raw.rpush(d.log_key, *lines)

    with pytest.MonkeyPatch.context() as mp, bounded(max_bytes=64 << 20):
        if how == "oversized":
            mp.setattr(redis_logs, "MAX_LOG_BYTES", 32 << 10)
            mp.setattr(redis_logs, "LOG_OVERHEAD_BYTES", 0)
            mp.setattr(redis_logs, "OVERSIZED_KEEP_BYTES", 16 << 10)
        ans = _semantic_answer(w, d, d.entries, plant=plant)
    same = [torch.equal(ans.first_logits, ref.first_logits) for ref in (d.with_donor, d.without)]
    assert any(same), "neither the intact log's answer nor the no-log answer"
    if unparsable:
        assert same[0]
