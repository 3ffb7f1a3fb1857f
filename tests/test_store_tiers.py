"""Memory LRU budget and order, tiered promotion and write-through, specs, prefetcher."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from blend.keys import Namespace
from blend.store.base import Lookup, LookupStatus
from blend.store.disk import DiskStore
from blend.store.memory import MemoryStore
from blend.store.prefetch import FetchRequest, Prefetcher
from blend.store.redis_store import RedisStore
from blend.store.spec import StoreSpecError, TierKind, open_store, parse_store_spec
from blend.store.tiered import TieredStore
from _store_util import NS, key_for, make_prov, other_prov, rand_entry

PROV = make_prov()
J = PROV.canonical_json()


def test_byte_budget_holds_under_10x_stream_and_keeps_the_newest() -> None:
    one = rand_entry(PROV).nbytes
    fit = 8
    store = MemoryStore(budget_bytes=fit * one + one // 2)
    for i in range(10 * fit):
        store.put(NS, key_for(PROV, i), rand_entry(PROV, seed=i))
        assert store.stats().bytes <= store.budget_bytes  # type: ignore[operator]
    s = store.stats()
    assert s.entries == fit and s.evictions == 9 * fit
    kept = {bytes(k) for k in store.keys(NS)}
    assert kept == {bytes(key_for(PROV, i)) for i in range(9 * fit, 10 * fit)}


def test_lru_order_a_get_protects_an_entry() -> None:
    one = rand_entry(PROV).nbytes
    store = MemoryStore(budget_bytes=3 * one)
    for i in range(3):
        store.put(NS, key_for(PROV, i), rand_entry(PROV, seed=i))
    assert store.get(NS, key_for(PROV, 0), J).status is LookupStatus.HIT  # 0 is now the newest
    store.put(NS, key_for(PROV, 3), rand_entry(PROV, seed=3))  # evicts 1, the least recently used
    assert not store.contains(NS, key_for(PROV, 1))
    assert all(store.contains(NS, key_for(PROV, i)) for i in (0, 2, 3))
    store.put(NS, key_for(PROV, 4), rand_entry(PROV, seed=4))  # then 2
    assert not store.contains(NS, key_for(PROV, 2)) and store.contains(NS, key_for(PROV, 0))


def test_entry_larger_than_budget_is_not_cached() -> None:
    store = MemoryStore(budget_bytes=10)
    store.put(NS, key_for(PROV, 0), rand_entry(PROV))
    assert store.stats().entries == 0 and store.stats().bytes == 0


def test_memory_rejects_collision() -> None:
    store = MemoryStore()
    store.put(NS, key_for(PROV, 0), rand_entry(other_prov(PROV)))
    got = store.get(NS, key_for(PROV, 0), J)
    assert got.status is LookupStatus.REJECTED and got.entry is None


def test_disk_hit_is_promoted_to_memory(tmp_path: Path) -> None:
    entry = rand_entry(PROV)
    DiskStore(tmp_path).put(NS, key_for(PROV, 0), entry)  # written by another process
    mem = MemoryStore(budget_bytes=1 << 20)
    store = TieredStore([mem, DiskStore(tmp_path)])
    assert not mem.contains(NS, key_for(PROV, 0))
    first = store.get(NS, key_for(PROV, 0), J)
    assert first.status is LookupStatus.HIT and first.tier == "disk"
    assert mem.contains(NS, key_for(PROV, 0))
    second = store.get(NS, key_for(PROV, 0), J)
    assert second.tier == "memory" and second.entry is not None
    assert second.entry.k.equal(entry.k)
    s = store.stats()
    assert s.hits == 2 and s.extra["promotions"] == 1 and s.extra["disk.hits"] == 1


def test_put_reaches_every_tier_and_bad_upper_copy_is_bypassed(tmp_path: Path) -> None:
    mem, disk = MemoryStore(), DiskStore(tmp_path)
    store = TieredStore([mem, disk])
    entry = rand_entry(PROV)
    store.put(NS, key_for(PROV, 0), entry)
    assert store.flush(10)  # the disk write runs behind (blend/store/write_behind.py)
    assert mem.contains(NS, key_for(PROV, 0)) and disk.contains(NS, key_for(PROV, 0))
    # the memory copy goes bad (another provenance); the valid disk copy wins and replaces it
    mem._data[(NS, bytes(key_for(PROV, 0)))] = rand_entry(other_prov(PROV))
    got = store.get(NS, key_for(PROV, 0), J)
    assert got.status is LookupStatus.HIT and got.tier == "disk"
    assert mem.get(NS, key_for(PROV, 0), J).status is LookupStatus.HIT
    # all copies bad: REJECTED (not MISS), with the reason
    disk.put(NS, key_for(PROV, 0), rand_entry(other_prov(PROV)))
    mem.put(NS, key_for(PROV, 0), rand_entry(other_prov(PROV)))
    got = store.get(NS, key_for(PROV, 0), J)
    assert got.status is LookupStatus.REJECTED and got.reason == "provenance mismatch"
    assert store.get(NS, key_for(PROV, 5), J).status is LookupStatus.MISS


def test_specs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVBLEND_STORE", raising=False)
    monkeypatch.setenv("KVBLEND_HOME", str(tmp_path))
    [default] = parse_store_spec(None)
    assert default.kind is TierKind.DISK and default.location == str(tmp_path / "store")
    default_store = open_store(None)
    assert isinstance(default_store, TieredStore) and default_store.name == "memory+disk"
    assert isinstance(open_store("memory"), MemoryStore)
    chain = parse_store_spec("disk:/x, redis://127.0.0.1:6390/2?prefix=team&ttl=60")
    assert [t.kind for t in chain] == [TierKind.DISK, TierKind.REDIS]
    assert chain[1].location == "redis://127.0.0.1:6390/2" and chain[1].prefix == "team" and chain[1].ttl_s == 60
    store = open_store("redis://127.0.0.1:6390/2?prefix=team", with_memory=False)
    assert isinstance(store, RedisStore) and store.prefix == "team"
    for bad in ["disk:", "s3://bucket", "redis://h:1/0?ttl=soon", "redis://h:1/0?ttl=0", "redis://h:1/0?ttl=-5", ""]:
        with pytest.raises(StoreSpecError):
            parse_store_spec(bad) if bad else parse_store_spec(",")
    monkeypatch.setenv("KVBLEND_STORE", "memory")
    assert parse_store_spec(None)[0].kind is TierKind.MEMORY


class SlowStore(MemoryStore):
    """A memory store whose lookups take ``delay_s`` (a stand-in for disk/Redis)."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s

    def get(self, ns: Namespace, key, provenance: str) -> Lookup:  # type: ignore[no-untyped-def]
        time.sleep(self.delay_s)
        return super().get(ns, key, provenance)


