"""Hostile bytes at an entry's place, on disk and in Redis: every case is a rejected
lookup (a miss that is never used), never a traceback, a hang or an unbounded read;
``store verify`` names it and ``--delete`` removes it; an unreachable tier is never
reported clean."""

from __future__ import annotations

import argparse
import io
import json
import os
import struct
import subprocess
import sys
import threading
import tracemalloc
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from blend.store.base import LookupStatus
from blend.store.cli import add_store_commands, run_store_command
from blend.store.codec import EntryError, decode, decode_header, encode
from blend.store.disk import DiskStore
from blend.store.redis_store import RedisStore
from blend.store.spec import StoreSpecError, TierKind, parse_store_spec
from conftest import make_docs
from _store_util import NS, RedisServer, free_port, key_for, make_prov, rand_entry, redis_url_for_tests, unique_prefix

PROV = make_prov()
J = PROV.canonical_json()
HANG_S = 10.0  # a lookup that has not returned by then is hung


def _header(blob: bytes) -> tuple[dict[str, Any], bytes]:
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def _with_header(table: Any, data: bytes) -> bytes:
    hj = json.dumps(table).encode()
    hj += b" " * (-len(hj) % 8)
    return struct.pack("<Q", len(hj)) + hj + data


def _set_tensor_field(name: str, field: str, value: Any) -> Callable[[bytes], bytes]:
    def tamper(blob: bytes) -> bytes:
        table, data = _header(blob)
        table[name][field] = value
        return _with_header(table, data)

    return tamper


def _set_meta_field(field: str, value: Any) -> Callable[[bytes], bytes]:
    def tamper(blob: bytes) -> bytes:
        table, data = _header(blob)
        meta = json.loads(table["__metadata__"]["kvblend"])
        meta[field] = value
        table["__metadata__"]["kvblend"] = json.dumps(meta)
        return _with_header(table, data)

    return tamper


def _flip_bit_of(needle: bytes, bit: int = 0) -> Callable[[bytes], bytes]:
    """One bit flipped in the first byte of ``needle`` inside the header (JSON stays valid)."""

    def tamper(blob: bytes) -> bytes:
        at = blob.index(needle, 8)
        out = bytearray(blob)
        out[at] ^= 1 << bit
        return bytes(out)

    return tamper


# Header damage that keeps valid JSON but breaks its structure (issue 15, failure 1).
STRUCTURE_BREAKS: dict[str, Callable[[bytes], bytes]] = {
    "bit_flip_in_data_offsets_key": _flip_bit_of(b"data_offsets"),  # "eata_offsets": the key is gone
    "tensor_shape_is_a_number": _set_tensor_field("k", "shape", 5),
    "data_offsets_is_a_number": _set_tensor_field("v", "data_offsets", 7),
    "data_offsets_of_strings": _set_tensor_field("k", "data_offsets", ["0", "x"]),
    "tensor_entry_is_a_list": _set_tensor_field("k", "dtype", ["F32"]),
    "kvblend_shape_is_a_number": _set_meta_field("shape", 5),
    "kvblend_shape_is_infinite": _set_meta_field("shape", [2, 3, float("inf"), 8]),
    "kvblend_shape_of_booleans": _set_meta_field("shape", [True, True, True, True]),
    "kvblend_key_is_a_number": _set_meta_field("key", 12345),
    "kvblend_provenance_is_an_object": _set_meta_field("provenance", {"kv_dtype": "float32"}),
    "kvblend_dtype_is_a_list": _set_meta_field("dtype", ["float32"]),
    "metadata_is_a_list": lambda b: _with_header({**_header(b)[0], "__metadata__": ["kvblend"]}, _header(b)[1]),
    "header_is_deeply_nested": lambda b: struct.pack("<Q", 200_000) + b"[" * 100_000 + b"]" * 100_000,
}


def _cli(spec: str, *argv: str) -> tuple[int, Any, str]:
    parser = argparse.ArgumentParser()
    add_store_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["store", argv[0], "--store", spec, "--json", *argv[1:]])
    out = io.StringIO()
    code = run_store_command(args, out)
    text = out.getvalue()
    try:
        return code, json.loads(text), text
    except ValueError:
        return code, None, text


