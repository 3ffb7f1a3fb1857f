"""A tier chain's writes and deletes of one key racing each other, with slow tiers held at gates:
no lock is held across a tier's I/O (a slow delete stalls only its own key), a lookup that read an
entry before a delete finished never brings it back into any tier, a put and a delete of one key end
the same way in every tier (the one that started last wins), and a clear is never undone."""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field

import pytest

from blend.keys import Namespace, StoreKey
from blend.store.base import LookupStatus
from blend.store.memory import MemoryStore
from blend.store.tiered import TieredStore
from _store_util import NS, key_for, make_prov, rand_entry

PROV = make_prov()
J = PROV.canonical_json()
WAIT_S = 10.0  # how long a test waits for something that must happen (a hang fails, never blocks the run)


@dataclass
class Gate:
    """Holds the next matching call of a tier: ``entered`` once it is held, until ``release``."""

    entered: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)

    def release(self) -> None:
        self.released.set()


class SlowTier(MemoryStore):
    """A lower tier (a disk, a Redis) whose next get (after it read), put (before it writes) or delete
    (before it deletes) of a key can be held at a gate; ``jitter`` makes every call yield a random while."""

    def __init__(self, name: str) -> None:
        super().__init__(None)
        self.name = name
        self._gates: dict[tuple[str, bytes | None], Gate] = {}
        self._gates_lock = threading.Lock()
        self.jitter: random.Random | None = None

    def hold(self, op: str, key: StoreKey | None = None) -> Gate:
        gate = Gate()
        with self._gates_lock:
            self._gates[(op, None if key is None else bytes(key))] = gate
        return gate

    def _pass(self, op: str, key: StoreKey) -> None:
        with self._gates_lock:
            gate = self._gates.pop((op, bytes(key)), None) or self._gates.pop((op, None), None)
        if gate is not None:
            gate.entered.set()
            assert gate.released.wait(WAIT_S)
        if self.jitter is not None:
            threading.Event().wait(self.jitter.random() * 2e-4)

    def get(self, ns, key, provenance):  # type: ignore[no-untyped-def]
        found = super().get(ns, key, provenance)
        self._pass("get", key)
        return found

    def put(self, ns, key, entry) -> None:  # type: ignore[no-untyped-def]
        self._pass("put", key)
        super().put(ns, key, entry)

    def delete(self, ns, key):  # type: ignore[no-untyped-def]
        self._pass("delete", key)
        return super().delete(ns, key)

    def seed(self, key: StoreKey, seed: int = 0) -> None:
        """Hold ``key`` (written past every gate)."""
        MemoryStore.put(self, NS, key, rand_entry(PROV, seed=seed))


def start(fn, *args) -> tuple[threading.Thread, list]:  # type: ignore[no-untyped-def]
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True)
    t.start()
    return t, out


def where(store: TieredStore, key: StoreKey) -> list[bool]:
    return [t.contains(NS, key) for t in store.tiers]


def chain(write_behind: bool, n: int = 2) -> tuple[TieredStore, list[SlowTier]]:
    lower = [SlowTier(f"slow{i}") for i in range(1, n)]
    return TieredStore([MemoryStore(), *lower], write_behind=write_behind), lower


# ---- (a) a delete held in a slow tier blocks nobody else ---------------------------------------------------


@pytest.mark.parametrize("write_behind", [False, True])
def test_a_delete_held_in_a_slow_tier_stalls_no_other_keys_lookup_put_or_delete(write_behind: bool) -> None:
    """The chain held a stripe lock across every tier's delete: while a Redis delete of one key hung, every
    lookup that promoted a key of the same stripe (1 in 64 keys), and every delete of one, waited for it.
    512 keys: whatever the striping, many share the held key's stripe."""
    store, (slow,) = chain(write_behind)
    held, others = key_for(PROV, 0), [key_for(PROV, i) for i in range(1, 513)]
    for k in [held, *others]:
        slow.seed(k)
    gate = slow.hold("delete", held)
    deleter, _ = start(store.delete, NS, held)
    assert gate.entered.wait(WAIT_S)

    def others_work() -> None:
        for k in others[:-2]:
            assert store.get(NS, k, J).status is LookupStatus.HIT  # found in the slow tier, promoted
        store.put(NS, others[-2], rand_entry(PROV, seed=2))
        assert store.delete(NS, others[-1])

    worker, _ = start(others_work)
    worker.join(WAIT_S)
    stalled = worker.is_alive()
    gate.release()
    deleter.join(WAIT_S)
    assert not stalled, "another key's lookup, put or delete waited for the held delete"
    assert all(store.tiers[0].contains(NS, k) for k in others[:-2])  # promoted while the delete was held
    assert store.flush(WAIT_S)
    assert where(store, others[-2]) == [True, True] and where(store, others[-1]) == [False, False]
    assert where(store, held) == [False, False]
    store.close()


