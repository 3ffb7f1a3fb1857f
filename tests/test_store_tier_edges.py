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


class _PausedRead(DiskStore):
    """A tier whose next hit pauses after it has read the entry (before the chain promotes it)."""

    def arm(self) -> None:
        self.read, self.go = threading.Event(), threading.Event()

    def get(self, ns, key, provenance):  # type: ignore[no-untyped-def]
        found = super().get(ns, key, provenance)
        if hasattr(self, "go") and not self.go.is_set():
            self.read.set()
            self.go.wait(5)
        return found


@pytest.mark.parametrize("write_behind", [False, True])
def test_a_lookup_that_read_a_lower_tier_before_a_delete_does_not_promote_it_back(tmp_path: Path,
                                                                                 write_behind: bool) -> None:
    """A lookup missed memory and read the entry from a slower tier; a delete then removed it from every
    tier; the lookup's promotion put it back into memory (and the middle tier), so the deleted entry
    was served again."""
    k = key_for(PROV, 0)
    memory, middle, slow = MemoryStore(), DiskStore(tmp_path / "mid", fsync=False), _PausedRead(tmp_path / "slow",
                                                                                                fsync=False)
    store = TieredStore([memory, middle, slow], write_behind=write_behind)
    store.put(Namespace.CANONICAL, k, rand_entry(PROV))
    store.flush()
    memory.delete(Namespace.CANONICAL, k)
    middle.delete(Namespace.CANONICAL, k)  # only the slowest tier holds it: a lookup promotes from there
    slow.arm()
    got: list = []
    lookup = threading.Thread(target=lambda: got.append(store.get(Namespace.CANONICAL, k, J)))
    lookup.start()
    assert slow.read.wait(5)  # the lookup read the entry and has not promoted it yet
    assert store.delete(Namespace.CANONICAL, k)
    slow.go.set()
    lookup.join(5)
    store.flush()
    assert got[0].status is LookupStatus.HIT  # it was there when read: this lookup is served
    assert [t.contains(Namespace.CANONICAL, k) for t in store.tiers] == [False, False, False]
    assert store.get(Namespace.CANONICAL, k, J).status is LookupStatus.MISS
    store.close()


def test_a_promotion_with_no_delete_in_between_still_lands(tmp_path: Path) -> None:
    k = key_for(PROV, 0)
    memory, disk = MemoryStore(), DiskStore(tmp_path, fsync=False)
    store = TieredStore([memory, disk], write_behind=False)
    store.put(Namespace.CANONICAL, k, rand_entry(PROV))
    store.delete(Namespace.CANONICAL, key_for(PROV, 1))  # another key's delete, finished before the lookup
    memory.delete(Namespace.CANONICAL, k)
    assert store.get(Namespace.CANONICAL, k, J).status is LookupStatus.HIT
    assert memory.contains(Namespace.CANONICAL, k)


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