def _within(seconds: float, fn: Callable[[], Any], unblock: Path | None = None) -> Any:
    """Run ``fn`` in a thread; fail if it has not returned after ``seconds``.

    A reader blocked on a FIFO is released afterwards (a writer opens and closes it),
    so a failing test does not leave a thread hung forever.
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    hung = t.is_alive()
    if hung and unblock is not None:
        try:
            os.close(os.open(unblock, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
        t.join(5)
    assert not hung, f"still running after {seconds} s (hung)"
    if "error" in box:
        raise box["error"]
    return box["value"]


# ---- the decoder: one error type for any bytes ------------------------------------------------


@pytest.mark.parametrize("case", sorted(STRUCTURE_BREAKS))
def test_header_structure_break_raises_only_entry_error(case: str) -> None:
    key = key_for(PROV, 0)
    blob = STRUCTURE_BREAKS[case](encode(NS, key, rand_entry(PROV)))
    with pytest.raises(EntryError):
        decode(bytearray(blob), NS, key)
    with pytest.raises(EntryError):
        decode_header(blob)


# ---- disk tier ------------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(STRUCTURE_BREAKS))
def test_disk_structure_break_is_rejected_verified_and_deleted(tmp_path: Path, case: str) -> None:
    store = DiskStore(tmp_path)
    key, good = key_for(PROV, 0), key_for(PROV, 1)
    store.put(NS, key, rand_entry(PROV))
    store.put(NS, good, rand_entry(PROV, seed=1))
    path = store.path(NS, key)
    path.write_bytes(STRUCTURE_BREAKS[case](path.read_bytes()))

    got = store.get(NS, key, J)
    assert got.status is LookupStatus.REJECTED and got.entry is None and got.reason
    assert store.get(NS, good, J).status is LookupStatus.HIT
    code, rows, _ = _cli(f"disk:{tmp_path}", "ls")
    assert code == 0 and [r["key"] for r in rows if "error" in r] == [key.hex()]
    code, report, _ = _cli(f"disk:{tmp_path}", "verify")
    assert code == 1 and report["checked"] == 2 and [c["key"] for c in report["corrupt"]] == [key.hex()]
    code, report, _ = _cli(f"disk:{tmp_path}", "verify", "--delete")
    assert code == 0 and not path.exists() and store.contains(NS, good)
    assert _cli(f"disk:{tmp_path}", "verify")[:2] == (0, {"checked": 1, "corrupt": [], "deleted": False,
                                                           "unreachable": []})


def _peak_bytes(fn: Callable[[], Any]) -> tuple[Any, int]:
    tracemalloc.start()
    try:
        value = fn()
        return value, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_disk_terabyte_sparse_entry_is_rejected_without_reading_it(tmp_path: Path) -> None:
    store = DiskStore(tmp_path)
    key, zeros = key_for(PROV, 0), key_for(PROV, 1)
    store.put(NS, key, rand_entry(PROV))
    os.truncate(store.path(NS, key), 1 << 40)  # valid header, then a terabyte of holes
    store.put(NS, zeros, rand_entry(PROV))
    with open(store.path(NS, zeros), "r+b") as f:  # `truncate -s 1T` over an empty file: all zeros
        f.truncate(0)
        f.truncate(1 << 40)
    for k in (key, zeros):
        got, peak = _peak_bytes(lambda k=k: store.get(NS, k, J))
        assert got.status is LookupStatus.REJECTED, got
        assert peak < 4 << 20, f"a rejected lookup allocated {peak} bytes"
    (code, report, _), peak = _peak_bytes(lambda: _cli(f"disk:{tmp_path}", "verify", "--delete"))
    assert code == 0 and len(report["corrupt"]) == 2 and peak < 4 << 20
    assert not store.path(NS, key).exists() and not store.path(NS, zeros).exists()


def test_disk_header_claiming_more_than_the_cap_is_rejected_before_allocation(tmp_path: Path) -> None:
    cap = 1 << 20
    store = DiskStore(tmp_path, max_entry_bytes=cap)
    key = key_for(PROV, 0)
    big = rand_entry(PROV, T=2048, L=2, H=2, D=64)  # 4 MiB of tensors: a valid entry over the cap
    path = store.path(NS, key)
    path.parent.mkdir(parents=True)
    path.write_bytes(encode(NS, key, big))
    got, peak = _peak_bytes(lambda: store.get(NS, key, J))
    assert got.status is LookupStatus.REJECTED and "cap" in got.reason
    assert peak < cap
    assert DiskStore(tmp_path).get(NS, key, J).status is LookupStatus.HIT  # the default cap admits it


def test_disk_put_over_the_cap_is_not_stored(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, max_entry_bytes=1 << 16)
    store.put(NS, key_for(PROV, 0), rand_entry(PROV, T=2048))
    assert not store.contains(NS, key_for(PROV, 0))


@pytest.mark.parametrize("where", ["entry", "log"])
def test_disk_fifo_is_never_opened_for_reading(tmp_path: Path, where: str) -> None:
    store = DiskStore(tmp_path)
    key = key_for(PROV, 0)
    store.put(NS, key, rand_entry(PROV))
    if where == "log":
        store.append_record("donors", b'{"x":1}')
        fifo = tmp_path / "logs" / "donors.jsonl"
        fifo.unlink()
        os.mkfifo(fifo)
        assert _within(HANG_S, lambda: store.read_records("donors"), unblock=fifo) == []
        _within(HANG_S, lambda: store.append_record("donors", b'{"y":2}'), unblock=fifo)
        assert _within(HANG_S, lambda: store.rewrite_records("donors", [], [b"z"]), unblock=fifo) is False
        return
    fifo = store.path(NS, key)
    fifo.unlink()
    os.mkfifo(fifo)
    got = _within(HANG_S, lambda: store.get(NS, key, J), unblock=fifo)
    assert got.status is LookupStatus.REJECTED and "regular file" in got.reason
    code, rows, _ = _within(HANG_S, lambda: _cli(f"disk:{tmp_path}", "ls"), unblock=fifo)
    assert code == 0 and "regular file" in rows[0]["error"]
    code, report, _ = _within(HANG_S, lambda: _cli(f"disk:{tmp_path}", "verify"), unblock=fifo)
    assert code == 1 and "regular file" in report["corrupt"][0]["reason"]
    code, _, _ = _within(HANG_S, lambda: _cli(f"disk:{tmp_path}", "verify", "--delete"), unblock=fifo)
    assert code == 0 and not os.path.lexists(fifo)


def test_disk_symlinked_entry_is_rejected_not_followed(tmp_path: Path) -> None:
    outside = DiskStore(tmp_path / "elsewhere")
    key = key_for(PROV, 0)
    outside.put(NS, key, rand_entry(PROV))  # a perfectly valid entry, outside the store
    store = DiskStore(tmp_path / "store")
    link = store.path(NS, key)
    link.parent.mkdir(parents=True)
    link.symlink_to(outside.path(NS, key))
    got = store.get(NS, key, J)
    assert got.status is LookupStatus.REJECTED and "regular file" in got.reason
    code, report, _ = _cli(f"disk:{tmp_path / 'store'}", "verify", "--delete")
    assert code == 0 and len(report["corrupt"]) == 1
    assert not os.path.lexists(link) and outside.path(NS, key).exists()  # the link went, not its target


def test_disk_symlinked_folder_is_never_written_through_listed_or_cleared(tmp_path: Path) -> None:
    # root/<ns>/<xx> is a link to a folder that is not the store's: puts refuse it, and listing, pruning,
    # clearing and deleting never reach the files over there (clear used to unlink them)
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / ("0" * 64 + ".safetensors")
    victim.write_bytes(b"not the store's")
    store = DiskStore(tmp_path / "store", budget_bytes=10**9)
    key = key_for(PROV, 0)
    store.path(NS, key).parent.parent.mkdir(parents=True)
    store.path(NS, key).parent.symlink_to(outside)
    store.put(NS, key, rand_entry(PROV))
    assert sorted(p.name for p in outside.iterdir()) == [victim.name]  # nothing written over there
    assert store.stats().extra["put_errors"] == 1 and store.get(NS, key, J).status is LookupStatus.REJECTED
    assert store.stats().entries == 0 and list(store.keys(NS)) == []
    assert store.prune(0).removed == 0 and store.clear() == 0 and not store.delete(NS, key)
    (outside / ".x.tmp").write_bytes(b"")
    assert store.sweep_temp(0.0) == 0 and victim.exists()


def test_disk_directory_at_entry_path_is_reported_not_a_crash(tmp_path: Path) -> None:
    store = DiskStore(tmp_path)
    key = key_for(PROV, 0)
    store.path(NS, key).mkdir(parents=True)
    assert store.get(NS, key, J).status is LookupStatus.REJECTED
    code, report, _ = _cli(f"disk:{tmp_path}", "verify", "--delete")
    assert code == 1 and len(report["corrupt"]) == 1 and report["undeleted"] == [key.hex()]


def test_disk_store_root_that_is_a_file_is_unreachable(tmp_path: Path) -> None:
    (tmp_path / "store").write_text("not a directory")
    code, report, _ = _cli(f"disk:{tmp_path / 'store'}", "verify")
    assert code == 3 and report["unreachable"] == ["disk"]


# ---- Redis tier -----------------------------------------------------------------------------


@pytest.fixture
def rstore(redis_url: str) -> Iterator[RedisStore]:
    s = RedisStore(redis_url, prefix=unique_prefix())
    yield s
    s.clear()
    s.close()


@pytest.mark.parametrize("case", sorted(STRUCTURE_BREAKS))
def test_redis_structure_break_is_rejected_verified_and_deleted(rstore: RedisStore, case: str) -> None:
    key, good = key_for(PROV, 0), key_for(PROV, 1)
    rstore.put_raw(NS, key, STRUCTURE_BREAKS[case](encode(NS, key, rand_entry(PROV))))
    rstore.put(NS, good, rand_entry(PROV, seed=1))
    got = rstore.get(NS, key, J)
    assert got.status is LookupStatus.REJECTED and got.entry is None and got.reason
    spec = f"{rstore.url}?prefix={rstore.prefix}"
    code, rows, _ = _cli(spec, "ls")
    assert code == 0 and [r["key"] for r in rows if "error" in r] == [key.hex()]
    code, report, _ = _cli(spec, "verify")
    assert code == 1 and report["checked"] == 2 and [c["key"] for c in report["corrupt"]] == [key.hex()]
    code, _, _ = _cli(spec, "verify", "--delete")
    assert code == 0 and not rstore.contains(NS, key) and rstore.contains(NS, good)


def test_redis_value_claiming_more_than_the_cap_is_rejected_before_fetching_it(redis_url: str) -> None:
    cap = 1 << 20
    store = RedisStore(redis_url, prefix=unique_prefix(), max_entry_bytes=cap)
    try:
        key = key_for(PROV, 0)
        store.put_raw(NS, key, encode(NS, key, rand_entry(PROV, T=2048, L=2, H=2, D=64)))  # 4 MiB
        got, peak = _peak_bytes(lambda: store.get(NS, key, J))
        assert got.status is LookupStatus.REJECTED and "cap" in got.reason
        assert peak < cap
        blob = encode(NS, key, rand_entry(PROV))
        store.put_raw(NS, key, blob + b"\0" * (2 * cap))  # a small header claim, a big value
        got, peak = _peak_bytes(lambda: store.get(NS, key, J))
        assert got.status is LookupStatus.REJECTED and peak < cap
    finally:
        store.clear()
        store.close()


def test_verify_against_unreachable_redis_is_not_clean() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    code, report, _ = _cli(url, "verify")
    assert code == 3 and report["unreachable"] == ["redis"]
    parser = argparse.ArgumentParser()
    add_store_commands(parser.add_subparsers(dest="command"))
    out = io.StringIO()
    code = run_store_command(parser.parse_args(["store", "verify", "--store", url]), out)
    assert code == 3 and "unreachable" in out.getvalue() and "redis" in out.getvalue()


@pytest.mark.parametrize("command", ["ls", "stats", "clear"])
def test_ls_stats_clear_name_an_unreachable_tier_and_exit_3(
        command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    parser = argparse.ArgumentParser()
    add_store_commands(parser.add_subparsers(dest="command"))
    out = io.StringIO()
    spec = f"disk:{tmp_path / 'kv'},{url}"  # the disk tier answers, Redis does not
    code = run_store_command(parser.parse_args(["store", command, "--store", spec]), out)
    err = capsys.readouterr().err
    assert code == 3
    assert "tier redis unreachable" in err and "disk" not in err.split("unreachable")[0]
    ok = run_store_command(parser.parse_args(["store", command, "--store", f"disk:{tmp_path / 'kv'}"]), io.StringIO())
    assert ok == 0


def test_verify_when_redis_dies_mid_scan_is_not_clean(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    server = RedisServer(free_port())
    server.start()
    try:
        store = RedisStore(server.url, prefix=unique_prefix())
        for i in range(3):
            store.put(NS, key_for(PROV, i), rand_entry(PROV, seed=i))
        real_verify = RedisStore.verify

        def verify_then_die(self: RedisStore, ns: Any, key: Any) -> str:
            server.stop()
            return real_verify(self, ns, key)

        monkeypatch.setattr(RedisStore, "verify", verify_then_die)
        code, report, _ = _cli(server.url + f"?prefix={store.prefix}", "verify")
        assert code == 3 and report["unreachable"] == ["redis"]
    finally:
        server.stop()


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/abc", "redis://127.0.0.1:6379/0/1",
                                 "redis://127.0.0.1:6379/-1", "redis://127.0.0.1:6379/0?db=x",
                                 "unix:///tmp/redis.sock?db=abc"])
def test_redis_url_with_a_bad_database_is_an_error(url: str) -> None:
    with pytest.raises(StoreSpecError, match="database"):
        parse_store_spec(url)


@pytest.mark.parametrize("url, db", [("redis://127.0.0.1:6379/3", 3), ("redis://127.0.0.1:6379", 0),
                                     ("redis://h:1/", 0), ("unix:///tmp/redis.sock?db=2", 2),
                                     ("redis://h:1/5?prefix=p&ttl=9", 5), ("unix:///tmp/r.sock?prefix=p&db=7", 7)])
def test_redis_url_with_a_good_database_is_accepted(url: str, db: int) -> None:
    from redis.connection import parse_url  # how the Redis tier's client reads its location

    (tier,) = parse_store_spec(url)
    assert tier.kind is TierKind.REDIS
    assert parse_url(tier.location).get("db", 0) == db  # redis-py's default database is 0
    assert "prefix" not in tier.location and "ttl" not in tier.location  # kvblend's own options are taken out


# ---- end to end: `kvblend ask` and `kvblend store verify` over planted faults ----------------


def _kvblend(home: Path, *args: str) -> "subprocess.CompletedProcess[str]":
    env = {k: os.environ[k] for k in ("PATH", "HOME", "TRITON_INTERPRET") if k in os.environ}
    env.update(KVBLEND_HOME=str(home), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "blend.cli", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_cli_ask_and_verify_over_a_header_break_a_terabyte_file_and_a_fifo(tmp_path: Path) -> None:
    docs = []
    for i, text in enumerate(make_docs(3, words=25)):
        docs += ["--doc", str(tmp_path / f"doc{i}.txt")]
        (tmp_path / f"doc{i}.txt").write_text(text)
    store = tmp_path / "store"
    ask = ["ask", "Which word?", "--model", "tiny-llama", "--json", "--max-new-tokens", "4", *docs,
           "--store", f"disk:{store}", "--reuse", "exact"]
    cold = _kvblend(tmp_path, *ask)
    assert cold.returncode == 0, cold.stderr
    files = sorted(store.glob("exact/??/*.safetensors"))
    assert len(files) >= 3
    files[0].write_bytes(STRUCTURE_BREAKS["bit_flip_in_data_offsets_key"](files[0].read_bytes()))
    os.truncate(files[1], 1 << 40)
    files[2].unlink()
    os.mkfifo(files[2])

    verify = _within(60, lambda: _kvblend(tmp_path, "store", "verify", "--store", f"disk:{store}"), unblock=files[2])
    assert verify.returncode == 1 and verify.stdout.count("CORRUPT") == 3 and "Traceback" not in verify.stderr

    warm = _within(120, lambda: _kvblend(tmp_path, *ask), unblock=files[2])
    assert warm.returncode == 0 and "Traceback" not in warm.stderr, warm.stderr
    a, b = json.loads(cold.stdout), json.loads(warm.stdout)
    assert b["logits_sha256"] == a["logits_sha256"]  # a rejected entry is recomputed, never used
    assert [s["class"] for s in b["report"]["segments"]].count("rejected") == 3
    healed = _kvblend(tmp_path, "store", "verify", "--store", f"disk:{store}")  # recomputed KV replaced them
    assert healed.returncode == 0 and "found 0 corrupt" in healed.stdout


def test_cli_ask_with_an_unreachable_redis_tier_computes_and_warns(tmp_path: Path) -> None:
    (tmp_path / "doc.txt").write_text(make_docs(1, words=25)[0])
    ask = ["ask", "Which word?", "--model", "tiny-llama", "--json", "--max-new-tokens", "4",
           "--doc", str(tmp_path / "doc.txt"), "--reuse", "exact", "--store"]
    ref = _kvblend(tmp_path, *ask, "memory")
    down = _kvblend(tmp_path, *ask, f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    assert ref.returncode == 0 and down.returncode == 0, down.stderr
    assert json.loads(down.stdout)["logits_sha256"] == json.loads(ref.stdout)["logits_sha256"]
    warnings = [ln for ln in down.stderr.splitlines() if "unreachable" in ln]
    assert len(warnings) == 1 and "Traceback" not in down.stderr, down.stderr


def test_disk_contains_on_an_unreadable_folder_is_a_miss_not_an_error(tmp_path: Path, monkeypatch) -> None:
    # contains is on the request path (single-flight claims, precompute): EACCES or EIO there must not fail a request
    store = DiskStore(tmp_path)

    def unreadable(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "is_file", unreadable)
    assert store.contains(NS, key_for(PROV, 0)) is False


def test_a_symlinked_logs_folder_is_never_written_read_or_cleared(tmp_path: Path) -> None:
    """The entry folders were checked for links out of the store; ``logs`` was not: ``clear`` deleted
    every file of the folder it pointed at, and appends wrote there."""
    outside = tmp_path / "home"
    outside.mkdir()
    (outside / "thesis.tex").write_text("mine")
    (outside / "donors-x.jsonl").write_text('{"a": 1}\n')
    store = DiskStore(tmp_path / "store", fsync=False)
    (tmp_path / "store").mkdir(exist_ok=True)
    (tmp_path / "store" / "logs").symlink_to(outside)
    store.append_record("donors-x", b'{"b": 2}')
    assert store.read_records("donors-x") == []
    assert not store.rewrite_records("donors-x", [b'{"a": 1}'], [])
    store.clear()
    assert sorted(p.name for p in outside.iterdir()) == ["donors-x.jsonl", "thesis.tex"]
    assert (outside / "donors-x.jsonl").read_text() == '{"a": 1}\n'


def test_store_ls_escapes_a_stored_model_name(tmp_path: Path) -> None:
    """The listing prints a field of the stored bytes: a lone surrogate crashed it (UnicodeEncodeError),
    and escape sequences went to the terminal as they were."""
    import torch

    from blend.keys import Namespace, StoreKey
    from blend.kvcache import KVEntry
    store = DiskStore(tmp_path / "s", fsync=False)
    k = torch.zeros(1, 1, 1, 2)
    for i, arch in enumerate(["\ud800", "\x1b]0;pwned\x07\x1b[31mRED", "LlamaForCausalLM"]):
        store.put(Namespace.CANONICAL, StoreKey(bytes([i + 1]) * 32), KVEntry(k, k.clone(), json.dumps({"model_arch": arch})))
    parser = argparse.ArgumentParser()
    add_store_commands(parser.add_subparsers(dest="command"))
    out = io.StringIO()
    assert run_store_command(parser.parse_args(["store", "ls", "--store", f"disk:{tmp_path / 's'}"]), out) == 0
    text = out.getvalue()
    text.encode("utf-8")  # no lone surrogate
    assert "\x1b" not in text and "\\ud800" in text and "\\x1b" in text and "LlamaForCausalLM" in text


def test_verify_delete_sweeps_temp_files_as_stale_as_prune_does(tmp_path: Path) -> None:
    """`store verify --delete` kept killed writers' temp files for an hour (its own default) where the budget
    scan and `store prune` remove them after DEFAULT_STALE_TEMP_S; a write in progress is kept by both."""
    from blend.defaults import DEFAULT_STALE_TEMP_S

    store = DiskStore(tmp_path)
    key = key_for(PROV, 0)
    store.put(NS, key, rand_entry(PROV))
    folder = store.path(NS, key).parent
    stale, live = folder / f".{key.hex()}.dead.tmp", folder / f".{key.hex()}.live.tmp"
    stale.write_bytes(b"half an entry")
    live.write_bytes(b"a write in progress")
    old = stale.stat().st_mtime - DEFAULT_STALE_TEMP_S - 60
    os.utime(stale, (old, old))
    code, report, _ = _cli(f"disk:{tmp_path}", "verify", "--delete")
    assert code == 0 and report["checked"] == 1
    assert not stale.exists() and live.exists()
