"""The donor index under concurrent requests, and the donors' own opt-in.

A serving engine runs prefills on several threads (prefill workers and the decode loop), and every
blended request registers, looks up and forgets donors in the one index its segment cache owns.
Each test makes another thread's call land at the exact point of a lookup, a removal or the index's
first use (a hook that starts it there and waits a little for it), so a missing lock shows every time.
"""

from __future__ import annotations

import threading
from typing import Callable

import numpy as np
import pytest
import torch

from blend import donors as donors_mod
from blend.donors import DonorIndex
from blend.keys import Namespace, StoreKey, canonical_key_of, provenance_digest, token_digest
from blend.kvcache import KVEntry
from blend.report import ReuseClass
from blend.semantic import Donors
from blend.store.disk import DiskStore
from blend.store.memory import MemoryStore
from conftest import make_docs, unguarded_blend

PRE = [1, 2, 3]
A, B = StoreKey(b"\xaa" * 32), StoreKey(b"\xbb" * 32)
TOKENS_A = list(range(100, 180))
TOKENS_B = list(range(500, 580))
SEM0 = unguarded_blend(ratio=0.0, semantic=True)


def run_meanwhile(fn: Callable[[], object], threads: list[threading.Thread], wait_s: float = 0.5) -> None:
    """Start ``fn`` on another thread and give it ``wait_s`` to finish (it may be blocked on a lock:
    then it finishes once the caller lets go). The thread is appended to ``threads`` for joining."""
    t = threading.Thread(target=fn, daemon=True)
    threads.append(t)
    t.start()
    t.join(wait_s)


def join_all(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join(10)
        assert not t.is_alive()


def test_a_removal_during_a_lookup_leaves_no_stale_signatures(monkeypatch):
    idx = DonorIndex()
    idx.add(A, PRE, TOKENS_A)
    idx.add(B, PRE, TOKENS_B)
    real_stack, threads = np.stack, []

    def stack_then_remove(arrays, *a, **kw):  # another request forgets A while this one builds the matrix
        out = real_stack(arrays, *a, **kw)
        if not threads:
            run_meanwhile(lambda: idx.remove(A), threads)
        return out

    monkeypatch.setattr(donors_mod.np, "stack", stack_then_remove)
    idx.candidates(PRE, TOKENS_B, 0.3)
    join_all(threads)
    monkeypatch.setattr(donors_mod.np, "stack", real_stack)
    # the index now holds B only: its signatures must say so (a stale 2-row matrix indexed the 1-donor list)
    got = idx.candidates(PRE, TOKENS_B, 0.3)
    assert [(d.key, s) for d, s in got] == [(B, 1.0)]
    assert idx.candidates(PRE, TOKENS_A, 0.3) == []


def test_a_registration_during_a_lookup_is_found_by_the_next_one(monkeypatch):
    idx = DonorIndex()
    idx.add(A, PRE, TOKENS_A)
    real_stack, threads = np.stack, []

    def stack_then_add(arrays, *a, **kw):
        out = real_stack(arrays, *a, **kw)
        if not threads:
            run_meanwhile(lambda: idx.add(B, PRE, TOKENS_B), threads)
        return out

    monkeypatch.setattr(donors_mod.np, "stack", stack_then_add)
    idx.candidates(PRE, TOKENS_A, 0.3)
    join_all(threads)
    monkeypatch.setattr(donors_mod.np, "stack", real_stack)
    assert [d.key for d, _ in idx.candidates(PRE, TOKENS_B, 0.3)] == [B]


def test_a_registration_under_a_new_preamble_during_a_removal_is_kept():
    idx = DonorIndex()
    idx.add(A, PRE, TOKENS_A)
    threads: list[threading.Thread] = []

    class Key(bytes):  # read inside remove (with the index's lock held): another request registers then
        def __bytes__(self):
            if not threads:
                run_meanwhile(lambda: idx.add(B, [9, 9], TOKENS_B), threads)
            return bytes(bytearray(self))

        __hash__ = bytes.__hash__

    assert idx.remove(StoreKey(Key(A)))  # was: RuntimeError, dictionary changed size during iteration
    join_all(threads)
    assert A not in idx and B in idx and len(idx) == 1
    assert [d.key for d, _ in idx.candidates([9, 9], TOKENS_B, 0.3)] == [B]


def test_a_registration_during_the_index_first_use_reaches_the_log(tmp_path, monkeypatch):
    disk = DiskStore(tmp_path)
    donors = Donors(disk, '{"p":1}', enabled=True)
    real_attach, threads = DonorIndex.attach_log, []

    def attach_with_a_registration_meanwhile(self, tiers, name, verify=None):  # another request's first use
        if not threads:
            run_meanwhile(lambda: donors.register(B, PRE, TOKENS_B), threads)
        return real_attach(self, tiers, name)  # these keys are made up: unverified

    monkeypatch.setattr(DonorIndex, "attach_log", attach_with_a_registration_meanwhile)
    assert donors.register(A, PRE, TOKENS_A)
    join_all(threads)
    monkeypatch.setattr(DonorIndex, "attach_log", real_attach)
    assert A in donors.index and B in donors.index
    fresh = DonorIndex()  # a new process over the same store finds both
    assert fresh.attach_log([DiskStore(tmp_path)], donors.log_name) == 2


def test_concurrent_registrations_lookups_and_removals_stay_consistent():
    idx = DonorIndex()
    errors: list[BaseException] = []
    keys = [StoreKey(bytes([i]) * 32) for i in range(1, 41)]

    def worker(offset: int) -> None:
        try:
            for i, k in enumerate(keys[offset::4]):
                pre = [offset, i % 3]
                toks = list(range(k[0] * 100, k[0] * 100 + 40))
                idx.add(k, pre, toks)
                idx.candidates(pre, toks, 0.3)
                if i % 2:
                    idx.remove(k)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(o,)) for o in range(4)]
    for t in threads:
        t.start()
    join_all(threads)
    assert errors == []
    live = [k for o in range(4) for i, k in enumerate(keys[o::4]) if not i % 2]
    assert len(idx) == len(live) and all(k in idx for k in live)
    for o in range(4):
        for i, k in enumerate(keys[o::4]):
            toks = list(range(k[0] * 100, k[0] * 100 + 40))
            found = [d.key for d, _ in idx.candidates([o, i % 3], toks, 0.99)]
            assert found == ([k] if not i % 2 else []), (o, i)


