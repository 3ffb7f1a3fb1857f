"""Disk tier and codec: round trips, every corruption case, ``kvblend store verify``."""

from __future__ import annotations

import argparse
import io
import json
import logging
import struct
from pathlib import Path
from typing import Any, Callable

import pytest
import safetensors.torch
import torch

from blend.keys import Namespace
from blend.store.base import LookupStatus
from blend.store.cli import add_store_commands, run_store_command
from blend.store.codec import EntryError, EntryErrorKind, decode, encode
from blend.store.disk import DiskStore
from _store_util import NS, key_for, make_prov, other_prov, rand_entry

PROV = make_prov()


def _table(blob: bytes) -> tuple[int, dict[str, Any]]:
    """A blob's safetensors header: its length and its table."""
    (n,) = struct.unpack("<Q", blob[:8])
    return n, json.loads(blob[8 : 8 + n])


def retag(blob: bytes, meta: dict[str, Any] | None = None, table: dict[str, Any] | None = None,
          drop: tuple[str, ...] = ()) -> bytes:
    """Rewrite a blob's headers (kvblend metadata and/or the safetensors table), keeping the data;
    ``drop`` removes kvblend metadata fields."""
    n, tab = _table(blob)
    m = json.loads(tab["__metadata__"]["kvblend"])
    m.update(meta or {})
    for name in drop:
        del m[name]
    tab["__metadata__"]["kvblend"] = json.dumps(m)
    for name, fields in (table or {}).items():
        tab[name].update(fields)
    hj = json.dumps(tab).encode()
    hj += b" " * (-len(hj) % 8)
    return struct.pack("<Q", len(hj)) + hj + blob[8 + n :]


@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "bfloat16"])
def test_roundtrip_is_bit_exact_and_plain_safetensors(tmp_path: Path, kv_dtype: str) -> None:
    prov = make_prov(kv_dtype)
    entry = rand_entry(prov, T=11)
    store = DiskStore(tmp_path)
    store.put(NS, key_for(prov, 0), entry)
    got = DiskStore(tmp_path).get(NS, key_for(prov, 0), prov.canonical_json())  # a fresh process's view
    assert got.status is LookupStatus.HIT and got.tier == "disk"
    assert got.entry is not None
    assert torch.equal(got.entry.k, entry.k) and torch.equal(got.entry.v, entry.v)
    assert got.entry.k.dtype == entry.k.dtype
    plain = safetensors.torch.load_file(str(store.path(NS, key_for(prov, 0))))  # any safetensors reader
    assert torch.equal(plain["k"], entry.k) and torch.equal(plain["v"], entry.v)


def test_miss_and_namespaces_are_disjoint(tmp_path: Path) -> None:
    store = DiskStore(tmp_path)
    key = key_for(PROV, 0)
    store.put(Namespace.APPROX, key, rand_entry(PROV))
    assert store.get(Namespace.EXACT, key, PROV.canonical_json()).status is LookupStatus.MISS
    assert store.get(Namespace.CANONICAL, key, PROV.canonical_json()).status is LookupStatus.MISS
    assert store.get(Namespace.APPROX, key, PROV.canonical_json()).status is LookupStatus.HIT
    assert list(store.keys(Namespace.APPROX)) == [key] and list(store.keys(Namespace.EXACT)) == []


def _truncate(at: int) -> Callable[[bytes], bytes]:
    return lambda b: b[:at]


def _flip_data_byte(b: bytes) -> bytes:
    out = bytearray(b)
    out[-37] ^= 0x40  # inside v's bytes
    return bytes(out)


def _flip_header_byte(b: bytes) -> bytes:
    out = bytearray(b)
    out[20] ^= 0x01  # inside the JSON header
    return bytes(out)


