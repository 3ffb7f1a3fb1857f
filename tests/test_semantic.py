"""Semantic (donor) reuse: the gate, exactness limits, forced edits, and store isolation."""

import os
import subprocess
import sys

import pytest
import torch

from blend.donors import DonorIndex
from blend.minhash import jaccard_estimate, minhash
from blend.errors import InvalidPolicyError
from blend.keys import Namespace, StoreKey, canonical_key, key_hex
from blend.policy import ReusePolicy
from blend.prompt import document_ids
from blend.report import ReuseClass
from blend.semantic import FORCE_WINDOW, MIN_ALIGNED, align
from conftest import make_docs, unguarded_blend

SEM0 = unguarded_blend(ratio=0.0, semantic=True)


@pytest.fixture
def sem_engine(tiny_engine_factory):
    return tiny_engine_factory(experimental_semantic=True)


def classes(ans):
    return [s.reuse_class for s in ans.report.segments]


def store_originals(engine, docs):
    """Precompute canonical KV of ``docs`` and register them as donors (the engine hook's job)."""
    engine.precompute_chunks(docs)
    prompt = engine.build_prompt("Which?", docs)
    for d in prompt.documents:
        engine.segments.register_donor(prompt.preamble.token_ids, d.token_ids)
    return prompt


def edit_middle(text: str) -> tuple[str, int]:
    """Replace one byte in the middle of a word; returns the text and the byte offset."""
    i = len(text) // 2
    while not text[i].isalpha():
        i += 1
    return text[:i] + ("z" if text[i] != "z" else "y") + text[i + 1:], i


def snapshot(store) -> dict:
    out = {}
    for ns in Namespace:
        for key in store.keys(ns):
            e = store._data[(ns, bytes(key))]  # memory tier: read without touching LRU order or stats
            out[(ns, bytes(key))] = (e.k.numpy().tobytes(), e.v.numpy().tobytes(), e.provenance)
    return out


# ---- the gate ---------------------------------------------------------------------------------


def test_semantic_policy_needs_the_engine_flag(tiny_engine):
    prompt = tiny_engine.build_prompt("Which?", make_docs(2))
    with pytest.raises(InvalidPolicyError, match="experimental"):
        tiny_engine.generate(prompt, unguarded_blend(semantic=True), max_new_tokens=1)
    assert tiny_engine.segments.register_donor(prompt.preamble.token_ids, prompt.documents[0].token_ids) is False
    assert len(tiny_engine.segments.donors.index) == 0
    with pytest.raises(InvalidPolicyError):
        ReusePolicy.exact().__class__(semantic=True)  # semantic outside blend mode


def test_semantic_policy_needs_the_engine_flag_whatever_the_prompts_length(tiny_engine_factory):
    """A dynamic-NTK model past its trained length refuses reuse for that prompt: a semantic policy on an
    engine without the flag was answered (every segment 'fallback') there, and refused only below it."""
    eng = tiny_engine_factory("tiny-llama-rope-dynamic")
    past = eng.runner.rope.length_dependent_after
    prompt = eng.build_prompt("Which?", make_docs(2, words=60))  # byte-level: ~900 tokens
    assert len(prompt) > past
    with pytest.raises(InvalidPolicyError, match="experimental"):
        eng.generate(prompt, unguarded_blend(semantic=True), max_new_tokens=1)


def test_without_the_opt_in_a_near_duplicate_never_reuses_donor_kv(sem_engine):
    docs = make_docs(3)
    store_originals(sem_engine, docs)
    edited = list(docs)
    edited[1], _ = edit_middle(docs[1])
    prompt = sem_engine.build_prompt("Which?", edited)
    ans = sem_engine.generate(prompt, unguarded_blend(ratio=0.15), max_new_tokens=1)
    assert classes(ans)[1:-1] == [ReuseClass.EXACT, ReuseClass.COMPUTED, ReuseClass.BLENDED]
    assert "donor" not in ans.report.segments[2].note
    # what was stored for the edited document is its own full canonical computation
    key = canonical_key(sem_engine.provenance, prompt.preamble.token_ids, prompt.documents[1].token_ids)
    stored = sem_engine.store.get(Namespace.CANONICAL, key, sem_engine.provenance.canonical_json()).entry
    with torch.inference_mode():
        ref = sem_engine.segments.canonical_kv(prompt.preamble, prompt.documents[1].token_ids)
    assert torch.equal(stored.k, ref.k) and torch.equal(stored.v, ref.v)


# ---- limits ----------------------------------------------------------------------------------