# ---- the opt-in ------------------------------------------------------------------------------


def test_disabled_donors_never_lend_kv_even_with_an_index_in_hand():
    prov = '{"p":1}'
    store = MemoryStore()
    k = torch.ones(2, 1, len(TOKENS_A), 4)
    a = canonical_key_of(provenance_digest(prov), token_digest(PRE), token_digest(TOKENS_A))  # a real donor's key
    store.put(Namespace.CANONICAL, a, KVEntry(k, k.clone(), prov))
    idx = DonorIndex()
    idx.add(a, PRE, TOKENS_A)
    near = TOKENS_A[:40] + [7] + TOKENS_A[41:]
    on = Donors(store, prov, enabled=True)
    on.use_index(idx)
    assert on.donor_kv(PRE, near, StoreKey(b"\x01" * 32)) is not None  # the same call, opted in
    off = Donors(store, prov, enabled=False)  # the engine did not enable experimental_semantic
    off.use_index(idx)  # e.g. a saved index loaded beside the store
    assert off.donor_kv(PRE, near, StoreKey(b"\x01" * 32)) is None
    assert not off.register(B, PRE, TOKENS_B) and B not in idx


def test_the_index_holds_at_most_max_donors_the_oldest_leaving_memory_only(tmp_path):
    from blend.store.disk import DiskStore
    disk = DiskStore(tmp_path)
    idx = DonorIndex(max_donors=2)
    idx.attach_log([disk], "donors-t")
    keys = [StoreKey(bytes([i + 1]) * 32) for i in range(3)]
    for k in keys:
        idx.add(k, PRE, [k[0]] * 3 + TOKENS_A)
    assert len(idx) == 2 and keys[0] not in idx and keys[1] in idx and keys[2] in idx
    assert len(disk.read_records("donors-t")) == 3  # the log keeps every registration
    with pytest.raises(ValueError):
        DonorIndex(max_donors=0)


