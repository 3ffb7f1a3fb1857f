"""Fuzz: store entry bytes through the real decoder and tiers.

Property: ``codec.decode`` returns an entry or raises ``EntryError``; a tier's
lookup is a hit (only of the exact tensors that were stored), a miss or a
rejection; ``verify`` and ``info`` answer or raise ``EntryError``; all within
the per-example time and allocation bounds of ``_fuzz_util``."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from blend.keys import Namespace
from blend.store.base import EntryState, KVEntry, LookupStatus, Verdict, check_entry
from blend.store.codec import ChecksumKind, EntryError, EntryHeader, checksum, decode, decode_header, encode
from blend.store.disk import DiskStore
from blend.store.redis_store import RedisStore
from blend.store.spec import StoreSpecError, TierKind, parse_store_spec
from _fuzz_util import FUZZ, ExampleHung, bounded, dumps_mutated, json_values, mutate_bytes, mutate_json
from _store_util import NS, RedisServer, key_for, make_prov, rand_entry, redis_url_for_tests, unique_prefix

PROVS = {d: make_prov(d) for d in ("float32", "float16", "bfloat16")}
KEY = key_for(PROVS["float32"], 0)


@st.composite
def valid_blobs(draw: st.DrawFn) -> tuple[bytes, KVEntry, str]:
    """A valid blob of a small random entry, with the entry and its provenance JSON."""
    dtype = draw(st.sampled_from(sorted(PROVS)))
    L, H, T, D = (draw(st.integers(0 if i == 2 else 1, 4)) for i in range(4))
    entry = rand_entry(PROVS[dtype], T=T, L=L, H=H, D=D, seed=draw(st.integers(0, 3)))
    return encode(NS, KEY, entry), entry, PROVS[dtype].canonical_json()


def _split(blob: bytes) -> tuple[Any, Any, bytes]:
    (n,) = struct.unpack("<Q", blob[:8])
    table = json.loads(blob[8 : 8 + n])
    return table, json.loads(table["__metadata__"]["kvblend"]), blob[8 + n :]


def _join(table: Any, meta: Any, data: bytes, resign: bool) -> bytes:
    """A blob from (possibly rewritten) headers; ``resign`` recomputes the checksum when the
    kvblend fields still form a header, so the rewrite reaches the checks after it."""
    if resign and isinstance(meta, dict):
        try:
            kind = next(k for k in ChecksumKind if k.value in meta)
            rest = {f: v for f, v in meta.items() if f != kind.value}
            hdr = EntryHeader(**{**rest, "checksum": "", "checksum_kind": kind, "shape": tuple(meta["shape"])})
            meta = {**rest, kind.value: checksum(hdr, memoryview(data))}
        except Exception:  # noqa: BLE001 - not a header any more: leave it unsigned
            pass
    if isinstance(table, dict) and isinstance(table.get("__metadata__"), dict):
        table = {**table, "__metadata__": {**table["__metadata__"], "kvblend": json.dumps(meta)}}
    hj = json.dumps(table).encode()
    hj += b" " * (-len(hj) % 8)
    return struct.pack("<Q", len(hj)) + hj + data


def damage(blob: bytes, data: st.DataObject) -> bytes:
    """A valid blob after one kind of damage: bit flips / a truncation / an extension of its bytes, a
    JSON-keeping rewrite of the safetensors table or of the kvblend metadata (re-signed or not), or either
    written as a JSON text json.dumps never writes (:func:`_fuzz_util.dumps_mutated`)."""
    how = data.draw(st.sampled_from(["bytes", "table", "meta", "meta-resigned", "table-text", "meta-text"]),
                    label="damage")
    if how == "bytes":
        (n,) = struct.unpack("<Q", blob[:8])
        return mutate_bytes(blob, data, header_end=8 + n)
    table, meta, tensors = _split(blob)
    if how.endswith("-text"):  # a JSON text json.dumps never writes: too many digits, NaN, nesting, a key twice
        if how == "meta-text":
            kvblend = dumps_mutated(meta, data).decode("utf-8", "surrogatepass")
            hj = json.dumps({**table, "__metadata__": {"kvblend": kvblend}}).encode()
        else:
            hj = dumps_mutated(table, data)
        hj += b" " * (-len(hj) % 8)
        return struct.pack("<Q", len(hj)) + hj + tensors
    tensors_table = {"k": table["k"], "v": table["v"]}  # the kvblend metadata is rewritten on its own
    for _ in range(data.draw(st.integers(1, 3), label="rewrites")):
        if how == "table":
            tensors_table = mutate_json(tensors_table, data)
        else:
            meta = mutate_json(meta, data)
    if isinstance(tensors_table, dict):
        table = {"__metadata__": table["__metadata__"], **tensors_table}
    else:
        table = tensors_table
    return _join(table, meta, tensors, resign=how == "meta-resigned")


@st.composite
def hostile_blobs(draw: st.DrawFn) -> tuple[bytes, KVEntry, str]:
    """A valid blob of a small random entry after one kind of :func:`damage`."""
    blob, entry, prov = draw(valid_blobs())
    return damage(blob, draw(st.data())), entry, prov


def _check_decode(blob: bytes, entry: KVEntry, prov: str) -> None:
    try:
        got = decode(bytearray(blob), NS, KEY)
    except EntryError:
        return
    why = check_entry(got, prov)  # may be a rejection (e.g. a re-signed provenance), never an exception
    if not why:
        assert torch.equal(got.k, entry.k) and torch.equal(got.v, entry.v)  # a hit is what was stored


@FUZZ
@given(blob=st.binary(max_size=2048))
def test_decode_of_random_bytes(blob: bytes) -> None:
    with bounded():
        with pytest.raises(EntryError):
            decode(bytearray(blob), NS, KEY)
        try:
            decode_header(blob)
        except EntryError:
            pass


@FUZZ
@given(case=hostile_blobs())
def test_decode_of_mutated_entries(case: tuple[bytes, KVEntry, str]) -> None:
    with bounded():
        _check_decode(*case)


def _check_verify(got: Any, verdict: Verdict) -> None:
    """``verify`` (which knows no requested provenance) agrees with the lookup: a hit verifies clean;
    an entry the lookup rejected for anything but a provenance mismatch (undecodable, damaged, wrong
    shape) is flagged by verify with the same reason; a miss is absent."""
    assert isinstance(verdict, Verdict)
    if got.status is LookupStatus.HIT:
        assert verdict.state is EntryState.VALID and verdict.reason == ""
    elif got.status is LookupStatus.REJECTED and got.reason != "provenance mismatch":
        assert verdict.invalid and verdict.reason == got.reason, (got.reason, verdict)
    elif got.status is LookupStatus.MISS and not got.reason:
        assert verdict.state is EntryState.ABSENT


@FUZZ
@given(case=hostile_blobs(), sparse=st.sampled_from([0, 0, 0, 1 << 20, 1 << 40]))
def test_disk_tier_over_mutated_entry_files(tmp_path_factory: pytest.TempPathFactory,
                                            case: tuple[bytes, KVEntry, str], sparse: int) -> None:
    blob, entry, prov = case
    root = tmp_path_factory.mktemp("disk")
    store = DiskStore(root, fsync=False)
    path = store.path(NS, KEY)
    path.parent.mkdir(parents=True)
    path.write_bytes(blob)
    if sparse:
        os.truncate(path, len(blob) + sparse)  # a file far larger than any header claims: never read whole
    with bounded(max_bytes=4 * len(blob) + (8 << 20)):
        got = store.get(NS, KEY, prov)
        assert got.status in (LookupStatus.HIT, LookupStatus.REJECTED)
        if got.status is LookupStatus.HIT:
            assert torch.equal(got.entry.k, entry.k) and torch.equal(got.entry.v, entry.v)
        _check_verify(got, store.verify(NS, KEY))
        try:
            store.info(NS, KEY)
        except EntryError:
            pass
    assert store.delete(NS, KEY) and not os.path.lexists(path)


@pytest.fixture(scope="module")
def redis_store() -> Iterator[RedisStore]:
    url, server = redis_url_for_tests()
    store = RedisStore(url, prefix=unique_prefix())
    yield store
    store.clear()
    store.close()
    if isinstance(server, RedisServer):
        server.stop()


@FUZZ
@given(case=hostile_blobs())
def test_redis_tier_over_mutated_values(redis_store: RedisStore, case: tuple[bytes, KVEntry, str]) -> None:
    blob, entry, prov = case
    redis_store.put_raw(NS, KEY, blob)
    with bounded(max_bytes=4 * len(blob) + (8 << 20)):
        got = redis_store.get(NS, KEY, prov)
        assert got.status in (LookupStatus.HIT, LookupStatus.REJECTED, LookupStatus.MISS)
        if got.status is LookupStatus.HIT:
            assert torch.equal(got.entry.k, entry.k) and torch.equal(got.entry.v, entry.v)
        _check_verify(got, redis_store.verify(NS, KEY))
        try:
            redis_store.info(NS, KEY)
        except EntryError:
            pass
    assert redis_store.check_reachable() == ""  # every call reached the server: no miss came from an outage


@FUZZ
@given(meta=json_values, table=json_values)
def test_decode_of_random_headers(meta: Any, table: Any) -> None:
    """Any JSON at all in the safetensors table and in the kvblend metadata."""
    blob = _join({"__metadata__": {"kvblend": ""}, "k": table, "v": table}, meta, b"\0" * 16, resign=False)
    blob2 = _join(table, meta, b"", resign=False)
    with bounded():
        for b in (blob, blob2):
            with pytest.raises(EntryError):
                decode(bytearray(b), Namespace.CANONICAL, KEY)


def test_the_bounds_fail_a_hung_or_greedy_example(tmp_path: Path) -> None:
    """The per-example bounds are real: a read blocked on a FIFO and a large allocation fail."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(ExampleHung):
        with bounded(seconds=0.5):
            with open(fifo, "rb") as f:  # blocks until a writer appears: never
                f.read()
    with pytest.raises(AssertionError, match="over the cap"):
        with bounded(max_bytes=1 << 20):
            bytearray(4 << 20)