@pytest.mark.parametrize("where", [0, 1])
def test_a_donor_under_a_key_that_is_not_its_canonical_key_is_never_used(tiny_engine_factory, where):
    """The same KV under another key (an alias registered as a donor) is not this document's KV as far
    as provenance can tell: only a donor whose key is the canonical key of its own preamble and
    tokens lends KV. (A genuine donor with identical tokens has the document's own key.)"""
    docs = make_docs(3)
    eng = tiny_engine_factory(experimental_semantic=True)
    prompt = eng.build_prompt("Which?", docs)
    eng.precompute_chunks(docs)
    ids = prompt.documents[where].token_ids
    own = canonical_key(eng.provenance, prompt.preamble.token_ids, ids)
    entry = eng.store.get(Namespace.CANONICAL, own, eng.provenance.canonical_json()).entry
    alias = StoreKey(bytes(32))
    eng.store.put(Namespace.CANONICAL, alias, entry)
    eng.store.delete(Namespace.CANONICAL, own)
    assert eng.segments.register_donor(prompt.preamble.token_ids, ids, key=alias)

    sem = eng.generate(prompt, unguarded_blend(ratio=0.15, semantic=True), max_new_tokens=1)
    rep = sem.report.segments[1 + where]
    assert rep.reuse_class is ReuseClass.COMPUTED and key_hex(alias) not in rep.note


def test_ratio_one_semantic_equals_full_prefill(sem_engine):
    docs = make_docs(3)
    store_originals(sem_engine, docs)
    edited = list(docs)
    edited[0], _ = edit_middle(docs[0])
    edited[2] = docs[2][:60] + " lantern inserted here " + docs[2][60:]
    prompt = sem_engine.build_prompt("Which?", edited)
    full = sem_engine.generate(prompt, ReusePolicy.none(), max_new_tokens=1)
    sem = sem_engine.generate(prompt, unguarded_blend(ratio=1.0, semantic=True), max_new_tokens=1)
    assert classes(sem)[1:-1] == [ReuseClass.SEMANTIC, ReuseClass.BLENDED, ReuseClass.SEMANTIC]
    assert (sem.first_logits - full.first_logits).abs().max() <= 1e-4
    assert sem.report.recomputed_tokens == sum(len(d) for d in prompt.documents)  # every row, doc 1 included


def test_one_token_edit_recomputes_that_token_and_its_window(sem_engine):
    docs = make_docs(3)
    store_originals(sem_engine, docs)
    edited = list(docs)
    edited[1], at = edit_middle(docs[1])  # byte-level tokenizer: byte offset == token offset
    prompt = sem_engine.build_prompt("Which?", edited)
    ans = sem_engine.generate(prompt, SEM0, max_new_tokens=1)
    rep = ans.report.segments[2]
    assert rep.reuse_class is ReuseClass.SEMANTIC
    # ratio 0: the only document rows recomputed are the forced ones
    assert rep.recomputed == 2 * FORCE_WINDOW + 1
    assert ans.report.recomputed_tokens == rep.recomputed
    # the forced rows' KV did not come from the store: not counted as reused
    assert rep.forced == rep.recomputed and rep.to_dict()["forced"] == rep.forced
    assert rep.reused == rep.tokens - rep.forced
    assert ans.report.reused_tokens == sum(s.tokens for s in ans.report.segments[:-1]) - rep.forced
    a = align(sem_engine.build_prompt("Which?", docs).documents[1].token_ids, prompt.documents[1].token_ids)
    assert a.forced.tolist() == list(range(at - FORCE_WINDOW, at + FORCE_WINDOW + 1))
    # the edited token's row was filled with zeros from the donor side: recomputed at every layer
    _, cache, _ = sem_engine.prefill(prompt, SEM0)
    row = rep.start + at
    for layer in range(sem_engine.dims.num_layers):
        assert cache.v[layer][:, row].abs().sum() > 0, layer


# ---- alignment -------------------------------------------------------------------------------


def test_alignment_of_insertions_deletions_and_clipping():
    donor = list(range(100, 140))  # 40 distinct tokens
    ins = donor[:20] + [7, 8, 9] + donor[20:]
    a = align(donor, ins, window=2)
    assert a.forced.tolist() == list(range(18, 25))  # 3 inserted + 2 each side
    assert a.edits == 1 and a.src.tolist()[:20] == list(range(20)) and a.dst.tolist()[20:] == list(range(23, 43))
    dele = donor[:10] + donor[15:]
    b = align(donor, dele, window=2)
    assert b.forced.tolist() == [8, 9, 10, 11]  # the seam of the deletion
    c = align(donor, [1] + donor[1:], window=4)  # edit at offset 0: window clipped at 0
    assert c.forced.tolist() == [0, 1, 2, 3, 4]
    same = align(donor, donor)
    assert same.forced.numel() == 0 and same.aligned_fraction == 1.0 and same.edits == 0