def test_the_index_holds_at_most_max_tokens_of_donors_the_oldest_leaving_memory_only(tmp_path):
    """The count alone bounded memory at 16,384 donors of any length: a token id costs ~37 bytes in memory,
    so documents of a few thousand tokens held GBs. The tokens held are bounded too; the log keeps them."""
    disk = DiskStore(tmp_path)
    idx = DonorIndex(max_tokens=250)
    idx.attach_log([disk], "donors-t")
    keys = [StoreKey(bytes([i + 1]) * 32) for i in range(4)]
    for i, k in enumerate(keys[:3]):
        idx.add(k, PRE, list(range(1000 * i, 1000 * i + 100)))
    assert len(idx) == 2 and keys[0] not in idx and keys[1] in idx and keys[2] in idx  # 300 tokens > 250
    assert idx.remove(keys[1]) and len(idx) == 1  # a removal frees its tokens: room for one more again
    idx.add(keys[3], PRE, list(range(5000, 5100)))
    assert keys[2] in idx and keys[3] in idx
    assert len(disk.read_records("donors-t")) == 5  # the log keeps every registration (and the removal)
    big = DonorIndex(max_tokens=10)
    assert big.add(A, PRE, TOKENS_A) and A in big  # one donor over the bound alone stays: the newest
    big.add(B, PRE, TOKENS_B)
    assert A not in big and B in big
    with pytest.raises(ValueError):
        DonorIndex(max_tokens=0)


def test_a_log_of_long_donors_is_compacted_before_it_passes_what_a_tier_reads(tmp_path, monkeypatch):
    """The growing log was compacted after as many appended lines as donors held (up to 16,384): lines of
    2k-token donors (~12 KB each) passed the 256 MiB a tier reads before that, the compaction then read
    nothing, the log grew for ever, and every new process loaded no donor. Scaled down here."""
    import blend.donor_records as R
    import blend.store.record_logs as RL

    monkeypatch.setattr(RL, "MAX_LOG_BYTES", 200_000)
    monkeypatch.setattr(R, "LOG_KEEP_BYTES", 50_000)
    monkeypatch.setattr(donors_mod, "COMPACT_APPEND_BYTES", 50_000, raising=False)
    disk = DiskStore(tmp_path)
    idx = DonorIndex(max_donors=1000)
    idx.attach_log([disk], "donors-t")
    for i in range(300):  # ~2.8 KB lines
        idx.add(StoreKey(i.to_bytes(32, "big")), PRE, list(range(i * 1000, i * 1000 + 500)))
        assert (tmp_path / "logs" / "donors-t.jsonl").stat().st_size <= RL.MAX_LOG_BYTES
    fresh = DonorIndex(max_donors=1000)
    loaded = fresh.attach_log([disk], "donors-t")
    assert loaded >= 10  # the most recent donors within what a compaction keeps (lines of ~3.5 KB)
    assert StoreKey((299).to_bytes(32, "big")) in fresh


def test_an_index_handed_in_keeps_logging_registrations_and_removals(tmp_path):
    """use_index (a saved index loaded beside the store) swapped in an index attached to no log: from then on
    this engine's registrations never reached the donor log, and a deleted document's removal was not logged
    either, so its donor (tokens included) stayed live for every other process, even after a purge."""
    import json

    prov = json.dumps({"model": "x"})
    digest = provenance_digest(prov)
    key_of = lambda ids: StoreKey(canonical_key_of(digest, token_digest(PRE), token_digest(ids)))  # noqa: E731
    tokens_c = list(range(900, 980))
    disk = DiskStore(tmp_path / "s")
    donors = Donors(disk, prov, enabled=True)
    assert donors.register(key_of(TOKENS_A), PRE, TOKENS_A)  # logged by the index attached on first use
    saved = DonorIndex()
    saved.add(key_of(TOKENS_B), PRE, TOKENS_B)
    saved.save(tmp_path / "index.json")
    donors.use_index(DonorIndex.load(tmp_path / "index.json"))
    donors.forget(key_of(TOKENS_A))  # its document was deleted
    assert donors.register(key_of(tokens_c), PRE, tokens_c)
    assert donors.purge_logs()
    fresh = Donors(disk, prov, enabled=True).index  # another process over the same store
    assert key_of(TOKENS_A) not in fresh and key_of(tokens_c) in fresh


# ---- a donor's KV missing: definite misses only, and only once the miss has lasted -------------------------

