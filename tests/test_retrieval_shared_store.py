"""Indexes over one store: one index's collection keeps the chunk KV another still references (it
deleted it, so the other's next query recomputed), until no live index references it; an index folder
deleted without a collection pins nothing."""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import pytest

from blend.engine import Engine
from blend.keys import Namespace
from blend.prompt import preamble_segment
from blend.retrieval.catalog import Catalog
from blend.retrieval.chunker import ChunkerConfig
from blend.retrieval.engine_kv import canonical_chunk_key, engine_kv_sync
from blend.retrieval.ingest import ingest
from blend.retrieval.ingest_options import IngestOptions
from blend.retrieval.kv_intent import INTENT_FILE
from blend.retrieval.registry import REGISTRY_LOG, IndexRegistry
from blend.retrieval.testing import HashEmbedder
from blend.store.disk import DiskStore
from blend.store.memory import MemoryStore
from blend.store.tiered import TieredStore

SHARED = "The bell tower has nine bells. They ring at noon."
OWN_A = "The ferry is named Marigold. It sails twice a day."
OWN_B = "The pump lifts water eighteen metres."
OPTIONS = IngestOptions(config=ChunkerConfig(target_tokens=64), stream=io.StringIO())


@pytest.fixture()
def engine(tmp_path: Path) -> Engine:
    store = TieredStore([MemoryStore(), DiskStore(tmp_path / "store", fsync=False)], write_behind=False)
    return Engine.load("tiny-llama", store=store, quality_gate=False)