def test_threshold_respected_dissimilar_documents_get_no_donor(sem_engine):
    docs = make_docs(3)
    store_originals(sem_engine, docs)
    # same 20-word vocabulary, different text: chance shingle overlap, but almost nothing aligns
    others = make_docs(3, seed=7)
    unrelated = "0123456789 " * 25
    prompt = sem_engine.build_prompt("Which?", [docs[0], others[1], unrelated])
    ans = sem_engine.generate(prompt, SEM0, max_new_tokens=1)
    assert classes(ans)[1:-1] == [ReuseClass.EXACT, ReuseClass.COMPUTED, ReuseClass.COMPUTED]
    pre = prompt.preamble.token_ids
    stored = sem_engine.build_prompt("Which?", docs).documents
    assert align(stored[1].token_ids, prompt.documents[1].token_ids).aligned_fraction < MIN_ALIGNED
    own = canonical_key(sem_engine.provenance, pre, prompt.documents[2].token_ids)
    # the unrelated document is itself registered once computed; no *other* chunk qualifies
    assert [c for c in sem_engine.segments.donors.index.candidates(pre, prompt.documents[2].token_ids, 0.3)
            if bytes(c[0].key) != bytes(own)] == []


def test_report_labels_the_segment_with_donor_similarity_and_aligned_fraction(sem_engine):
    docs = make_docs(2)
    orig = store_originals(sem_engine, docs)
    edited = [docs[0], docs[1].replace(" ", "  ", 1)]  # one inserted byte
    prompt = sem_engine.build_prompt("Which?", edited)
    ans = sem_engine.generate(prompt, SEM0, max_new_tokens=1)
    rep = ans.report.segments[2]
    d = rep.to_dict()
    assert d["class"] == "semantic" and ans.report.to_dict()["segments"][2]["class"] == "semantic"
    donor_key = canonical_key(sem_engine.provenance, orig.preamble.token_ids, orig.documents[1].token_ids)
    assert f"donor {key_hex(donor_key)}" in rep.note
    assert "similarity 0.9" in rep.note and "aligned 0.9" in rep.note
    assert rep.key == key_hex(canonical_key(sem_engine.provenance, prompt.preamble.token_ids,
                                            prompt.documents[1].token_ids))
    assert ans.report.reused_tokens > len(prompt.preamble) + len(prompt.documents[0])
    # the edited rows are recomputed on top of the (here empty) selection: the share says so, not the 0.0 asked
    base = sum(len(d) for d in prompt.documents)
    assert rep.forced > 0 and ans.report.ratio == pytest.approx(rep.forced / base) == ans.report.spent


# ---- store isolation -------------------------------------------------------------------------


def test_store_is_byte_identical_after_semantic_requests_and_later_full_compute(sem_engine):
    docs = make_docs(3)
    store_originals(sem_engine, docs)
    edited = list(docs)
    edited[2], _ = edit_middle(docs[2])
    prompt = sem_engine.build_prompt("Which?", edited)
    before = snapshot(sem_engine.store)
    for policy in (SEM0, unguarded_blend(ratio=0.15, semantic=True), unguarded_blend(ratio=1.0, semantic=True)):
        ans = sem_engine.generate(prompt, policy, max_new_tokens=3)
        assert ans.report.segments[3].reuse_class is ReuseClass.SEMANTIC
    assert snapshot(sem_engine.store) == before
    assert list(sem_engine.store.keys(Namespace.APPROX)) == []
    # the edited document is stored canonically only when a request computes it in full
    plain = sem_engine.generate(prompt, unguarded_blend(ratio=0.15), max_new_tokens=1)
    assert plain.report.segments[3].reuse_class is ReuseClass.COMPUTED
    key = canonical_key(sem_engine.provenance, prompt.preamble.token_ids, prompt.documents[2].token_ids)
    stored = sem_engine.store.get(Namespace.CANONICAL, key, sem_engine.provenance.canonical_json()).entry
    with torch.inference_mode():
        ref = sem_engine.segments.canonical_kv(prompt.preamble, prompt.documents[2].token_ids)
    assert torch.equal(stored.k, ref.k) and torch.equal(stored.v, ref.v)
    again = sem_engine.generate(prompt, SEM0, max_new_tokens=1)  # own entry now: no donor needed
    assert again.report.segments[3].reuse_class is ReuseClass.BLENDED


