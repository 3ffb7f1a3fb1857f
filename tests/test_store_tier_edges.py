"""Store edges: Redis key listing under prefixes (non-ASCII, one extending another), delete order across
tiers, touch and links."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from blend.keys import Namespace
from blend.store.base import LookupStatus
from blend.store.disk import DiskStore
from blend.store.memory import MemoryStore
from blend.store.redis_store import RedisStore
from blend.store.tiered import TieredStore
from _store_util import key_for, make_prov, rand_entry, unique_prefix

PROV = make_prov()
J = PROV.canonical_json()


def test_clear_leaves_a_deployment_whose_prefix_extends_this_one(redis_url: str) -> None:
    base = unique_prefix()
    mine, theirs = RedisStore(redis_url, prefix=base), RedisStore(redis_url, prefix=f"{base}:exact")
    try:
        theirs.put(Namespace.CANONICAL, key_for(PROV, 0), rand_entry(PROV))
        assert mine.stats().entries == 0
        assert mine.clear(Namespace.EXACT) == 0
        assert theirs.get(Namespace.CANONICAL, key_for(PROV, 0), J).status is LookupStatus.HIT
    finally:
        theirs.clear()


@pytest.mark.parametrize("suffix", [":log", ":log:x", "2", ":x"])
def test_clear_leaves_the_entries_and_logs_of_a_deployment_whose_prefix_extends_this_one(redis_url: str,
                                                                                       suffix: str) -> None:
    """clear(None) deleted every key matching ``<prefix>:log:*``: all of deployment ``<prefix>:log``'s
    entries and record logs."""
    base = unique_prefix()
    mine, theirs = RedisStore(redis_url, prefix=base), RedisStore(redis_url, prefix=base + suffix)
    try:
        theirs.put(Namespace.CANONICAL, key_for(PROV, 0), rand_entry(PROV))
        theirs.append_record("donors-0123", b"their line")
        mine.put(Namespace.CANONICAL, key_for(PROV, 1), rand_entry(PROV))
        mine.append_record("donors-0123", b"my line")
        assert mine.clear() == 1
        assert mine.read_records("donors-0123") == [] and mine.stats().entries == 0
        assert theirs.get(Namespace.CANONICAL, key_for(PROV, 0), J).status is LookupStatus.HIT
        assert theirs.read_records("donors-0123") == [b"their line"]
        with pytest.raises(ValueError, match="bad record log name"):
            mine.append_record("log:donors-0123", b"a name that would read as another deployment's key")
    finally:
        theirs.clear()
        mine.clear()


def test_keys_under_a_non_ascii_prefix(redis_url: str) -> None:
    s = RedisStore(redis_url, prefix=unique_prefix() + "-équipe")
    try:
        s.put(Namespace.CANONICAL, key_for(PROV, 0), rand_entry(PROV))
        s.put_raw(Namespace.CANONICAL, key_for(PROV, 1), b"garbage")
        assert {bytes(k) for k in s.keys(Namespace.CANONICAL)} == {key_for(PROV, 0), key_for(PROV, 1)}
        assert s.verify(Namespace.CANONICAL, key_for(PROV, 1)).invalid
    finally:
        s.clear()


def test_a_lookup_during_a_delete_does_not_bring_the_entry_back(tmp_path: Path) -> None:
    in_delete, go = threading.Event(), threading.Event()

    class SlowDelete(DiskStore):
        def delete(self, ns, key):  # type: ignore[no-untyped-def]
            in_delete.set()
            go.wait(5)
            return super().delete(ns, key)

    k = key_for(PROV, 0)
    store = TieredStore([MemoryStore(), SlowDelete(tmp_path, fsync=False)], write_behind=False)
    store.put(Namespace.CANONICAL, k, rand_entry(PROV))
    t = threading.Thread(target=store.delete, args=(Namespace.CANONICAL, k))
    t.start()
    assert in_delete.wait(5)
    store.get(Namespace.CANONICAL, k, J)  # concurrent with the delete
    go.set()
    t.join()
    assert store.get(Namespace.CANONICAL, k, J).status is LookupStatus.MISS


def test_touch_never_follows_a_link_at_an_entry_path(tmp_path: Path) -> None:
    victim = tmp_path / "outside.txt"
    victim.write_bytes(b"")
    os.utime(victim, (1_000_000, 1_000_000))
    disk = DiskStore(tmp_path / "store", fsync=False)
    k = key_for(PROV, 0)
    store = TieredStore([MemoryStore(), disk], write_behind=False)
    store.put(Namespace.CANONICAL, k, rand_entry(PROV))
    p = disk.path(Namespace.CANONICAL, k)
    p.unlink()
    p.symlink_to(victim)
    assert store.get(Namespace.CANONICAL, k, J).status is LookupStatus.HIT  # memory hit: touches the disk tier
    assert victim.stat().st_mtime == 1_000_000