def corpus(root: Path, **files: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (root / f"{name}.txt").write_text(text)
    return root


def run(engine: Engine, docs: Path, index: Path, system: str | None = None):
    return ingest([docs], index, tokenizer=engine.tokenizer, tokenizer_fp=engine.provenance.tokenizer_sha256,
                  embedder=HashEmbedder(), kv=engine_kv_sync(engine, system), options=OPTIONS)


def stored(engine: Engine, text: str, system: str | None = None) -> bool:
    key = canonical_chunk_key(engine, preamble_segment(engine.tokenizer, system), text)
    return engine.store.contains(Namespace.CANONICAL, key)


def test_a_chunk_another_index_references_keeps_its_kv_until_that_index_is_deleted(engine, tmp_path):
    docs_a = corpus(tmp_path / "docs-a", shared=SHARED, own=OWN_A)
    docs_b = corpus(tmp_path / "docs-b", shared=SHARED, own=OWN_B)
    run(engine, docs_a, tmp_path / "idx-a")
    run(engine, docs_b, tmp_path / "idx-b")
    assert stored(engine, SHARED)
    (docs_a / "shared.txt").unlink()
    s = run(engine, docs_a, tmp_path / "idx-a")  # A drops the chunk; B still holds it
    assert s.chunks_removed == 1 and s.gc_collected == 0 and s.gc_pending == 1
    assert stored(engine, SHARED)  # A's collection deleted it: B's next query recomputed it
    assert stored(engine, OWN_A) and stored(engine, OWN_B)
    shutil.rmtree(tmp_path / "idx-b")  # B deleted without a collection: it references nothing any more
    s = run(engine, docs_a, tmp_path / "idx-a")
    assert (s.gc_collected, s.gc_pending) == (1, 0) and not stored(engine, SHARED)
    assert not Catalog.open(tmp_path / "idx-a").pending_gc


def test_the_last_index_to_drop_a_shared_chunk_deletes_its_kv(engine, tmp_path):
    docs_a = corpus(tmp_path / "docs-a", shared=SHARED, own=OWN_A)
    docs_b = corpus(tmp_path / "docs-b", shared=SHARED, own=OWN_B)
    run(engine, docs_a, tmp_path / "idx-a")
    run(engine, docs_b, tmp_path / "idx-b")
    (docs_a / "shared.txt").unlink()
    run(engine, docs_a, tmp_path / "idx-a")
    assert stored(engine, SHARED)
    (docs_b / "shared.txt").unlink()
    s = run(engine, docs_b, tmp_path / "idx-b")  # B drops it too: A holds it only as pending, no reference
    assert s.gc_collected == 1 and not stored(engine, SHARED)
    s = run(engine, docs_a, tmp_path / "idx-a")  # A's pending chunk: already gone, forgotten
    assert (s.gc_collected, s.gc_pending) == (1, 0)


def test_an_index_under_another_system_prompt_references_other_keys(engine, tmp_path):
    docs_a = corpus(tmp_path / "docs-a", shared=SHARED, own=OWN_A)
    docs_b = corpus(tmp_path / "docs-b", shared=SHARED, own=OWN_B)
    run(engine, docs_a, tmp_path / "idx-a")
    run(engine, docs_b, tmp_path / "idx-b", system="Answer in French.")  # B's KV is keyed under its preamble
    (docs_a / "shared.txt").unlink()
    s = run(engine, docs_a, tmp_path / "idx-a")
    assert s.gc_collected == 1 and not stored(engine, SHARED)  # A's key: nobody else's
    assert stored(engine, SHARED, system="Answer in French.")


def test_the_registry_drops_a_folder_gone_for_longer_than_the_stale_time(tmp_path):
    disk = DiskStore(tmp_path / "store", fsync=False)
    now = [1000.0]
    reg = IndexRegistry([MemoryStore(), disk], stale_s=100.0, clock=lambda: now[0])
    live, gone = tmp_path / "live", tmp_path / "gone"
    live.mkdir()
    gone.mkdir()
    reg.register(live)
    reg.register(gone)
    reg.register(live)  # each run appends a line: the registry keeps the latest per folder
    gone.rmdir()
    assert [r.root for r in reg.registered()] == [str(gone), str(live)]  # gone, but registered recently
    now[0] += 101
    assert [r.root for r in reg.registered()] == [str(live)]  # a visible folder never goes stale
    assert len(disk.read_records(REGISTRY_LOG)) == 1  # compacted: the stale line and the duplicate left
    disk.append_record(REGISTRY_LOG, b"not json")
    disk.append_record(REGISTRY_LOG, b'{"root": "relative/path", "seen": 1}')
    assert [r.root for r in reg.registered()] == [str(live)]


def test_the_registry_lives_in_a_redis_tier_too(redis_url, tmp_path):
    from _store_util import unique_prefix
    from blend.store.redis_store import RedisStore

    redis = RedisStore(redis_url, prefix=unique_prefix())
    try:
        a, b = tmp_path / "a", tmp_path / "b"
        a.mkdir()
        b.mkdir()
        IndexRegistry([redis]).register(a)
        IndexRegistry([redis]).register(b)  # another process over the same server
        assert [r.root for r in IndexRegistry([redis]).registered()] == [str(a), str(b)]
    finally:
        redis.clear()


def _chunk_table(index: Path) -> Path:
    return index / (index / "CURRENT").read_text().strip() / "chunks.jsonl"


@pytest.mark.parametrize("damage", ["garbage", "fifo", "link"])
def test_another_index_whose_files_cannot_be_read_keeps_the_kv(engine, tmp_path, damage):
    # a damaged index referenced nothing: A's collection deleted the KV of a chunk B still holds (fail safe:
    # what an index that cannot be read references is unknown, so its KV stays until it is read or deleted)
    docs_a = corpus(tmp_path / "docs-a", shared=SHARED, own=OWN_A)
    docs_b = corpus(tmp_path / "docs-b", shared=SHARED, own=OWN_B)
    run(engine, docs_a, tmp_path / "idx-a")
    run(engine, docs_b, tmp_path / "idx-b")
    table = _chunk_table(tmp_path / "idx-b")
    table.unlink()
    if damage == "garbage":
        table.write_bytes(b"\x00not a chunk table\n")
    elif damage == "fifo":
        os.mkfifo(table)
    else:
        table.symlink_to("/dev/zero")
    (docs_a / "shared.txt").unlink()
    s = run(engine, docs_a, tmp_path / "idx-a")
    assert (s.gc_collected, s.gc_pending) == (0, 1) and stored(engine, SHARED)
    shutil.rmtree(tmp_path / "idx-b")  # deleted: it references nothing any more
    s = run(engine, docs_a, tmp_path / "idx-a")
    assert (s.gc_collected, s.gc_pending) == (1, 0) and not stored(engine, SHARED)


def test_an_unreadable_intent_log_of_another_index_keeps_the_kv(engine, tmp_path):
    # B's ingest (killed, or running now) noted the shared chunk in its intent log, which is not a regular
    # file: it was read as empty and A's collection deleted the KV B is writing
    docs_a = corpus(tmp_path / "docs-a", shared=SHARED, own=OWN_A)
    docs_b = corpus(tmp_path / "docs-b", own=OWN_B)
    run(engine, docs_a, tmp_path / "idx-a")
    run(engine, docs_b, tmp_path / "idx-b")
    noted = tmp_path / "noted.jsonl"
    noted.write_text(json.dumps({"0" * 64: SHARED}) + "\n")
    (tmp_path / "idx-b" / INTENT_FILE).symlink_to(noted)
    (docs_a / "shared.txt").unlink()
    s = run(engine, docs_a, tmp_path / "idx-a")
    assert (s.gc_collected, s.gc_pending) == (0, 1) and stored(engine, SHARED)


def test_a_registered_folder_that_cannot_be_looked_at_keeps_the_kv(tmp_path, monkeypatch):
    # os.path.isdir is False on a permission error: an index behind a folder this user cannot search
    # referenced nothing (and its registration went after the stale time)
    hidden = tmp_path / "hidden" / "idx"
    now = [1000.0]
    reg = IndexRegistry([DiskStore(tmp_path / "store", fsync=False)], stale_s=10.0, clock=lambda: now[0])
    reg.register(hidden)
    real_stat = os.stat

    def stat(path, *args, **kwargs):
        if os.fspath(path).startswith(str(tmp_path / "hidden")):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)
    assert reg.held_elsewhere(tmp_path / "idx-a", "sig", {"a text"}) == {"a text"}
    now[0] += 100
    assert [r.root for r in reg.registered()] == [str(hidden)]  # never retired while it cannot be looked at