def test_evicted_donor_is_skipped_and_forgotten(sem_engine):
    docs = make_docs(2)
    orig = store_originals(sem_engine, docs)
    key = canonical_key(sem_engine.provenance, orig.preamble.token_ids, orig.documents[1].token_ids)
    sem_engine.store.delete(Namespace.CANONICAL, key)
    edited = [docs[0], edit_middle(docs[1])[0]]
    ans = sem_engine.generate(sem_engine.build_prompt("Which?", edited), SEM0, max_new_tokens=1)
    assert ans.report.segments[2].reuse_class is ReuseClass.COMPUTED
    assert key not in sem_engine.segments.donors.index


def test_alignment_work_is_bounded_and_an_evicted_donor_is_never_aligned(sem_engine, monkeypatch):
    """difflib's matcher is quadratic on repetitive text (an 8k-token alignment took seconds), and every
    candidate was aligned before its KV was looked up: a miss could cost far more than computing it. The
    bound is on the matcher's work, not the lengths: ordinary text of 8k tokens still aligns."""
    import blend.semantic as S

    docs = make_docs(2)
    orig = store_originals(sem_engine, docs)
    aligned = []
    real = S.align
    monkeypatch.setattr(S, "align", lambda a, b, *r: aligned.append(tuple(a)) or real(a, b, *r))
    edited = [docs[0], edit_middle(docs[1])[0]]
    pairs = S.match_pairs(orig.documents[1].token_ids, sem_engine.build_prompt("Which?", edited).documents[1].token_ids)
    monkeypatch.setattr(S, "MAX_ALIGN_PAIRS", pairs - 1)  # less than one alignment: computed, never aligned
    ans = sem_engine.generate(sem_engine.build_prompt("Which?", edited), SEM0, max_new_tokens=1)
    assert ans.report.segments[2].reuse_class is ReuseClass.COMPUTED and aligned == []
    monkeypatch.setattr(S, "MAX_ALIGN_PAIRS", 1 << 21)
    edited2 = [docs[0], edit_middle(edit_middle(docs[1])[0][::-1])[0][::-1]]  # another near-duplicate
    key = canonical_key(sem_engine.provenance, orig.preamble.token_ids, orig.documents[1].token_ids)
    sem_engine.store.delete(Namespace.CANONICAL, key)  # the donor's KV is gone: dropped before any alignment
    ans = sem_engine.generate(sem_engine.build_prompt("Which?", edited2), SEM0, max_new_tokens=1)
    assert key not in sem_engine.segments.donors.index and tuple(orig.documents[1].token_ids) not in aligned


def test_a_donor_entry_of_another_shape_is_dropped_and_the_next_donor_seeds(sem_engine):
    """A corrupt store: the best donor's entry has the wrong head dim. It is forgotten and the next
    donor seeds the document (before, the document was computed in full)."""
    docs = make_docs(2)
    variant = docs[1].replace(" ", "  ", 1)  # another near-duplicate of the same document
    orig = store_originals(sem_engine, [docs[0], docs[1], variant])
    best, other = (canonical_key(sem_engine.provenance, orig.preamble.token_ids, d.token_ids) for d in orig.documents[1:])
    good = sem_engine.store.get(Namespace.CANONICAL, best, sem_engine.provenance_json).entry
    L, H, T, D = good.k.shape
    bad = torch.zeros(L, H, T, 2 * D)
    sem_engine.store.put(Namespace.CANONICAL, best, type(good)(bad, bad, good.provenance))
    edited = [docs[0], edit_middle(docs[1])[0]]  # one byte from docs[1], two edits from the variant
    ans = sem_engine.generate(sem_engine.build_prompt("Which?", edited), SEM0, max_new_tokens=1)
    rep = ans.report.segments[2]
    assert rep.reuse_class is ReuseClass.SEMANTIC and f"donor {key_hex(other)}" in rep.note
    assert best not in sem_engine.segments.donors.index and other in sem_engine.segments.donors.index


# ---- donor index -----------------------------------------------------------------------------