def test_prefetch_stream_keeps_order_and_overlaps() -> None:
    store = SlowStore(delay_s=0.08)
    n = 6
    for i in range(n):
        if i != 3:  # one miss in the middle
            store.put(NS, key_for(PROV, i), rand_entry(PROV, seed=i))
    reqs = [FetchRequest(NS, key_for(PROV, i), J) for i in range(n)]

    t0 = time.perf_counter()
    for r in reqs:  # sequential: load, then "compute"
        store.get(r.ns, r.key, r.provenance)
        time.sleep(0.08)
    sequential = time.perf_counter() - t0

    with Prefetcher(store, max_workers=2) as pf:
        t0 = time.perf_counter()
        got: list[Lookup] = []
        for lookup in pf.stream(reqs, depth=1):
            got.append(lookup)
            time.sleep(0.08)  # compute with this entry while the next one loads
        overlapped = time.perf_counter() - t0
        fut = pf.submit(NS, key_for(PROV, 0), J)
        assert fut.result().status is LookupStatus.HIT

    assert [g.status for g in got] == [LookupStatus.MISS if i == 3 else LookupStatus.HIT for i in range(n)]
    for i, g in enumerate(got):
        if g.entry is not None:
            assert g.entry.k.equal(rand_entry(PROV, seed=i).k)
    assert overlapped < 0.8 * sequential, (overlapped, sequential)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_prefetched_cuda_entry_is_not_reused_while_the_compute_stream_still_reads_it() -> None:
    """A hit copied to the GPU on the prefetcher's side stream was allocated there; once the engine dropped it,
    the allocator gave its memory to the next copy on that (pooled) stream at once, while kernels the engine
    had queued on its own stream could still be reading it. The GPU is held busy (``_sleep``) before the read."""
    store = MemoryStore()
    keys = [key_for(PROV, i) for i in range(80)]
    for i, k in enumerate(keys):
        store.put(NS, k, rand_entry(PROV, T=256, seed=i))
    with Prefetcher(store, max_workers=1, device="cuda") as pf:
        first = pf.submit(NS, keys[0], J).result().entry
        assert first is not None
        torch.cuda._sleep(2_000_000_000)  # ~1 s of this stream's time: the read below waits behind it
        later = first.k * 1  # (L, Hkv, T, D) read on the compute stream after the sleep
        del first
        rest = [pf.submit(NS, k, J).result() for k in keys[1:]]  # copies on the pooled side streams meanwhile
        torch.cuda.synchronize()
    assert all(r.status is LookupStatus.HIT for r in rest)
    assert torch.equal(later.cpu(), rand_entry(PROV, T=256, seed=0).k)