@pytest.mark.parametrize("damage", ["fifo", "link", "oversized"])
def test_a_registry_log_that_cannot_be_read_keeps_the_kv(tmp_path, monkeypatch, damage):
    # a registry log that is there but was not read (a FIFO or link at its path, oversized) was read as no
    # registration: a collection then deleted the KV of every other index's chunks
    import blend.store.record_logs as record_logs

    disk = DiskStore(tmp_path / "store", fsync=False)
    other = tmp_path / "idx-b"
    other.mkdir()
    IndexRegistry([disk]).register(other)
    path = tmp_path / "store" / "logs" / f"{REGISTRY_LOG}.jsonl"
    if damage == "oversized":
        monkeypatch.setattr(record_logs, "MAX_LOG_BYTES", 8)
    else:
        path.unlink()
        os.mkfifo(path) if damage == "fifo" else path.symlink_to(tmp_path / "elsewhere.jsonl")
    assert IndexRegistry([disk]).held_elsewhere(tmp_path / "idx-a", "sig", {"a", "b"}) == {"a", "b"}
    assert IndexRegistry([disk]).registered() == []  # what it lists: nothing it could read


def test_a_redis_registry_that_cannot_be_read_keeps_the_kv(tmp_path):
    from blend.store.redis_store import RedisStore

    down = RedisStore("redis://127.0.0.1:1/0", prefix="kvb-down", connect_timeout_s=0.2, socket_timeout_s=0.2)
    assert IndexRegistry([down]).held_elsewhere(tmp_path / "idx-a", "sig", {"a"}) == {"a"}


def test_an_index_folder_whose_name_is_not_utf8_registers_and_is_referenced(engine, tmp_path):
    # register() encoded the folder's name as UTF-8: an --index path of other bytes (Latin-1 'café', read
    # as surrogate escapes) crashed every ingest with UnicodeEncodeError
    docs_a = corpus(tmp_path / "docs-a", shared=SHARED, own=OWN_A)
    docs_b = corpus(tmp_path / "docs-b", shared=SHARED, own=OWN_B)
    run(engine, docs_a, tmp_path / "idx-a")
    run(engine, docs_b, Path(os.fsdecode(bytes(tmp_path / "caf") + b"\xe9")))
    (docs_a / "shared.txt").unlink()
    s = run(engine, docs_a, tmp_path / "idx-a")
    assert (s.gc_collected, s.gc_pending) == (0, 1) and stored(engine, SHARED)