def _semantic_setup(engine):
    """Store two documents' canonical KV (registered as donors) and a near-duplicate of the second.

    Returns:
        (the second document's canonical key, the prompt with its near-duplicate).
    """
    from blend.keys import canonical_key
    from test_semantic import edit_middle  # the one near-duplicate recipe

    docs = make_docs(2)
    engine.precompute_chunks(docs)  # registers them (the engine's hook)
    orig = engine.build_prompt("Which?", docs)
    key = canonical_key(engine.provenance, orig.preamble.token_ids, orig.documents[1].token_ids)
    return key, engine.build_prompt("Which?", [docs[0], edit_middle(docs[1])[0]])


def _removals(disk: DiskStore, name: str) -> list[bytes]:
    return [ln for ln in disk.read_records(name) if ln.startswith(b'{"remove"')]


def test_a_donor_whose_kv_a_tier_cannot_look_up_is_skipped_never_removed_for_every_process(tmp_path,
                                                                                         tiny_engine_factory):
    """During a Redis outage a donor's KV (gone from the faster tiers) looked missing: the donor was dropped
    and its removal written to the shared donor log, so every process lost it for good. A tier that cannot
    answer only skips the donor for this request; the log and this process keep it."""
    from _store_util import free_port
    from blend.store.redis_store import RedisStore
    from blend.store.tiered import TieredStore

    mem, disk = MemoryStore(), DiskStore(tmp_path)
    down = RedisStore(f"redis://127.0.0.1:{free_port()}", connect_timeout_s=0.05)  # nothing listens there
    eng = tiny_engine_factory(experimental_semantic=True, store=TieredStore([mem, disk, down], write_behind=False))
    key, edited = _semantic_setup(eng)
    mem.delete(Namespace.CANONICAL, key)
    disk.delete(Namespace.CANONICAL, key)  # only Redis could hold it now, and it does not answer
    ans = eng.generate(edited, SEM0, max_new_tokens=1)
    assert ans.report.segments[2].reuse_class is ReuseClass.COMPUTED  # skipped for this request ...
    assert key in eng.segments.donors.index  # ... kept here ...
    assert _removals(disk, eng.segments.donors.log_name) == []  # ... and for every other process
    assert key in tiny_engine_factory(experimental_semantic=True, store=DiskStore(tmp_path)).segments.donors.index


def test_a_donor_logged_before_its_kv_lands_is_removed_only_once_the_miss_has_lasted(tmp_path, tiny_engine_factory,
                                                                                   monkeypatch):
    """A process logs a registration before its write-behind put reaches the shared tiers; another that read
    the log meanwhile found no KV and logged a removal at once, cancelling the donor for every process
    while its KV was landing. A definite miss only skips the donor until it has lasted absent_grace_s."""
    import blend.semantic as S
    from blend.keys import canonical_key

    writer = tiny_engine_factory(experimental_semantic=True, store=DiskStore(tmp_path))
    key, edited = _semantic_setup(writer)
    stored = writer.store.get(Namespace.CANONICAL, key, writer.provenance_json).entry
    writer.store.delete(Namespace.CANONICAL, key)  # as if its put were still in the writer's queue
    reader = tiny_engine_factory(experimental_semantic=True, store=DiskStore(tmp_path))
    assert key in reader.segments.donors.index
    own = canonical_key(reader.provenance, edited.preamble.token_ids, edited.documents[1].token_ids)

    def ask() -> ReuseClass:
        got = reader.generate(edited, SEM0, max_new_tokens=1).report.segments[2].reuse_class
        reader.store.delete(Namespace.CANONICAL, own)  # computed and stored: the next ask looks for a donor again
        return got

    now = [1000.0]
    monkeypatch.setattr(S.time, "monotonic", lambda: now[0])
    assert ask() is ReuseClass.COMPUTED
    assert key in reader.segments.donors.index and _removals(DiskStore(tmp_path), writer.segments.donors.log_name) == []
    writer.store.put(Namespace.CANONICAL, key, stored)  # the write lands
    now[0] += 10
    assert ask() is ReuseClass.SEMANTIC
    # evicted for real: skipped at the first look, forgotten (and logged) at a look absent_grace_s later
    writer.store.delete(Namespace.CANONICAL, key)
    assert ask() is ReuseClass.COMPUTED and key in reader.segments.donors.index
    now[0] += reader.segments.donors.absent_grace_s
    assert ask() is ReuseClass.COMPUTED and key not in reader.segments.donors.index
    assert len(_removals(DiskStore(tmp_path), writer.segments.donors.log_name)) == 1