def test_counters_are_stats_counters_without_a_scan(tmp_path, monkeypatch):
    """``counters()`` (what every metrics scrape reads) equals ``stats()``'s counters on every tier and on a
    chain, and never lists the disk folder (``stats()`` stats every entry file)."""
    from prometheus_client import generate_latest

    from blend.serve.metrics import ServeMetrics

    disk = DiskStore(tmp_path / "d")
    chain = TieredStore([MemoryStore(), disk], write_behind=False)
    chain.put(NS, key_for(PROV, 0), rand_entry(PROV))
    assert chain.get(NS, key_for(PROV, 0), PROV.canonical_json()).entry is not None
    assert chain.get(NS, key_for(PROV, 1), PROV.canonical_json()).entry is None
    for store in (chain, disk, chain.tiers[0]):
        full, cheap = store.stats(), store.counters()
        assert (cheap.hits, cheap.misses, cheap.rejected, cheap.puts, cheap.evictions) == (
            full.hits, full.misses, full.rejected, full.puts, full.evictions)
        assert (cheap.entries, cheap.bytes) == (0, 0)

    def no_scan(*a, **kw):
        raise AssertionError("a metrics scrape listed the disk store's folder")

    monkeypatch.setattr(DiskStore, "_files", no_scan)
    text = generate_latest(ServeMetrics(chain).registry).decode()
    assert 'kvblend_store_lookups_total{result="hit"} 1.0' in text
    assert 'kvblend_store_lookups_total{result="miss"} 1.0' in text


class _SlowPuts(MemoryStore):
    """A memory store whose puts take ``delay_s`` (a stand-in for an fsynced disk tier)."""

    name = "slow"

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s

    def put(self, ns, key, entry):  # type: ignore[no-untyped-def]
        time.sleep(self.delay_s)
        super().put(ns, key, entry)