def test_a_delete_never_waits_for_other_keys_queued_writes() -> None:
    """A delete flushed the whole write-behind queue first: behind a slow disk or Redis, every delete (a
    corrupt block's, on the serving path) waited for every request's pending writes."""
    store, (slow,) = chain(write_behind=True)
    busy, doomed = key_for(PROV, 1), key_for(PROV, 2)
    slow.seed(doomed)
    gate = slow.hold("put", busy)
    store.put(NS, busy, rand_entry(PROV))  # its disk write is held: the queue is stuck behind it
    assert gate.entered.wait(WAIT_S)
    deleter, out = start(store.delete, NS, doomed)
    deleter.join(WAIT_S)
    stalled = deleter.is_alive()
    gate.release()
    assert not stalled and out == [True]
    assert store.flush(WAIT_S) and where(store, busy) == [True, True] and where(store, doomed) == [False, False]
    store.close()


# ---- (c) a promotion racing a delete ------------------------------------------------------------------------


def _promoting_chain(write_behind: bool) -> tuple[TieredStore, SlowTier, SlowTier, StoreKey]:
    """memory -> slow1 (a disk) -> slow2 (Redis), the key only in slow2: a lookup promotes it to both."""
    store, (mid, low) = chain(write_behind, n=3)
    k = key_for(PROV, 0)
    low.seed(k)
    return store, mid, low, k


@pytest.mark.parametrize("write_behind", [False, True])
def test_a_promotion_admitted_before_a_delete_is_deleted_with_it(write_behind: bool) -> None:
    """The promotion is writing the middle tier (held) when the delete starts: the delete waits for that
    copy and removes it; nothing is anywhere afterwards."""
    store, mid, _, k = _promoting_chain(write_behind)
    gate = mid.hold("put", k)
    lookup, got = start(store.get, NS, k, J)
    assert gate.entered.wait(WAIT_S)
    deleter, gone = start(store.delete, NS, k)
    deleter.join(0.2)
    assert deleter.is_alive()  # waiting for the copy in I/O (else it would land after the delete)
    gate.release()
    lookup.join(WAIT_S)
    deleter.join(WAIT_S)
    assert got[0].status is LookupStatus.HIT and gone == [True]
    assert store.flush(WAIT_S) and where(store, k) == [False, False, False]
    assert store.get(NS, k, J).status is LookupStatus.MISS
    store.close()


def test_a_promotions_queued_copy_is_dropped_by_a_later_delete() -> None:
    """The promotion's copy into the persistent middle tier waits in the write-behind queue (behind a held
    write); a delete runs meanwhile without waiting for the queue; the copy is dropped when it comes up."""
    store, mid, _, k = _promoting_chain(write_behind=True)
    busy = key_for(PROV, 9)
    gate = mid.hold("put", busy)
    store.put(NS, busy, rand_entry(PROV))
    assert gate.entered.wait(WAIT_S)
    assert store.get(NS, k, J).status is LookupStatus.HIT  # promoted to memory; the middle copy is queued
    assert store.tiers[0].contains(NS, k)
    deleter, gone = start(store.delete, NS, k)
    deleter.join(WAIT_S)
    stalled = deleter.is_alive()
    gate.release()
    assert not stalled and gone == [True]
    assert store.flush(WAIT_S) and where(store, k) == [False, False, False]
    store.close()


@pytest.mark.parametrize("write_behind", [False, True])
def test_a_lookup_that_began_during_a_delete_does_not_promote(write_behind: bool) -> None:
    """The delete is held before it reached the slowest tier: a lookup then finds the entry there. Whether
    it tries to promote during the delete or after it ended, the entry is gone from every tier."""
    for after in (False, True):
        store, mid, low, k = _promoting_chain(write_behind)
        held = low.hold("delete", k)
        deleter, _ = start(store.delete, NS, k)
        assert held.entered.wait(WAIT_S)
        read = low.hold("get", k) if after else None
        lookup, got = start(store.get, NS, k, J)
        if read is not None:
            assert read.entered.wait(WAIT_S)  # it read the entry; the delete ends before it promotes
            held.release()
            deleter.join(WAIT_S)
            read.release()
        lookup.join(WAIT_S)
        held.release()
        deleter.join(WAIT_S)
        assert got[0].status is LookupStatus.HIT  # it was there when read
        assert store.flush(WAIT_S) and where(store, k) == [False, False, False], f"after={after}"
        store.close()