# ---- a log already past what a tier reads ---------------------------------------------------------------

def test_a_donor_log_past_what_a_tier_reads_is_trimmed_to_its_newest_donors_and_loads(tmp_path, monkeypatch, caplog):
    """A log over the 256 MiB a tier reads (from before compactions bounded it, or grown by many processes
    appending) was never read nor compacted again: every process loaded no donor, for good. Its newest
    records (the last OVERSIZED_KEEP_BYTES, from the first whole line) replace it, with a warning, and load.
    Scaled down here."""
    import logging

    import blend.store.record_logs as RL
    from blend.donor_records import Registration, removal_record

    monkeypatch.setattr(RL, "MAX_LOG_BYTES", 20_000)
    monkeypatch.setattr(RL, "OVERSIZED_KEEP_BYTES", 5_000)
    keys = [StoreKey(i.to_bytes(32, "big")) for i in range(100)]
    rows = [Registration(k, token_digest(PRE), tuple(range(i * 100, i * 100 + 40))).record()
            for i, k in enumerate(keys)]
    rows.append(removal_record(keys[-1]))  # the newest record: a removal, kept with the rest of the tail
    path = tmp_path / "logs" / "donors-t.jsonl"
    path.parent.mkdir()
    path.write_bytes(b"".join(r + b"\n" for r in rows))
    assert path.stat().st_size > RL.MAX_LOG_BYTES
    fresh = DonorIndex()
    with caplog.at_level(logging.WARNING):
        loaded = fresh.attach_log([DiskStore(tmp_path)], "donors-t")
    assert "older records were dropped" in caplog.text and "unreadable" not in caplog.text  # no torn first line
    assert 10 < loaded < 99 and keys[-2] in fresh and keys[-1] not in fresh and keys[0] not in fresh
    assert path.stat().st_size <= RL.OVERSIZED_KEEP_BYTES  # the log is back under the cap, for every process
    assert DonorIndex().attach_log([DiskStore(tmp_path)], "donors-t") == loaded  # read as it is now, whole


# ---- a saved index is read within what an index holds -------------------------------------------------

def test_loading_a_saved_index_of_more_donors_than_an_index_holds_stops_before_any_signature(tmp_path, monkeypatch):
    """DonorIndex.load read up to 1 GiB, built every row and computed every row's signature before the caps
    dropped the extras: a crafted near-1 GiB file cost 10-20 GB. It reads no more than an index of the caps
    can hold, parses row by row, and stops at the first row past them with a DonorRecordError."""
    import json

    import blend.donor_records as R
    from blend.defaults import DEFAULT_MAX_DONORS
    from blend.donor_records import DonorRecordError, saved_index_max_bytes

    signed = []
    real = R.minhash
    monkeypatch.setattr(R, "minhash", lambda ids: signed.append(1) or real(ids))
    row = lambda i: {"key": i.to_bytes(32, "big").hex(), "preamble": "00" * 32, "tokens": [i % 50_000]}  # noqa: E731
    path = tmp_path / "donors.json"
    rows = [row(i) for i in range(DEFAULT_MAX_DONORS + 1)]  # one more than an index holds
    path.write_text(json.dumps({"shingle": 5, "num_hashes": 64, "donors": rows}))
    with pytest.raises(DonorRecordError, match="holds more than an index does") as e:
        DonorIndex.load(path)
    assert str(path) in str(e.value) and signed == []
    with open(path, "r+b") as f:  # a file larger than such an index's bytes is not read at all
        f.truncate(saved_index_max_bytes(DEFAULT_MAX_DONORS, 1 << 23) + 1)
    with pytest.raises(DonorRecordError, match="FileTooLargeError"):
        DonorIndex.load(path)
    small = tmp_path / "small.json"  # within the caps, whitespace and field order as any JSON writer's
    small.write_text('{ "donors" : [ %s ,\n %s ] , "shingle": 5 }' % (json.dumps(row(1)), json.dumps(row(2))))
    assert len(DonorIndex.load(small)) == 2 and len(signed) == 2
    with pytest.raises(DonorRecordError, match="holds more than"):
        DonorIndex.load(small, max_donors=1)