@pytest.mark.parametrize("write_behind", [True, False])
def test_a_lower_tiers_hit_reaches_the_persistent_tiers_above_it_in_the_background(write_behind):
    """memory -> slow (disk) -> memory (Redis): a hit found only in the last tier is in the first tier
    when the lookup returns; with write-behind the slow tier's copy is written off the lookup's time."""
    fast, slow, last = MemoryStore(), _SlowPuts(0.4), MemoryStore()
    chain = TieredStore([fast, slow, last], write_behind=write_behind)
    e = rand_entry(PROV)
    last.put(NS, key_for(PROV, 0), e)
    t0 = time.perf_counter()
    assert chain.get(NS, key_for(PROV, 0), J).status is LookupStatus.HIT
    took = time.perf_counter() - t0
    assert fast.contains(NS, key_for(PROV, 0))
    assert (took < 0.2) if write_behind else (took >= 0.4)
    assert chain.flush(5.0)
    assert slow.contains(NS, key_for(PROV, 0))
    assert chain.stats().extra["promotions"] == 1
    chain.close()


@pytest.mark.parametrize("write_behind", [False, True])
def test_a_memory_hit_counts_as_a_use_in_the_budgeted_disk_tier_below(tmp_path: Path, write_behind: bool,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A memory hit never reached the disk, so the disk's least-recently-used pruning took the hottest
    entry first (the one every request read from memory): after a restart, or for another process
    sharing the folder, the most used entry was the one missing."""
    from blend.store import disk as disk_module

    monkeypatch.setattr(disk_module, "DEFAULT_TOUCH_INTERVAL_S", 0.0)  # puts here come faster than its rate limit
    one = rand_entry(PROV).nbytes
    disk = DiskStore(tmp_path, fsync=False, budget_bytes=int(4.5 * (one + 4096)))
    chain = TieredStore([MemoryStore(), disk], write_behind=write_behind)
    hot = key_for(PROV, 0)
    chain.put(NS, hot, rand_entry(PROV))
    for i in range(1, 12):
        assert chain.get(NS, hot, J).status is LookupStatus.HIT  # served by the memory tier
        assert chain.flush(5.0)
        time.sleep(0.01)  # mtimes apart
        chain.put(NS, key_for(PROV, i), rand_entry(PROV, seed=i))
        assert chain.flush(5.0)
    assert disk.contains(NS, hot)  # the hottest entry stays on disk
    assert not disk.contains(NS, key_for(PROV, 1))  # the coldest went
    chain.close()


def test_a_tiers_failed_writes_show_in_the_chains_stats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiers log and swallow their write failures, so the chain's background_write_failures stayed 0 while
    every disk write failed; the chain's stats now carry each tier's own failure counters."""
    from blend import safeio

    def full(*a, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safeio, "atomic_file_beneath", full)
    chain = TieredStore([MemoryStore(), DiskStore(tmp_path, fsync=False)], write_behind=True)
    for i in range(3):
        chain.put(NS, key_for(PROV, i), rand_entry(PROV, seed=i))
    assert chain.flush(5.0)
    disk = chain.tiers[1].name
    assert chain.stats().extra[f"{disk}.put_errors"] == 3
    chain.close()


def test_a_memory_hit_never_waits_for_queued_disk_writes(tmp_path: Path) -> None:
    """The disk tier's recency update went through the write-behind queue, so a memory hit waited for
    room behind other requests' slow disk writes (0.25 s in the review's case). It is inline now, and at
    most one utime per key a second."""
    import threading

    class SlowDisk(DiskStore):
        def put(self, ns, key, entry):
            time.sleep(0.2)
            super().put(ns, key, entry)

    disk = SlowDisk(tmp_path, fsync=False)
    chain = TieredStore([MemoryStore(), disk], write_behind=True, max_pending=2)
    hot = key_for(PROV, 0)
    chain.put(NS, hot, rand_entry(PROV))
    assert chain.flush(5.0)
    filler = threading.Thread(target=lambda: [chain.put(NS, key_for(PROV, i), rand_entry(PROV, seed=i))
                                              for i in range(1, 6)])
    filler.start()
    time.sleep(0.05)  # the queue is full now
    t0 = time.perf_counter()
    assert chain.get(NS, hot, J).status is LookupStatus.HIT
    assert time.perf_counter() - t0 < 0.1
    filler.join()
    chain.close()