SPEC_PARTS = st.sampled_from([
    "memory", "disk:/tmp/kv", "disk:/tmp/kv?max_bytes=1G", "redis://localhost:6379/0", "redis://u:pw@h:1/0?ttl=5",
    "unix:///tmp/r.sock?db=2", "rediss://h/0?prefix=p", ",", "?", "=", "&", ":", "/", "max_bytes=", "ttl=", "db=",
    "1e400", "nan", "-1", "0x10", "\x00", "\udcff", "%zz", "[", "]", "@", "#",
])


@FUZZ
@given(spec=st.lists(SPEC_PARTS | st.text(max_size=8), max_size=6).map("".join))
@example(spec="redis://localhost:6379/0?x=\udcff")  # a byte argv could not decode: UnicodeEncodeError escaped
@example(spec="redis://u:p\udcff@h:1/0")
def test_store_specs_of_any_text_parse_or_raise_store_spec_error(spec: str) -> None:
    with bounded():
        try:
            tiers = parse_store_spec(spec)
        except StoreSpecError as e:
            assert "\udcff" not in str(e)  # printable on a UTF-8 terminal
            return
    for t in tiers:
        if t.kind is TierKind.REDIS:
            (t.location + t.prefix).encode("utf-8")  # what redis-py is handed: UTF-8 text
        elif t.kind is TierKind.DISK:
            assert t.location and (t.budget_bytes is None or 1 <= t.budget_bytes)