@pytest.mark.parametrize("write_behind", [False, True])
def test_a_promotion_racing_a_delete_never_leaves_the_entry_anywhere(write_behind: bool) -> None:
    """300 races of a lookup (promoting from the slowest tier) and a delete, started together with
    random pauses inside every tier call: afterwards the key is in no tier."""
    rng = random.Random(7)
    store, (mid, low) = chain(write_behind, n=3)
    mid.jitter = low.jitter = rng
    for i in range(300):
        k = key_for(PROV, i)
        low.seed(k)
        go = threading.Barrier(2)
        lookup, _ = start(lambda: (go.wait(WAIT_S), store.get(NS, k, J)))
        deleter, _ = start(lambda: (go.wait(WAIT_S), store.delete(NS, k)))
        lookup.join(WAIT_S)
        deleter.join(WAIT_S)
        assert store.flush(WAIT_S)
        assert where(store, k) == [False, False, False], f"race {i}"
    store.close()


def test_a_promotion_never_undoes_a_clear() -> None:
    store, mid, low, k = _promoting_chain(write_behind=True)
    read = low.hold("get", k)
    lookup, got = start(store.get, NS, k, J)
    assert read.entered.wait(WAIT_S)
    store.clear(NS)
    read.release()
    lookup.join(WAIT_S)
    assert got[0].status is LookupStatus.HIT
    assert store.flush(WAIT_S) and where(store, k) == [False, False, False]
    store.close()


# ---- (d) a put racing a delete: the later one wins, in every tier --------------------------------------------


@pytest.mark.parametrize("write_behind", [False, True])
def test_a_put_started_before_a_delete_is_deleted_in_every_tier(write_behind: bool) -> None:
    """The put's lower-tier write is held (write-through: inline; write-behind: queued behind another write)
    when the delete starts: the delete wins everywhere, the held write never lands after it."""
    store, (slow,) = chain(write_behind)
    k = key_for(PROV, 0)
    if write_behind:  # the put's disk write waits in the queue behind a held one
        gate = slow.hold("put", key_for(PROV, 1))
        store.put(NS, key_for(PROV, 1), rand_entry(PROV))
        assert gate.entered.wait(WAIT_S)
        store.put(NS, k, rand_entry(PROV))
    else:  # the put is writing the slow tier
        gate = slow.hold("put", k)
        start(store.put, NS, k, rand_entry(PROV))
        assert gate.entered.wait(WAIT_S)
    deleter, _ = start(store.delete, NS, k)
    if write_behind:
        deleter.join(WAIT_S)
        assert not deleter.is_alive()  # the queued write is dropped when it comes up: nothing to wait for
    else:
        deleter.join(0.2)
        assert deleter.is_alive()  # waits for the write in I/O (else it would land after the delete)
    gate.release()
    deleter.join(WAIT_S)
    assert store.flush(WAIT_S) and where(store, k) == [False, False]
    store.close()


@pytest.mark.parametrize("write_behind", [False, True])
def test_a_put_started_during_a_delete_lands_in_every_tier(write_behind: bool) -> None:
    """The delete is held in the slow tier when a put of the key starts: the put is the later one, so the
    key ends in every tier (before, the put's memory copy was deleted and its disk copy kept)."""
    store, (slow,) = chain(write_behind)
    k = key_for(PROV, 0)
    store.put(NS, k, rand_entry(PROV))
    assert store.flush(WAIT_S)
    gate = slow.hold("delete", k)
    deleter, _ = start(store.delete, NS, k)
    assert gate.entered.wait(WAIT_S)
    putter, _ = start(store.put, NS, k, rand_entry(PROV))
    gate.release()
    deleter.join(WAIT_S)
    putter.join(WAIT_S)
    assert store.flush(WAIT_S) and where(store, k) == [True, True]
    assert store.get(NS, k, J).status is LookupStatus.HIT
    store.close()