CORRUPTIONS: dict[str, tuple[Callable[[bytes], bytes], set[EntryErrorKind]]] = {
    "truncate_to_4_bytes": (_truncate(4), {EntryErrorKind.TRUNCATED}),
    "truncate_in_header": (_truncate(60), {EntryErrorKind.TRUNCATED}),
    "truncate_in_data": (_truncate(-100), {EntryErrorKind.TRUNCATED}),
    "truncate_last_byte": (_truncate(-1), {EntryErrorKind.TRUNCATED}),
    "empty_file": (lambda b: b"", {EntryErrorKind.TRUNCATED}),
    "flip_data_byte": (_flip_data_byte, {EntryErrorKind.CHECKSUM}),
    "flip_header_byte": (_flip_header_byte, {EntryErrorKind.BAD_HEADER}),
    "trailing_garbage": (lambda b: b + b"\0" * 8, {EntryErrorKind.SHAPE}),
    "other_format_version": (lambda b: retag(b, meta={"format_version": 2}), {EntryErrorKind.FORMAT_VERSION}),
    "wrong_shape_in_header": (lambda b: retag(b, meta={"shape": [2, 3, 6, 8]}), {EntryErrorKind.SHAPE}),
    "reshape_same_byte_count": (  # every shape field edited consistently: the checksum covers the claims
        lambda b: retag(b, meta={"shape": [2, 3, 14, 4]}, table={"k": {"shape": [2, 3, 14, 4]}, "v": {"shape": [2, 3, 14, 4]}}),
        {EntryErrorKind.CHECKSUM},
    ),
    "provenance_edited_in_header": (
        lambda b: retag(b, meta={"provenance": other_prov(PROV).canonical_json()}), {EntryErrorKind.CHECKSUM}
    ),
    "wrong_dtype_in_header": (lambda b: retag(b, meta={"dtype": "float16"}), {EntryErrorKind.DTYPE}),
    "wrong_dtype_everywhere": (
        lambda b: retag(b, meta={"dtype": "float16"}, table={"k": {"dtype": "F16"}, "v": {"dtype": "F16"}}),
        {EntryErrorKind.SHAPE},  # fp16 of that shape is half the bytes: offsets disagree
    ),
    "not_a_kvblend_blob": (lambda b: safetensors.torch.save({"k": torch.zeros(1)}), {EntryErrorKind.BAD_HEADER}),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corrupt_file_is_rejected_logged_and_found_by_verify(
    tmp_path: Path, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    tamper, kinds = CORRUPTIONS[case]
    key = key_for(PROV, 0)
    blob = encode(NS, key, rand_entry(PROV))
    with pytest.raises(EntryError) as err:
        decode(bytearray(tamper(blob)), NS, key)
    assert err.value.kind in kinds, err.value

    store = DiskStore(tmp_path)
    store.put(NS, key, rand_entry(PROV))
    store.put(NS, key_for(PROV, 1), rand_entry(PROV, seed=1))  # a healthy neighbour
    path = store.path(NS, key)
    path.write_bytes(tamper(path.read_bytes()))
    with caplog.at_level(logging.WARNING, logger="blend.store"):
        got = store.get(NS, key, PROV.canonical_json())
    assert got.status is LookupStatus.REJECTED and got.entry is None
    assert got.reason.startswith(err.value.kind.value)
    assert any("rejected" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    assert store.stats().rejected == 1

    code, report = _cli(tmp_path, "verify")
    assert code == 1 and report["checked"] == 2
    assert [c["key"] for c in report["corrupt"]] == [key.hex()]
    code, report = _cli(tmp_path, "verify", "--delete")
    assert code == 0 and not path.exists() and store.contains(NS, key_for(PROV, 1))


def test_file_copied_under_another_key_is_rejected(tmp_path: Path) -> None:
    store = DiskStore(tmp_path)
    a, b = key_for(PROV, 0), key_for(PROV, 1)
    store.put(NS, a, rand_entry(PROV))
    store.path(NS, b).parent.mkdir(parents=True, exist_ok=True)
    store.path(NS, b).write_bytes(store.path(NS, a).read_bytes())
    got = store.get(NS, b, PROV.canonical_json())
    assert got.status is LookupStatus.REJECTED and got.reason.startswith("key mismatch")


def test_provenance_collision_is_rejected(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = DiskStore(tmp_path)
    key = key_for(PROV, 0)
    store.put(NS, key, rand_entry(other_prov(PROV)))  # same key, another model's KV
    with caplog.at_level(logging.WARNING, logger="blend.store"):
        got = store.get(NS, key, PROV.canonical_json())
    assert got.status is LookupStatus.REJECTED and got.reason == "provenance mismatch"
    assert any("provenance mismatch" in r.getMessage() for r in caplog.records)


def test_reduced_precision_entry_is_never_served_as_full_precision(tmp_path: Path) -> None:
    prov16 = make_prov("float16")
    store = DiskStore(tmp_path)
    store.put(NS, key_for(prov16, 0), rand_entry(prov16))
    # Keys derive from the provenance, so the fp32 request asks for another key ...
    assert key_for(prov16, 0) != key_for(PROV, 0)
    assert store.get(NS, key_for(PROV, 0), PROV.canonical_json()).status is LookupStatus.MISS
    # ... and even under a colliding key the fp32 provenance is refused.
    got = store.get(NS, key_for(prov16, 0), PROV.canonical_json())
    assert got.status is LookupStatus.REJECTED and got.reason == "provenance mismatch"
    assert store.get(NS, key_for(prov16, 0), prov16.canonical_json()).entry.k.dtype == torch.float16  # type: ignore[union-attr]
    # fp16 tensors labelled fp32 are refused on put, and rejected if found on disk.
    lying = rand_entry(prov16)
    lying = type(lying)(lying.k, lying.v, PROV.canonical_json())
    with pytest.raises(ValueError, match="kv_dtype"):
        store.put(NS, key_for(PROV, 0), lying)
    blob = encode(NS, key_for(PROV, 0), lying)
    store.path(NS, key_for(PROV, 0)).parent.mkdir(parents=True, exist_ok=True)
    store.path(NS, key_for(PROV, 0)).write_bytes(blob)
    got = store.get(NS, key_for(PROV, 0), PROV.canonical_json())
    assert got.status is LookupStatus.REJECTED and "kv_dtype" in got.reason


def test_stale_temp_files_are_ignored_and_swept(tmp_path: Path) -> None:
    store = DiskStore(tmp_path)
    key = key_for(PROV, 0)
    store.put(NS, key, rand_entry(PROV))
    tmp = store.path(NS, key).parent / f".{key.hex()}.abc.tmp"
    tmp.write_bytes(b"half an entry")
    assert list(store.keys(NS)) == [key]
    assert store.stats().extra["temp_files"] == 1
    assert store.sweep_temp(older_than_s=0) == 1 and not tmp.exists()


def test_killed_writers_temp_files_are_swept_by_the_budget_scan_and_prune(tmp_path: Path) -> None:
    """Temp files of writers killed before their rename were neither counted in the budget nor removed by
    its scans or `store prune`: eight kills left a budgeted folder at 3x its budget."""
    import os
    import time

    from blend.defaults import DEFAULT_STALE_TEMP_S

    one = len(encode(NS, key_for(PROV, 0), rand_entry(PROV, T=8)))
    store = DiskStore(tmp_path, budget_bytes=one * 4, rescan_s=0.0)
    store.put(NS, key_for(PROV, 0), rand_entry(PROV, T=8))
    shard = store.path(NS, key_for(PROV, 0)).parent
    old = time.time() - DEFAULT_STALE_TEMP_S - 5
    stale = [shard / f".{key_for(PROV, i).hex()}.k{i}.tmp" for i in range(1, 9)]
    for p in stale:
        p.write_bytes(b"x" * one)
        os.utime(p, (old, old))
    live = shard / f".{key_for(PROV, 20).hex()}.live.tmp"  # a write in progress: recent, kept
    live.write_bytes(b"x" * one)
    store.put(NS, key_for(PROV, 1), rand_entry(PROV, T=8))  # the budget scan
    assert not any(p.exists() for p in stale) and live.exists()
    p = stale[0]
    p.write_bytes(b"x")
    os.utime(p, (old, old))
    store.prune(one * 100)
    assert not p.exists() and live.exists()


def _cli(root: Path, *argv: str) -> tuple[int, Any]:
    parser = argparse.ArgumentParser()
    add_store_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["store", argv[0], "--store", f"disk:{root}", "--json", *argv[1:]])
    out = io.StringIO()
    code = run_store_command(args, out)
    return code, json.loads(out.getvalue())


def test_cli_ls_stats_clear(tmp_path: Path) -> None:
    store = DiskStore(tmp_path)
    for i in range(3):
        store.put(NS, key_for(PROV, i), rand_entry(PROV, T=5 + i))
    store.put(Namespace.EXACT, key_for(PROV, 9), rand_entry(PROV))
    code, rows = _cli(tmp_path, "ls", "--namespace", "canonical")
    assert code == 0 and sorted(r["shape"][2] for r in rows) == [5, 6, 7]
    assert all(r["model"] == "llama:test" and r["dtype"] == "float32" for r in rows)
    code, stats = _cli(tmp_path, "stats")
    assert stats["disk"]["entries"] == 4
    code, res = _cli(tmp_path, "clear", "--namespace", "exact")
    assert res["deleted"] == 1 and len(list(store.keys(NS))) == 3
    code, res = _cli(tmp_path, "clear")
    assert res["deleted"] == 3 and store.stats().entries == 0


# ---- byte budget (LRU on disk) ----------------------------------------------------------


def _age(store: DiskStore, key, seconds_ago: float) -> None:
    import os
    import time

    t = time.time() - seconds_ago
    os.utime(store.path(NS, key), (t, t))


def test_budget_evicts_least_recently_used_and_a_hit_refreshes(tmp_path: Path) -> None:
    one = len(encode(NS, key_for(PROV, 0), rand_entry(PROV, T=8)))
    store = DiskStore(tmp_path, budget_bytes=int(one * 3.5))
    for i in range(3):
        store.put(NS, key_for(PROV, i), rand_entry(PROV, T=8))
        _age(store, key_for(PROV, i), 100 - i)  # 0 oldest
    assert store.get(NS, key_for(PROV, 0), PROV.canonical_json()).status is LookupStatus.HIT  # 0 now newest
    store.put(NS, key_for(PROV, 3), rand_entry(PROV, T=8))  # 4 > 3.5 -> down to 3.15: the LRU one goes
    left = {k for k in store.keys(NS)}
    assert left == {key_for(PROV, 0), key_for(PROV, 2), key_for(PROV, 3)}  # 0 survived: its hit refreshed it
    assert store.stats().evictions == 1 and store.stats().bytes <= int(one * 3.5 * 0.9)
    assert store.get(NS, key_for(PROV, 1), PROV.canonical_json()).status is LookupStatus.MISS


def test_budget_counts_files_of_other_processes_and_skips_oversized(tmp_path: Path) -> None:
    other = DiskStore(tmp_path)  # unbounded writer sharing the folder
    for i in range(4):
        other.put(NS, key_for(PROV, i), rand_entry(PROV, T=8))
        _age(other, key_for(PROV, i), 100 - i)
    size = other.stats().bytes // 4
    bounded = DiskStore(tmp_path, budget_bytes=size * 3)
    bounded.put(NS, key_for(PROV, 9), rand_entry(PROV, T=8))  # first put scans: 5 files > 3
    assert len(list(bounded.keys(NS))) == 2
    assert key_for(PROV, 9) in {k for k in bounded.keys(NS)}
    tiny = DiskStore(tmp_path / "tiny", budget_bytes=16)
    tiny.put(NS, key_for(PROV, 0), rand_entry(PROV))  # larger than the whole budget: not stored
    assert not tiny.contains(NS, key_for(PROV, 0))


def test_prune_command_and_budget_spec(tmp_path: Path) -> None:
    from blend.store.spec import StoreSpecError, open_store, parse_size

    assert parse_size("500M") == 500 << 20 and parse_size("2GiB") == 2 << 30 and parse_size("123") == 123
    for bad in ("", "abc", "0", "-5G", "12Q"):
        with pytest.raises(StoreSpecError):
            parse_size(bad)
    st = open_store(f"disk:{tmp_path}?max_bytes=1G", with_memory=False)
    assert isinstance(st, DiskStore) and st.budget_bytes == 1 << 30 and st.root == tmp_path
    with pytest.raises(StoreSpecError, match="unknown disk option"):
        open_store(f"disk:{tmp_path}?max_byte=1G")
    store = DiskStore(tmp_path)
    for i in range(4):
        store.put(NS, key_for(PROV, i), rand_entry(PROV, T=8))
        _age(store, key_for(PROV, i), 100 - i)
    keep = store.stats().bytes // 2
    code, res = _cli(tmp_path, "prune", "--max-bytes", str(keep))
    assert code == 0 and res[0]["removed"] == 2 and res[0]["kept_bytes"] <= keep
    assert {k for k in store.keys(NS)} == {key_for(PROV, 2), key_for(PROV, 3)}
    code, res = _cli(tmp_path, "prune", "--max-bytes", "1")
    assert res[0]["removed"] == 2 and store.stats().entries == 0


# ---- record logs -------------------------------------------------------------------------------


def test_record_log_rewrite_is_compare_and_swap(tmp_path: Path) -> None:
    store = DiskStore(tmp_path)
    assert store.rewrite_records("donors-x", [], [b"z"]) is False  # no log yet: nothing to swap
    for i in range(4):
        store.append_record("donors-x", b'{"n":%d}' % i)
    lines = store.read_records("donors-x")
    assert store.rewrite_records("donors-x", lines[:3], [b"a"]) is False  # stale view: refused
    assert store.read_records("donors-x") == lines
    assert store.rewrite_records("donors-x", lines, [b"a", b"b"]) is True
    store.append_record("donors-x", b"c")  # appends go to the new file
    assert store.read_records("donors-x") == [b"a", b"b", b"c"]
    with pytest.raises(ValueError):
        store.rewrite_records("donors-x", [b"a", b"b", b"c"], [b"x\ny"])
    assert not [p for p in (tmp_path / "logs").iterdir() if p.name.endswith(".tmp")]
    (tmp_path / "logs" / ".donors-x.jsonl.1.2.tmp").write_bytes(b"a\n")  # left by a crashed rewrite
    store.clear()
    assert not list((tmp_path / "logs").iterdir())


def test_record_log_appends_racing_a_rewrite_are_never_lost(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import threading
    import time

    real_replace = os.replace

    def slow_replace(src: Any, dst: Any, **kw: Any) -> None:  # widen the window between the check and the swap
        time.sleep(0.003)
        real_replace(src, dst, **kw)

    monkeypatch.setattr(os, "replace", slow_replace)
    store = DiskStore(tmp_path)
    store.append_record("donors-x", b"seed")
    per_writer, writers = 150, 3

    def write(w: int) -> None:
        for i in range(per_writer):
            DiskStore(tmp_path).append_record("donors-x", b"w%d-%d" % (w, i))
            time.sleep(0.001)  # paced, so swaps succeed between appends (without the lock, most are lost)

    threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):  # keep compacting (to the same lines) under the writers;
        lines = store.read_records("donors-x")  # a swap refused because of an append is fine
        store.rewrite_records("donors-x", lines, lines)
    for t in threads:
        t.join()
    got = store.read_records("donors-x")
    assert sorted(got) == sorted([b"seed"] + [b"w%d-%d" % (w, i) for w in range(writers) for i in range(per_writer)])
    assert store.rewrite_records("donors-x", got, got[:1]) and store.read_records("donors-x") == got[:1]


def test_an_entry_over_the_low_water_mark_is_not_stored_and_evicts_nothing(tmp_path: Path) -> None:
    """An entry that fits the budget but not its prune's low-water mark would be removed by its
    own put, after every other entry: it is refused up front instead."""
    big = rand_entry(PROV, T=80)
    store = DiskStore(tmp_path, budget_bytes=int(big.nbytes / 0.95))  # big: 95% of the budget
    for i in range(3):
        store.put(NS, key_for(PROV, i), rand_entry(PROV, T=8))
    store.put(NS, key_for(PROV, 9), big)
    assert not store.contains(NS, key_for(PROV, 9))
    assert {k for k in store.keys(NS)} == {key_for(PROV, i) for i in range(3)}
    assert store.stats().evictions == 0


def test_overwrites_and_deletes_do_not_evict_a_store_under_budget(tmp_path: Path) -> None:
    """Re-putting a stored key replaces its file (no bytes added); the tally must not prune then."""
    one = len(encode(NS, key_for(PROV, 0), rand_entry(PROV, T=8)))
    store = DiskStore(tmp_path, budget_bytes=int(one * 4.3))  # 4 entries fit; low water is 3.87
    for i in range(4):
        store.put(NS, key_for(PROV, i), rand_entry(PROV, T=8))
    store.put(NS, key_for(PROV, 0), rand_entry(PROV, T=8))  # an overwrite: still 4 entries
    store.delete(NS, key_for(PROV, 1))
    store.put(NS, key_for(PROV, 1), rand_entry(PROV, T=8))  # back to 4
    assert len(list(store.keys(NS))) == 4 and store.stats().evictions == 0


def test_two_processes_sharing_a_budget_stay_under_it(tmp_path: Path) -> None:
    """Each process's tally sees only its own puts between scans: the folder is recounted at
    least every ``rescan_s``, so processes that started together cannot fill it N times over."""
    one = len(encode(NS, key_for(PROV, 0), rand_entry(PROV, T=8)))
    budget = int(one * 4.5)
    a, b = (DiskStore(tmp_path, budget_bytes=budget, rescan_s=0.0) for _ in range(2))
    a.put(NS, key_for(PROV, 0), rand_entry(PROV, T=8))
    b.put(NS, key_for(PROV, 100), rand_entry(PROV, T=8))  # both have scanned: 2 files
    for i in range(1, 4):
        a.put(NS, key_for(PROV, i), rand_entry(PROV, T=8))
    for i in range(1, 3):
        b.put(NS, key_for(PROV, 100 + i), rand_entry(PROV, T=8))
        assert a.stats().bytes <= budget


def test_an_unremovable_path_does_not_stop_pruning_or_fail_puts(tmp_path: Path) -> None:
    """A directory at an entry's path (it cannot be unlinked) is skipped by a prune, which goes
    on to the next entry; the puts that triggered it succeeded and are counted as puts."""
    one = len(encode(NS, key_for(PROV, 0), rand_entry(PROV, T=8)))
    budget = int(one * 3.5)
    store = DiskStore(tmp_path, budget_bytes=budget)
    stuck = store.path(NS, key_for(PROV, 50))
    stuck.mkdir(parents=True)
    _age_path(stuck, 1000)  # the least recently used "entry"
    for i in range(8):
        store.put(NS, key_for(PROV, i), rand_entry(PROV, T=8))
    stats = store.stats()
    assert stats.puts == 8 and "put_errors" not in stats.extra
    assert stats.bytes <= budget and store.contains(NS, key_for(PROV, 7))


def _age_path(path: Path, seconds_ago: float) -> None:
    import os
    import time

    t = time.time() - seconds_ago
    os.utime(path, (t, t))


def _meta(blob: bytes) -> dict[str, Any]:
    return json.loads(_table(blob)[1]["__metadata__"]["kvblend"])


def test_blobs_are_written_with_xxh3_and_sha256_blobs_of_earlier_builds_still_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hashlib

    from blend.store import codec

    key, entry = key_for(PROV, 0), rand_entry(PROV, T=9)
    new = encode(NS, key, entry)
    assert "xxh3_128" in _meta(new) and "sha256" not in _meta(new)
    monkeypatch.setattr(codec, "WRITE_CHECKSUM", codec.ChecksumKind.SHA256)
    old = encode(NS, key, entry)
    monkeypatch.undo()
    # the sha256 blob is byte for byte what builds before 2026-12-06 wrote: its checksum covers the
    # claims as they serialised them (the "sha256" field empty, keys sorted), then k and v
    meta = _meta(old)
    claims = json.dumps({**meta, "sha256": ""}, sort_keys=True, separators=(",", ":")).encode()
    want = hashlib.sha256(claims + entry.k.numpy().tobytes() + entry.v.numpy().tobytes()).hexdigest()
    assert meta["sha256"] == want and set(meta) == set(_meta(new)) - {"xxh3_128"} | {"sha256"}
    for blob in (new, old):
        got = decode(bytearray(blob), NS, key)
        assert torch.equal(got.k, entry.k) and torch.equal(got.v, entry.v)
        with pytest.raises(EntryError) as err:
            decode(bytearray(_flip_data_byte(blob)), NS, key)
        assert err.value.kind is EntryErrorKind.CHECKSUM
    both = retag(new, meta={"sha256": _meta(old)["sha256"]})
    neither = retag(old, drop=("sha256",))
    assert "sha256" not in _meta(neither) and "xxh3_128" not in _meta(neither)
    swapped = retag(new, meta={"xxh3_128": _meta(old)["sha256"]})  # a sha256 under the other kind's name
    for blob, kind in ((both, EntryErrorKind.BAD_HEADER), (neither, EntryErrorKind.BAD_HEADER),
                       (swapped, EntryErrorKind.CHECKSUM)):
        with pytest.raises(EntryError) as err:
            decode(bytearray(blob), NS, key)
        assert err.value.kind is kind, blob[:200]
    store = DiskStore(tmp_path)
    store.put(NS, key, entry)
    store.path(NS, key_for(PROV, 1)).parent.mkdir(parents=True, exist_ok=True)
    store.path(NS, key_for(PROV, 1)).write_bytes(retag(old, meta={"key": key_for(PROV, 1).hex()}))
    assert store.get(NS, key, PROV.canonical_json()).status is LookupStatus.HIT
    # an old blob re-keyed without re-signing fails its sha256 (the key is one of the claims)
    assert store.get(NS, key_for(PROV, 1), PROV.canonical_json()).status is LookupStatus.REJECTED


def test_record_logs_are_owner_only_like_the_entries(tmp_path: Path) -> None:
    """A donor log holds documents' token ids (they decode back to the text): it was created 0644 under
    umask 022 while the entries are 0600, and a compaction kept that."""
    import os
    import stat

    old = os.umask(0o022)
    try:
        store = DiskStore(tmp_path)
        store.append_record("donors-x", b'{"a":1}')
        path = next(p for p in (tmp_path / "logs").rglob("*") if p.is_file())
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        store.append_record("donors-x", b'{"a":1}')
        assert store.rewrite_records("donors-x", [b'{"a":1}', b'{"a":1}'], [b'{"a":1}'])
        path = next(p for p in (tmp_path / "logs").rglob("*") if p.is_file() and not p.name.startswith("."))
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        os.chmod(path, 0o644)  # a log an earlier version made
        store.append_record("donors-x", b'{"a":2}')
        assert stat.S_IMODE(path.stat().st_mode) == 0o600  # private once written again
    finally:
        os.umask(old)


def test_a_stale_temp_path_that_cannot_be_removed_does_not_stop_the_budget(tmp_path: Path) -> None:
    """The sweep caught only FileNotFoundError: a directory (or another user's file) under a stale temp name
    raised out of every budget scan, so the budget stopped pruning and every put was logged as failed."""
    import os
    import time

    from blend.defaults import DEFAULT_STALE_TEMP_S

    one = len(encode(NS, key_for(PROV, 0), rand_entry(PROV, T=8)))
    store = DiskStore(tmp_path, budget_bytes=one * 3, rescan_s=0.0)
    store.put(NS, key_for(PROV, 0), rand_entry(PROV, T=8))
    odd = store.path(NS, key_for(PROV, 0)).parent / ".leftover.tmp"
    odd.mkdir()
    old = time.time() - DEFAULT_STALE_TEMP_S - 5
    os.utime(odd, (old, old))
    for i in range(1, 8):
        store.put(NS, key_for(PROV, i), rand_entry(PROV, T=8))
    assert store.stats().bytes <= one * 3 and not store.stats().extra.get("put_errors")
    assert store.prune(0).removed > 0 and odd.is_dir()


def test_a_shard_swapped_for_a_link_after_its_listing_is_not_followed_by_prune(tmp_path: Path) -> None:
    """Prune listed a shard's files, then deleted them by full path: a shard folder swapped for a symbolic
    link in between (whoever can write the store can race that) made it delete the link target's files
    of the same names, outside the store."""
    import shutil

    store = DiskStore(tmp_path / "store")
    for i in range(3):
        store.put(NS, key_for(PROV, i), rand_entry(PROV, T=8))
    rows = store._budget.entries_by_age()  # listed ...
    shard = rows[0][2].parent
    victim = tmp_path / "victim"
    victim.mkdir()
    for _, _, path in rows:
        if path.parent == shard:
            (victim / path.name).write_text("precious")
    shutil.rmtree(shard)
    shard.symlink_to(victim, target_is_directory=True)  # ... then swapped
    store._budget.prune_rows(rows, 0)
    assert all(f.read_text() == "precious" for f in victim.iterdir()) and any(victim.iterdir())
    # delete checks the folder first: the swap lands after that check
    store._leads_inside = lambda folder: True
    assert store.delete(NS, next(k for k in (key_for(PROV, i) for i in range(3))
                                 if store.path(NS, k).parent == shard)) is False
    assert all(f.read_text() == "precious" for f in victim.iterdir())


def test_unlink_beneath_refuses_a_linked_folder_and_a_path_outside(tmp_path: Path) -> None:
    from blend import safeio

    (tmp_path / "root" / "a").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "f").write_text("keep")
    (tmp_path / "root" / "link").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with pytest.raises(safeio.UnsafeFileError):
        safeio.unlink_beneath(tmp_path / "root", tmp_path / "root" / "link" / "f")
    with pytest.raises(safeio.UnsafeFileError):
        safeio.unlink_beneath(tmp_path / "root", tmp_path / "elsewhere" / "f")
    assert (tmp_path / "elsewhere" / "f").read_text() == "keep"
    (tmp_path / "root" / "a" / "g").write_text("x")
    safeio.unlink_beneath(tmp_path / "root", tmp_path / "root" / "a" / "g")
    assert not (tmp_path / "root" / "a" / "g").exists()
    with pytest.raises(FileNotFoundError):
        safeio.unlink_beneath(tmp_path / "root", tmp_path / "root" / "a" / "g")


def test_a_shard_folder_swapped_for_a_link_while_a_put_writes_never_sends_the_entry_outside(tmp_path, monkeypatch):
    """A put checked that the entry's folder resolved inside the store, then created its temp file and
    renamed it into that folder by path: whoever can write the store could swap the folder for a link in
    between and have the write land in any folder (it did). Now the folders are opened without following
    links and the file is created and renamed through the folder's descriptor."""
    import os

    store = DiskStore(tmp_path / "store")
    outside = tmp_path / "outside"
    outside.mkdir()
    prov = make_prov()
    key = key_for(prov, 1)
    dest = store.path(NS, key)
    dest.parent.mkdir(parents=True)
    real_open = os.open
    swapped = []

    def open_then_swap(path, flags, *args, **kw):  # the moment a temp file is created: after any check
        if str(path).endswith(".tmp") and flags & os.O_CREAT and not swapped:
            os.rename(dest.parent, dest.parent.with_name("moved"))
            os.symlink(outside, dest.parent)
            swapped.append(True)
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(os, "open", open_then_swap)
    store.put(NS, key, rand_entry(prov))
    monkeypatch.setattr(os, "open", real_open)
    assert swapped and list(outside.iterdir()) == []  # nothing written through the link
    assert [p.name for p in dest.parent.with_name("moved").iterdir()] == [dest.name]  # where the folder went

    other = next(k for k in (key_for(prov, i) for i in range(2, 400)) if store.path(NS, k).parent != dest.parent)
    store.path(NS, other).parent.symlink_to(outside)  # a folder that is a link from the start: refused as well
    store.put(NS, other, rand_entry(prov))
    assert list(outside.iterdir()) == [] and store.get(NS, other, prov.canonical_json()).status is not LookupStatus.HIT


def test_processes_sharing_a_budgeted_folder_see_each_others_puts(tmp_path: Path) -> None:
    """Each process counted only its own puts between scans (every 10 s), so two writers sharing one folder
    each filled the budget: 1.7x it on disk. One shared tally of every process's puts keeps the folder
    within the budget after every put."""
    one = len(encode(NS, key_for(PROV, 0), rand_entry(PROV, T=8)))
    budget = int(one * 6.5)
    a, b = (DiskStore(tmp_path, budget_bytes=budget, rescan_s=3600.0) for _ in range(2))  # two processes
    for i in range(40):
        (a if i % 2 else b).put(NS, key_for(PROV, i), rand_entry(PROV, T=8))
        on_disk = sum(p.stat().st_size for p in tmp_path.rglob("*.safetensors"))
        assert on_disk <= budget, (i, on_disk / budget)
    assert len(list(a.keys(NS))) >= 4  # pruned down to the low-water mark, not emptied


def test_a_store_that_cannot_be_written_warns_once_per_cause(tmp_path: Path, caplog) -> None:
    """An unwritable store printed one warning per chunk: thousands of lines for a corpus."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    store = DiskStore(blocker / "store")  # under a file: every write fails the same way
    with caplog.at_level(logging.WARNING, logger="blend.store.disk"):
        for i in range(20):
            store.put(NS, key_for(PROV, i), rand_entry(PROV, T=4))
    assert len([r for r in caplog.records if "write of" in r.getMessage()]) == 1
    assert store.stats().extra["put_errors"] == 20


def test_verify_of_a_store_path_that_does_not_exist_is_not_clean(tmp_path: Path, capsys) -> None:
    """`store verify --store disk:/typo` said "checked 0 entries, found 0 corrupt" and exited 0."""
    parser = argparse.ArgumentParser()
    add_store_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["store", "verify", "--store", f"disk:{tmp_path / 'typo'}"])
    assert run_store_command(args, io.StringIO()) == 2
    assert "no disk store at" in capsys.readouterr().err
    DiskStore(tmp_path / "real").put(NS, key_for(PROV, 0), rand_entry(PROV))
    assert _cli(tmp_path / "real", "verify")[0] == 0  # an existing store verifies as before