def test_minhash_is_deterministic_across_processes_and_estimates_jaccard(tmp_path):
    ids = list(range(1000, 1300))
    code = "from blend.minhash import minhash; print(minhash(list(range(1000, 1300))).tolist())"
    env = {**os.environ, "PYTHONHASHSEED": "123"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == str(minhash(ids).tolist())
    half = ids[:150] + list(range(5000, 5150))  # true 5-gram Jaccard = 146 / (296 + 296 - 146)
    assert abs(jaccard_estimate(minhash(ids), minhash(half)) - 146 / 446) < 0.15
    assert jaccard_estimate(minhash(ids), minhash(ids)) == 1.0


def test_donor_index_save_load_and_preamble_scoping(tmp_path, sem_engine):
    idx = DonorIndex()
    a = list(range(200))
    assert idx.add(StoreKey(b"a" * 32), [1, 2], a) and not idx.add(StoreKey(b"a" * 32), [1, 2], a)
    idx.add(StoreKey(b"b" * 32), [1, 2], list(range(500, 700)))
    idx.add(StoreKey(b"c" * 32), [9], a)  # same tokens after another preamble: not a donor for [1, 2]
    near = a[:100] + [7] + a[101:]
    got = idx.candidates([1, 2], near, 0.3)
    assert [d.key for d, _ in got] == [StoreKey(b"a" * 32)]
    idx.save(tmp_path / "donors.json")
    back = DonorIndex.load(tmp_path / "donors.json")
    assert len(back) == 3
    assert [(d.key, s) for d, s in back.candidates([1, 2], near, 0.3)] == [(d.key, s) for d, s in got]
    sem_engine.segments.donors.use_index(back)
    assert sem_engine.segments.donors.index is back


def test_a_saved_index_row_whose_key_is_another_chunks_is_never_lent(tmp_path, sem_engine):
    """A saved index is untrusted input: a row pairing chunk A's key with B's tokens (B = A with
    one byte changed) would otherwise lend A's KV to B as B's own canonical KV, nothing recomputed
    (and a conversation would then store turns computed over it under exact keys)."""
    a_text = make_docs(1)[0]
    b_text, _ = edit_middle(a_text)
    store_originals(sem_engine, [a_text])
    pa, pb = sem_engine.build_prompt("Which?", [a_text]), sem_engine.build_prompt("Which?", [b_text])
    key_a = canonical_key(sem_engine.provenance, pa.preamble.token_ids, pa.documents[0].token_ids)
    forged = DonorIndex()
    forged.add(key_a, pb.preamble.token_ids, pb.documents[0].token_ids)
    forged.save(tmp_path / "donors.json")
    sem_engine.segments.donors.use_index(DonorIndex.load(tmp_path / "donors.json"))
    ans = sem_engine.generate(pb, SEM0, max_new_tokens=1)
    assert classes(ans)[1] is ReuseClass.COMPUTED  # the forged donor is dropped, B computed
    left = sem_engine.segments.donors.index.candidates(pb.preamble.token_ids, pb.documents[0].token_ids, 0.0, top=9)
    assert key_a not in [d.key for d, _ in left]  # dropped from the index (B itself is registered now)


# ---- persisted donors ------------------------------------------------------------------------


def test_donors_persist_beside_a_disk_store_for_a_new_process(tmp_path, tiny_engine_factory):
    from blend.store.disk import DiskStore
    from blend.store.memory import MemoryStore
    from blend.store.tiered import TieredStore

    docs = make_docs(3)
    first = tiny_engine_factory(experimental_semantic=True, store=TieredStore([MemoryStore(), DiskStore(tmp_path)]))
    first.precompute_chunks(docs)  # registers donors: appended to the disk tier's record log
    assert len(first.segments.donors.index) == 3
    log = DiskStore(tmp_path).read_records(first.segments.donors.log_name)
    assert len(log) == 3
    # a fresh engine over the same folder finds the donors without registering anything
    second = tiny_engine_factory(experimental_semantic=True, store=DiskStore(tmp_path))
    edited = [docs[0], edit_middle(docs[1])[0], docs[2]]
    ans = second.generate(second.build_prompt("Which?", edited), SEM0, max_new_tokens=1)
    assert ans.report.segments[2].reuse_class is ReuseClass.SEMANTIC
    assert len(second.segments.donors.index) == 3
    # another provenance (dtype) has its own log: it sees none of these donors
    other = tiny_engine_factory(experimental_semantic=True, store=DiskStore(tmp_path), dtype="bfloat16")
    assert other.segments.donors.log_name != first.segments.donors.log_name and len(other.segments.donors.index) == 0


def test_a_served_engine_over_a_flight_store_keeps_the_donor_log(tmp_path, tiny_engine_factory):
    """kvblend serve wraps its store in a FlightStore (single-flight): the donor log of the tiers under it is
    read and written as for a plain engine (it was never attached: no donor survived a server's restart)."""
    from blend.serve.flight import FlightStore
    from blend.store.disk import DiskStore
    from blend.store.memory import MemoryStore
    from blend.store.tiered import TieredStore

    docs = make_docs(3)
    first = tiny_engine_factory(experimental_semantic=True, store=TieredStore([MemoryStore(), DiskStore(tmp_path)]))
    first.precompute_chunks(docs)
    served = tiny_engine_factory(experimental_semantic=True,
                                 store=FlightStore(TieredStore([MemoryStore(), DiskStore(tmp_path)])))
    assert len(served.segments.donors.index) == 3  # the log the plain engine wrote
    served.precompute_chunks(make_docs(2, seed=9))
    assert len(DiskStore(tmp_path).read_records(served.segments.donors.log_name)) == 5  # and its own go there


def test_a_donor_line_whose_key_is_not_its_tokens_canonical_key_is_skipped(tmp_path, tiny_engine_factory):
    """A line edited into another valid record (one token changed) would lend the KV under its key, unedited,
    to documents matching its tokens: its key is checked against its preamble and tokens."""
    import json

    from blend.store.disk import DiskStore

    eng = tiny_engine_factory(experimental_semantic=True, store=DiskStore(tmp_path))
    eng.precompute_chunks(make_docs(2))
    path = tmp_path / "logs" / f"{eng.segments.donors.log_name}.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[0]["tokens"][3] = (rows[0]["tokens"][3] + 1) % 256
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    again = tiny_engine_factory(experimental_semantic=True, store=DiskStore(tmp_path))
    assert len(again.segments.donors.index) == 1


def test_a_torn_last_line_does_not_swallow_the_next_record(tmp_path):
    from blend.store.record_logs import DiskRecordLogs

    logs = DiskRecordLogs(tmp_path)
    logs.append("x", b'{"a": 1}')
    with open(logs.path("x"), "ab") as f:
        f.write(b'{"b": {"c"')  # a writer died mid-line
    logs.append("x", b'{"d": 4}')
    assert logs.read("x") == [b'{"a": 1}', b'{"b": {"c"', b'{"d": 4}']  # the torn line alone is unreadable


def test_torn_and_corrupt_donor_lines_are_skipped(tmp_path, tiny_engine_factory):
    from blend.store.disk import DiskStore

    eng = tiny_engine_factory(experimental_semantic=True, store=DiskStore(tmp_path))
    eng.precompute_chunks(make_docs(2))
    path = tmp_path / "logs" / f"{eng.segments.donors.log_name}.jsonl"
    with open(path, "ab") as f:
        f.write(b'{"key": "zz", "preamble": "00", "tokens": [1]}\n')  # bad hex
        f.write(b'not json\n')
        f.write(b'{"key": "' + b"ab" * 32)  # torn: no newline
    again = tiny_engine_factory(experimental_semantic=True, store=DiskStore(tmp_path))
    assert len(again.segments.donors.index) == 2
    assert DiskStore(tmp_path).clear() >= 2 and not path.exists()  # clearing everything drops the logs


def test_a_forgotten_donor_stays_forgotten_in_a_new_process_until_registered_again(tmp_path, tiny_engine_factory):
    from blend.store.disk import DiskStore

    docs = make_docs(2)
    first = tiny_engine_factory(experimental_semantic=True, store=DiskStore(tmp_path))
    orig = store_originals(first, docs)
    pre, doc1 = orig.preamble.token_ids, orig.documents[1].token_ids
    key = canonical_key(first.provenance, pre, doc1)
    first.store.delete(Namespace.CANONICAL, key)  # evicted: the next semantic lookup forgets it
    first.segments.donors.absent_grace_s = 0  # at the first look (see test_donors.py for the grace)
    edited = [docs[0], edit_middle(docs[1])[0]]
    first.generate(first.build_prompt("Which?", edited), SEM0, max_new_tokens=1)
    assert key not in first.segments.donors.index
    rows = DiskStore(tmp_path).read_records(first.segments.donors.log_name)
    assert b'{"remove":"' + key_hex(key).encode() + b'"}' in rows
    second = tiny_engine_factory(experimental_semantic=True, store=DiskStore(tmp_path))
    assert len(second.segments.donors.index) == len(first.segments.donors.index) and key not in second.segments.donors.index
    # its KV comes back and it is registered again: a third process sees it
    first.precompute_chunks(docs)  # stores its KV again and registers it (the engine's hook)
    assert key in first.segments.donors.index and not first.segments.register_donor(pre, doc1)
    third = tiny_engine_factory(experimental_semantic=True, store=DiskStore(tmp_path))
    assert len(third.segments.donors.index) == len(second.segments.donors.index) + 1 and key in third.segments.donors.index


def test_bad_removal_records_are_skipped():
    class Log:
        def __init__(self, lines):
            self.lines = lines

        def append_record(self, log, line):
            self.lines.append(line)

        def read_records(self, log):
            return list(self.lines)

    a = DonorIndex()
    sink = Log([])
    a.attach_log([sink], "x")
    a.add(StoreKey(b"a" * 32), [1], list(range(50)))
    sink.lines += [b'{"remove": "00"}', b'{"remove": 5}', b"[1, 2]", b"7"]
    b = DonorIndex()
    assert b.attach_log([sink], "x") == 1 and StoreKey(b"a" * 32) in b


def test_a_log_of_mostly_dead_lines_is_compacted_as_it_grows_and_on_attach(tmp_path):
    from blend.donor_records import removal_record
    from blend.donors import COMPACT_MIN_LINES
    from blend.store.disk import DiskStore

    disk = DiskStore(tmp_path)
    first = DonorIndex()
    first.attach_log([disk], "donors-t")
    keep = [StoreKey(bytes([i]) * 32) for i in range(3)]
    for k in keep:
        first.add(k, [1], list(range(k[0], k[0] + 40)))
    churn = StoreKey(b"\xee" * 32)
    first.add(churn, [1], list(range(900, 940)))
    churn_line = disk.read_records("donors-t")[-1]
    first.remove(churn)
    for _ in range(3 * COMPACT_MIN_LINES):  # evicted and registered again, over and over, in this process
        first.add(churn, [1], list(range(900, 940)))
        first.remove(churn)
    # compacted as it grows (a long-running process never re-attaches; a log past its read cap is not read)
    assert 3 <= len(disk.read_records("donors-t")) <= COMPACT_MIN_LINES + 3
    for _ in range(COMPACT_MIN_LINES):  # another process's churn, appended raw: dead lines for the attach
        disk.append_record("donors-t", churn_line)
        disk.append_record("donors-t", removal_record(churn))
    before = disk.read_records("donors-t")
    assert len(before) >= COMPACT_MIN_LINES
    second = DonorIndex()
    assert second.attach_log([disk], "donors-t") == 3
    after = disk.read_records("donors-t")
    assert len(after) == 3 and all(k in second for k in keep) and churn not in second
    third = DonorIndex()  # the compacted log replays to the same donors
    assert third.attach_log([disk], "donors-t") == 3
    assert [d.key for d, _ in third.candidates([1], list(range(1, 41)), 0.3)] == \
        [d.key for d, _ in second.candidates([1], list(range(1, 41)), 0.3)]
    small = DonorIndex()  # a short log is left as it is
    small.attach_log([DiskStore(tmp_path / "s")], "donors-t")
    small.add(churn, [1], [1, 2, 3])
    small.remove(churn)
    DonorIndex().attach_log([DiskStore(tmp_path / "s")], "donors-t")
    assert len(DiskStore(tmp_path / "s").read_records("donors-t")) == 2


def test_a_donor_line_with_a_token_id_past_uint32_is_skipped_and_semantic_reuse_goes_on(tmp_path):
    """Store keys hash token ids as uint32: such a line passed the parser, then the canonical-key check
    raised OverflowError out of the index's first use, and again at every later request."""
    import json as _json

    from blend.donor_records import MAX_DONOR_TOKENS, DonorRecordError, parse_record
    from blend.semantic import Donors, donor_log_name
    from blend.store.disk import DiskStore
    prov = _json.dumps({"model": "x"})
    store = DiskStore(tmp_path / "s", fsync=False)
    line = _json.dumps({"key": "00" * 32, "preamble": "11" * 32, "tokens": [1, 2, 2**32]}).encode()
    with pytest.raises(DonorRecordError):
        parse_record(line)
    store.append_record(donor_log_name(prov), line)
    assert len(Donors(store, prov, enabled=True).index) == 0
    too_long = _json.dumps({"key": "00" * 32, "preamble": "11" * 32, "tokens": [1] * (MAX_DONOR_TOKENS + 1)}).encode()
    with pytest.raises(DonorRecordError, match="at most"):
        parse_record(too_long)


def test_deleting_a_donor_another_process_registered_since_this_one_read_the_log_removes_it(tmp_path,
                                                                                           tiny_engine_factory):
    """A semantic engine forgot (and logged the removal of) only the donors in its own memory: one another
    process registered after this one read the log stayed live there, tokens included, after the purge."""
    from blend.retrieval.engine_kv import engine_kv_deleter
    from blend.store.disk import DiskStore

    secret = "The vault code of the northern tower is 7 4 1 9, known only to the keeper of the lantern."
    a = tiny_engine_factory(experimental_semantic=True, store=DiskStore(tmp_path))
    assert len(a.segments.donors.index) == 0  # attached to the (empty) log
    b = tiny_engine_factory(experimental_semantic=True, store=DiskStore(tmp_path))
    b.precompute_chunks([secret])  # registered by the other process
    tokens = ",".join(map(str, document_ids(a.tokenizer, secret))).encode()
    logs = lambda: b"".join(f.read_bytes() for f in (tmp_path / "logs").rglob("*") if f.is_file())  # noqa: E731
    assert tokens in logs()
    deleter = engine_kv_deleter(a)
    assert deleter("cid", secret)
    deleter.finish()
    assert tokens not in logs()  # purged
    c = tiny_engine_factory(experimental_semantic=True, store=DiskStore(tmp_path))
    assert len(c.segments.donors.index) == 0


def test_a_compaction_keeps_the_most_recent_donors_within_the_cap_and_signs_only_those(tmp_path, monkeypatch):
    """Donors whose KV the store's budget evicted stayed live lines for ever: the log grew with every chunk
    ever seen until it passed the size a tier reads at all, and then no process loaded any donor. And every
    line was MinHashed on replay, the ones that would not be kept too."""
    import blend.donor_records as R
    import blend.donors as D
    from blend.store.disk import DiskStore

    disk = DiskStore(tmp_path)
    first = DonorIndex(max_donors=10)
    first.attach_log([disk], "donors-t")
    keys = [StoreKey(bytes([i]) * 32) for i in range(100)]
    for i, k in enumerate(keys):
        first.add(k, [1], list(range(i * 50, i * 50 + 40)))
    # memory capped; the log trimmed as it grows (to the 10 most recent at each periodic compaction)
    assert len(first) == 10 and 10 < len(disk.read_records("donors-t")) <= D.COMPACT_MIN_LINES + 10
    signed = []
    real = R.minhash  # a replay signs its donors in donor_records (Registration.donor)
    monkeypatch.setattr(R, "minhash", lambda t, *a: signed.append(1) or real(t, *a))
    second = DonorIndex(max_donors=10)
    assert second.attach_log([disk], "donors-t") == 10
    assert len(signed) == 10  # the kept donors only, not every line replayed
    assert [bytes(k) for k in keys[-10:]] == [bytes(r.key) for r in R.replay_records(disk.read_records("donors-t"))[0]]
    assert all(k in second for k in keys[-10:]) and keys[0] not in second
    first.add(keys[0], [1], list(range(40)))  # registered again: now the most recent
    third = DonorIndex(max_donors=10)
    third.attach_log([disk], "donors-t")
    assert keys[0] in third and keys[90] not in third  # the least recent left
    monkeypatch.setattr(R, "LOG_KEEP_BYTES", 3 * len(disk.read_records("donors-t")[0]) + 3)
    assert R.purge_log(disk, "donors-t", max_donors=10)  # the byte bound as well
    assert len(disk.read_records("donors-t")) == 3


def test_the_kept_log_is_well_under_what_a_tier_reads():
    from blend.donor_records import LOG_KEEP_BYTES
    from blend.donors import COMPACT_APPEND_BYTES
    from blend.store.record_logs import MAX_LOG_BYTES

    assert 4 * LOG_KEEP_BYTES <= MAX_LOG_BYTES
    # what a compaction keeps, plus what this process appends before the next one: half the cap at most
    assert 2 * (LOG_KEEP_BYTES + COMPACT_APPEND_BYTES) <= MAX_LOG_BYTES


def test_the_alignment_bound_follows_the_matchers_work_not_the_lengths():
    """A bound on donor x document tokens refused every near-duplicate over ~2k tokens, where ordinary text
    aligns in milliseconds; text whose tokens repeat is what costs (its pairs grow as n^2)."""
    from blend.semantic import MAX_ALIGN_PAIRS, match_pairs

    ordinary = [i % 5000 for i in range(0, 8192 * 7, 7)]  # 8k tokens, each id a handful of times
    periodic = [100, 101, 102] * 1400  # 4.2k tokens of a 3-token period
    assert match_pairs(ordinary, ordinary) < MAX_ALIGN_PAIRS < match_pairs(periodic, periodic)
    assert match_pairs([1, 1, 2], [1, 2, 2, 3]) == 2 * 1 + 1 * 2


def test_a_guarded_semantic_blend_reports_both_passes_forced_rows(sem_engine):
    """A guard that fired reported its own ratio (0.3) and spent (0 + 0.3): both passes' forced rows were
    left out, as every semantic blend's were before."""
    from blend.policy import ReusePolicy

    docs = make_docs(2)
    store_originals(sem_engine, docs)
    edited = [docs[0], edit_middle(docs[1])[0]]
    pol = ReusePolicy.blend(0.0, semantic=True, guard_margin=1e9, guard_ratio=0.3)
    rep = sem_engine.generate(sem_engine.build_prompt("Which?", edited), pol, max_new_tokens=1).report
    segs = [s for s in rep.segments if s.kind.value == "document"]
    base, forced = sum(s.tokens for s in segs), sum(s.forced for s in segs)
    assert rep.guard and forced > 0
    assert rep.ratio == pytest.approx(sum(s.recomputed for s in segs) / base) and rep.ratio > 0.3
    assert rep.spent == pytest.approx(forced / base + rep.ratio)  # the first pass recomputed its forced rows only