@pytest.mark.parametrize("write_behind", [False, True])
def test_puts_and_deletes_of_one_key_racing_end_the_same_in_every_tier(write_behind: bool) -> None:
    """200 races of a put and a delete of one key (random pauses in every tier call): whichever wins, the
    key is in every tier or in none."""
    rng = random.Random(11)
    store, (mid, low) = chain(write_behind, n=3)
    mid.jitter = low.jitter = rng
    for i in range(200):
        k = key_for(PROV, i)
        if i % 2:
            store.put(NS, k, rand_entry(PROV))
            assert store.flush(WAIT_S)
        go = threading.Barrier(2)
        putter, _ = start(lambda: (go.wait(WAIT_S), store.put(NS, k, rand_entry(PROV))))
        deleter, _ = start(lambda: (go.wait(WAIT_S), store.delete(NS, k)))
        putter.join(WAIT_S)
        deleter.join(WAIT_S)
        assert store.flush(WAIT_S)
        seen = where(store, k)
        assert seen in ([True] * 3, [False] * 3), f"race {i}: {seen}"
    store.close()


class _HeldClear(SlowTier):
    """A slow tier whose clear is held at a gate."""

    gate: Gate

    def clear(self, ns=None):  # type: ignore[no-untyped-def]
        self.gate.entered.set()
        assert self.gate.released.wait(WAIT_S)
        return super().clear(ns)


@pytest.mark.parametrize("write_behind", [False, True])
def test_a_clear_held_in_a_slow_tier_stalls_no_put_of_another_namespace(write_behind: bool) -> None:
    slow = _HeldClear("slow")
    slow.gate = Gate()
    store = TieredStore([MemoryStore(), slow], write_behind=write_behind)
    k = key_for(PROV, 0)
    clearer, _ = start(store.clear, Namespace.EXACT)
    assert slow.gate.entered.wait(WAIT_S)
    putter, _ = start(store.put, NS, k, rand_entry(PROV))
    putter.join(WAIT_S)
    stalled = putter.is_alive()
    slow.gate.release()
    clearer.join(WAIT_S)
    assert not stalled
    assert store.flush(WAIT_S) and where(store, k) == [True, True]
    store.close()


@pytest.mark.parametrize("write_behind", [False, True])
def test_a_write_that_failed_in_a_tier_never_holds_up_a_later_delete(write_behind: bool) -> None:
    """A tier's put raising (not an OSError: a bug, a client library's own error) must still end the write's
    turn, or every later delete of the key would wait for it forever."""

    class Failing(SlowTier):
        def put(self, ns, key, entry) -> None:  # type: ignore[no-untyped-def]
            raise RuntimeError("tier bug")

    store = TieredStore([MemoryStore(), Failing("failing")], write_behind=write_behind)
    k = key_for(PROV, 0)
    if write_behind:
        store.put(NS, k, rand_entry(PROV))  # the failure is the writer's: logged and counted
        assert store.flush(WAIT_S) and store.stats().extra["background_write_failures"] == 1
    else:
        with pytest.raises(RuntimeError):
            store.put(NS, k, rand_entry(PROV))
    deleter, gone = start(store.delete, NS, k)
    deleter.join(WAIT_S)
    assert not deleter.is_alive() and where(store, k) == [False, False]
    store.close()


# ---- lost writes -------------------------------------------------------------------------------------------


class _HeldParts(list):
    """An entry's encoded parts whose writing (into the temp file, before the rename) waits at a gate."""

    gate: Gate

    def __iter__(self):  # type: ignore[no-untyped-def]
        self.gate.entered.set()
        assert self.gate.released.wait(WAIT_S)
        return super().__iter__()


@pytest.mark.parametrize("cleared", [Namespace.EXACT, None])
def test_a_disk_clear_never_removes_a_write_in_progress(tmp_path, monkeypatch: pytest.MonkeyPatch,
                                                        cleared: Namespace | None) -> None:
    """The disk tier's clear removed every temp file, a write in progress's too (another namespace's, or
    another process's): its rename then failed and the entry was lost. Only killed writers' leftovers go."""
    from blend.store import disk as disk_module
    from blend.store.disk import DiskStore

    gate = Gate()
    real = disk_module.encode_parts

    def held(*args):  # type: ignore[no-untyped-def]
        parts = _HeldParts(real(*args))
        parts.gate = gate
        return parts

    monkeypatch.setattr(disk_module, "encode_parts", held)
    disk, k = DiskStore(tmp_path, fsync=False), key_for(PROV, 0)
    writer, _ = start(disk.put, NS, k, rand_entry(PROV))
    assert gate.entered.wait(WAIT_S)  # its temp file is open
    disk.clear(cleared)
    gate.release()
    writer.join(WAIT_S)
    assert disk.get(NS, k, J).status is LookupStatus.HIT
    assert disk.stats().extra.get("put_errors", 0) == 0
