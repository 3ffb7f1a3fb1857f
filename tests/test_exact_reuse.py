"""Invariant 2 for the exact path: cold equals warm bit for bit; the report says which."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from blend import kv_load
from blend.engine import Engine
from blend.keys import Namespace, key_hex
from blend.kvcache import KVEntry
from blend.policy import ReusePolicy
from blend.report import ReuseClass
from blend.store.memory import MemoryStore
from conftest import make_docs


def classes(ans):
    return [s.reuse_class for s in ans.report.segments]


def test_cold_equals_warm_bitwise_and_report(tiny_engine_factory):
    store = MemoryStore()
    cold_engine = tiny_engine_factory(store=store)
    prompt = cold_engine.build_prompt("What is listed?", make_docs(3))
    cold = cold_engine.generate(prompt, max_new_tokens=8, stop_at_newline=False)
    warm = cold_engine.generate(prompt, max_new_tokens=8, stop_at_newline=False)
    fresh = tiny_engine_factory().generate(prompt, max_new_tokens=8, stop_at_newline=False)
    shared = tiny_engine_factory(store=store).generate(prompt, max_new_tokens=8, stop_at_newline=False)
    for other in (warm, fresh, shared):
        assert torch.equal(cold.first_logits, other.first_logits)
        assert cold.token_ids == other.token_ids
        assert cold.logits_sha256() == other.logits_sha256()
    assert classes(cold) == [ReuseClass.COMPUTED] * 5
    assert classes(warm) == [ReuseClass.EXACT] * 4 + [ReuseClass.COMPUTED]
    assert classes(shared) == classes(warm)
    assert warm.report.reused_tokens == len(prompt) - len(prompt.question)


@pytest.mark.parametrize("kv_dtype", [None, "bfloat16"])
def test_no_reuse_is_the_exact_schedule_without_the_store(tiny_engine_factory, kv_dtype):
    eng = tiny_engine_factory(kv_dtype=kv_dtype)
    prompt = eng.build_prompt("Why?", make_docs(4))
    none = eng.generate(prompt, ReusePolicy.none(), max_new_tokens=6, stop_at_newline=False)
    assert eng.store.stats().entries == 0  # nothing looked up or stored
    cold = eng.generate(prompt, ReusePolicy.exact(), max_new_tokens=6, stop_at_newline=False)
    warm = eng.generate(prompt, ReusePolicy.exact(), max_new_tokens=6, stop_at_newline=False)
    for other in (cold, warm):
        assert torch.equal(none.first_logits, other.first_logits) and none.token_ids == other.token_ids
    n = len(prompt.segments)
    assert classes(none) == [ReuseClass.COMPUTED] * n and classes(warm) == [ReuseClass.EXACT] * (n - 1) + [ReuseClass.COMPUTED]


def test_one_pass_prefill_equals_the_segment_schedule_within_tolerance(tiny_engine):
    prompt = tiny_engine.build_prompt("Why?", make_docs(4))
    runner = tiny_engine.runner
    with torch.inference_mode():
        h, _ = runner.prefill(runner.new_cache(len(prompt)), runner.ids(prompt.token_ids), keep_kv=False)
    one_pass = runner.logits(h[-1:])[0]
    exact = tiny_engine.generate(prompt, ReusePolicy.exact(), max_new_tokens=1)
    assert (one_pass - exact.first_logits).abs().max() <= 1e-4


def test_warm_exact_equals_a_one_pass_prefill_and_transformers_within_tolerance(tiny_engine):
    """The warm exact run (every document loaded from the store) against two independent computations
    of the whole prompt in one pass: the runner's and transformers' own forward."""
    prompt = tiny_engine.build_prompt("Why?", make_docs(4))
    runner = tiny_engine.runner
    with torch.inference_mode():
        h, _ = runner.prefill(runner.new_cache(len(prompt)), runner.ids(prompt.token_ids), keep_kv=False)
        one_pass = runner.logits(h[-1:])[0]
        hf = runner.loaded.model(torch.tensor([prompt.token_ids])).logits[0, -1].float()
    tiny_engine.generate(prompt, ReusePolicy.exact(), max_new_tokens=1)  # cold: computes and stores
    warm = tiny_engine.generate(prompt, ReusePolicy.exact(), max_new_tokens=1)
    assert classes(warm) == [ReuseClass.EXACT] * (len(prompt.segments) - 1) + [ReuseClass.COMPUTED]
    assert warm.report.reused_tokens == len(prompt) - len(prompt.question)
    for ref in (one_pass, hf):
        assert (ref - warm.first_logits).abs().max() <= 1e-4


def test_prefix_is_chained_a_reordered_prompt_only_shares_the_preamble(tiny_engine):
    docs = make_docs(3)
    tiny_engine.generate(tiny_engine.build_prompt("Q?", docs), max_new_tokens=1)
    ans = tiny_engine.generate(tiny_engine.build_prompt("Q?", docs[::-1]), max_new_tokens=1)
    assert classes(ans)[:2] == [ReuseClass.EXACT, ReuseClass.COMPUTED]
    assert classes(ans)[2:4] == [ReuseClass.COMPUTED, ReuseClass.COMPUTED]


def test_prefix_limit_shares_only_the_preamble(tiny_engine):
    prompt = tiny_engine.build_prompt("Q?", make_docs(2))
    tiny_engine.generate(prompt, ReusePolicy.exact(prefix_limit=1), max_new_tokens=1)
    again = tiny_engine.generate(prompt, ReusePolicy.exact(prefix_limit=1), max_new_tokens=1)
    assert classes(again) == [ReuseClass.EXACT, ReuseClass.COMPUTED, ReuseClass.COMPUTED, ReuseClass.COMPUTED]
    assert len(list(tiny_engine.store.keys(Namespace.EXACT))) == 1


def test_reduced_precision_storage_cold_equals_warm(tiny_engine_factory):
    eng = tiny_engine_factory(kv_dtype="bfloat16")
    prompt = eng.build_prompt("Q?", make_docs(2))
    cold = eng.generate(prompt, max_new_tokens=4)
    warm = eng.generate(prompt, max_new_tokens=4)
    assert classes(warm)[0] is ReuseClass.EXACT
    assert torch.equal(cold.first_logits, warm.first_logits)
    key = next(eng.store.keys(Namespace.EXACT))
    assert eng.store.get(Namespace.EXACT, key, eng.provenance.canonical_json()).entry.k.dtype == torch.bfloat16


def test_rejected_entry_is_reported_and_recomputed(tiny_engine):
    from blend.store.base import KVEntry

    prompt = tiny_engine.build_prompt("Q?", make_docs(1))
    first = tiny_engine.generate(prompt, max_new_tokens=2)
    key = next(iter(tiny_engine.store.keys(Namespace.EXACT)))
    good = tiny_engine.store.get(Namespace.EXACT, key, tiny_engine.provenance.canonical_json()).entry
    # a collision: same key, different provenance
    tiny_engine.store.put(Namespace.EXACT, key, KVEntry(good.k, good.v, good.provenance + " "))
    again = tiny_engine.generate(prompt, max_new_tokens=2)
    assert ReuseClass.REJECTED in classes(again)
    assert torch.equal(first.first_logits, again.first_logits)


def test_stops_at_eos_and_max_tokens(tiny_engine):
    prompt = tiny_engine.build_prompt("Q?", make_docs(1))
    longer = tiny_engine.generate(prompt, max_new_tokens=6, stop_at_newline=False)
    assert len(longer.token_ids) == 6 and not set(longer.token_ids) & tiny_engine.eos_ids  # no EOS: the budget ends it
    ans = tiny_engine.generate(prompt, max_new_tokens=3, stop_at_newline=False)
    assert ans.token_ids == longer.token_ids[:3]  # max_new_tokens stops after exactly that many tokens
    # the third greedy token as an end-of-sequence token: decoding stops there and does not emit it
    eos = longer.token_ids[2]
    tiny_engine.eos_ids = tiny_engine.eos_ids | {eos}
    stopped = tiny_engine.generate(prompt, max_new_tokens=6, stop_at_newline=False)
    assert stopped.token_ids == longer.token_ids[:longer.token_ids.index(eos)]
    assert len(stopped.token_ids) < 6 and eos not in stopped.token_ids


def test_first_document_is_an_exact_hit_on_its_canonical_chunk(tiny_engine_factory):
    """The first document sits at its canonical position, so its canonical chunk KV (e.g. from
    ingest's precompute) is its exact KV: exact mode loads it, bit-identical to computing it."""
    docs = make_docs(3)
    eng = tiny_engine_factory()
    prompt = eng.build_prompt("What is listed?", docs)
    cold = tiny_engine_factory().generate(prompt, max_new_tokens=6, stop_at_newline=False)
    eng.precompute_chunks(docs)
    assert not list(eng.store.keys(Namespace.EXACT))[1:]  # only the preamble has an exact-chain entry
    ans = eng.generate(prompt, max_new_tokens=6, stop_at_newline=False)
    assert classes(ans) == [ReuseClass.EXACT, ReuseClass.EXACT, ReuseClass.COMPUTED, ReuseClass.COMPUTED,
                            ReuseClass.COMPUTED]
    assert torch.equal(ans.first_logits, cold.first_logits) and ans.token_ids == cold.token_ids
    canonical = eng.segments.canonical_key(prompt.preamble.token_ids, prompt.documents[0].token_ids)
    assert ans.report.segments[1].key == key_hex(canonical)
    # any precomputed chunk is exact when it comes first; the ones after it are not
    other = eng.generate(eng.build_prompt("What is listed?", docs[::-1]), max_new_tokens=1)
    assert classes(other)[1:4] == [ReuseClass.EXACT, ReuseClass.COMPUTED, ReuseClass.COMPUTED]
    # another system prompt or salt is another preamble / key: a miss
    sys_prompt = eng.generate(eng.build_prompt("What is listed?", docs, system="Be brief."), max_new_tokens=1)
    assert classes(sys_prompt)[1] is ReuseClass.COMPUTED
    salted = eng.generate(prompt, ReusePolicy.exact(cache_salt="tenant-b"), max_new_tokens=1)
    assert classes(salted)[1] is ReuseClass.COMPUTED


def test_exact_mode_stores_the_first_document_once_for_blends_too(tiny_engine_factory):
    eng = tiny_engine_factory()
    prompt = eng.build_prompt("Why?", make_docs(3))
    eng.generate(prompt, max_new_tokens=1)
    canonical = list(eng.store.keys(Namespace.CANONICAL))
    assert len(canonical) == 1 and len(list(eng.store.keys(Namespace.EXACT))) == 3  # preamble, docs 2-3
    blend = eng.generate(prompt, ReusePolicy.blend(ratio=0.2), max_new_tokens=1)
    assert classes(blend)[1] is ReuseClass.EXACT  # the blend's first document: the same entry


def test_a_corrupt_canonical_entry_is_never_loaded_by_exact_mode(tiny_engine_factory):
    store = MemoryStore()
    eng = tiny_engine_factory(store=store)
    docs = make_docs(2)
    prompt = eng.build_prompt("Why?", docs)
    cold = tiny_engine_factory().generate(prompt, max_new_tokens=1)
    eng.precompute_chunks(docs)
    key = eng.segments.canonical_key(prompt.preamble.token_ids, prompt.documents[0].token_ids)
    good = store.get(Namespace.CANONICAL, key, eng.provenance_json).entry
    store.put(Namespace.CANONICAL, key, KVEntry(good.k, good.v, '{"model": "another"}'))  # mismatched provenance
    ans = eng.generate(prompt, max_new_tokens=1)
    assert classes(ans)[1] is ReuseClass.REJECTED
    assert torch.equal(ans.first_logits, cold.first_logits)


@pytest.mark.parametrize("kv_dtype", [None, "bfloat16"])
def test_hits_on_both_sides_of_a_miss_load_in_runs_and_equal_cold(tiny_engine_factory, kv_dtype):
    """append_run loads consecutive hits together (one rotation per layer over them): a prefix whose
    middle document misses loads the hits before it, computes it over them, then loads the rest, and
    the answer is cold's bit for bit."""
    eng = tiny_engine_factory(kv_dtype=kv_dtype)
    prompt = eng.build_prompt("What is listed?", make_docs(5))
    cold = eng.generate(prompt, max_new_tokens=4, stop_at_newline=False)
    keys = [k for _, k in eng.segments.prefix_keys(prompt.segments[:-1])]
    assert eng.store.delete(Namespace.EXACT, keys[3])  # the third document (the preamble is keys[0])
    warm = eng.generate(prompt, max_new_tokens=4, stop_at_newline=False)
    assert classes(warm) == [ReuseClass.EXACT] * 3 + [ReuseClass.COMPUTED] + [ReuseClass.EXACT] * 2 + [
        ReuseClass.COMPUTED]
    assert [s.start for s in warm.report.segments] == [s.start for s in cold.report.segments]
    assert torch.equal(cold.first_logits, warm.first_logits)
    assert cold.token_ids == warm.token_ids


@pytest.mark.parametrize("min_rows", [1, 5, 1000])
@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16])
def test_load_many_equals_loading_each_in_turn(tiny_engine, stored, min_rows, monkeypatch):
    """Joined runs of short segments and long segments rotated straight from their entries (min_rows 1:
    each alone; 5: 7 and 30 alone, 1 and 2 joined; 1000: all joined) give the numbers of one load per
    segment; so does an entry with K already rotated in the middle of short ones (copied, never joined)."""
    monkeypatch.setattr(kv_load, "LOAD_DIRECT_MIN_ROWS", min_rows)
    runner = tiny_engine.runner
    L, H, D = runner.dims.num_layers, runner.dims.num_kv_heads, runner.dims.head_dim
    gen = torch.Generator().manual_seed(0)
    entries = [KVEntry(torch.randn(L, H, n, D, generator=gen).to(stored), torch.randn(L, H, n, D, generator=gen).to(stored),
                       rotated=rot) for n, rot in ((7, False), (1, False), (3, True), (2, False), (30, False))]
    one, many = runner.new_cache(50), runner.new_cache(50)
    for c in (one, many):
        runner.prefill(c, runner.ids([1, 2, 3]))  # something before: positions continue
    for e in entries:
        runner.load(one, e)
    runner.load_many(many, entries)
    runner.load_many(many, [])  # nothing
    assert one.length == many.length == 46
    assert torch.equal(one.pos[:46], many.pos[:46])
    for i in range(L):
        for a, b in zip(one.view(i), many.view(i)):
            assert torch.equal(a, b)
        assert torch.equal(many.view(i)[0][:, 11:14], entries[2].k[i].to(runner.dtype))  # copied as it was


@given(st.lists(st.tuples(st.integers(min_value=1, max_value=300), st.booleans()), min_size=1, max_size=12),
       st.integers(1, 200))
def test_load_runs_cover_every_segment_once_and_join_only_short_ones(segments, min_rows):
    lengths, alone = [n for n, _ in segments], [a for _, a in segments]
    joinable = [n < min_rows and not a for n, a in segments]
    runs = kv_load.load_runs(lengths, min_rows, alone)
    assert kv_load.load_runs(lengths, min_rows) == kv_load.load_runs(lengths, min_rows, [False] * len(lengths))
    assert runs[0].first == 0 and runs[0].start == 0
    assert runs[-1].last == len(lengths) and runs[-1].stop == sum(lengths)
    for a, b in zip(runs, runs[1:]):
        assert (a.last, a.stop) == (b.first, b.start)  # contiguous, in order
        assert not (joinable[a.last - 1] and joinable[b.first])  # short stretches maximal
    for r in runs:
        assert r.stop - r.start == sum(lengths[r.first:r.last])
        if r.last - r.first > 1:
            assert all(joinable[r.first:r.last])  # only short segments are joined, never one kept alone


@pytest.mark.parametrize("kv_dtype", [None, "bfloat16"])
def test_exact_entries_hold_k_after_rope_and_load_as_a_copy(tiny_engine_factory, kv_dtype, monkeypatch):
    """An EXACT entry is the cache's own rows (K after RoPE at the positions its chain fixes), so a warm
    request copies it (no rotation) and still equals cold; the first document (CANONICAL) stays K before
    RoPE and is rotated."""
    eng = tiny_engine_factory(kv_dtype=kv_dtype)
    prompt = eng.build_prompt("What is listed?", make_docs(3))
    cold = eng.generate(prompt, max_new_tokens=3, stop_at_newline=False, keep_cache=True)
    nss = [ns for ns, _ in eng.segments.prefix_keys(prompt.segments[:-1])]
    assert nss == [Namespace.EXACT, Namespace.CANONICAL, Namespace.EXACT, Namespace.EXACT]
    for seg, (ns, key) in zip(cold.report.segments, eng.segments.prefix_keys(prompt.segments[:-1])):
        found = eng.segments.lookup(ns, key, seg.tokens)
        assert found.entry is not None and found.entry.rotated is ns.k_after_rope
        stored = eng.store.get(ns, key, eng.provenance_json).entry
        for layer in range(eng.runner.dims.num_layers):
            k_rows = cold.cache.view(layer, seg.start + seg.tokens)[0][:, seg.start:]  # (Hkv, S, D) after RoPE
            if ns.k_after_rope:  # the stored rows are the cache's, as stored (rounded to kv_dtype)
                assert torch.equal(stored.k[layer], k_rows.to(stored.k.dtype))
            else:
                assert not torch.equal(stored.k[layer].to(k_rows.dtype), k_rows)  # before RoPE
    rotated = []
    real_rope = kv_load.apply_rope_into

    def counting(out, x, cos, sin):
        rotated.append(int(x.shape[-2]))
        real_rope(out, x, cos, sin)

    monkeypatch.setattr(kv_load, "apply_rope_into", counting)
    eng.segments.hot.budget_bytes = 0  # every warm request loads from the store
    warm = eng.generate(prompt, max_new_tokens=3, stop_at_newline=False)
    assert classes(warm) == [ReuseClass.EXACT] * 4 + [ReuseClass.COMPUTED]
    assert set(rotated) == {len(prompt.documents[0])}  # only the canonical first document is rotated
    assert torch.equal(cold.first_logits, warm.first_logits) and cold.token_ids == warm.token_ids


def test_an_exact_entry_of_the_earlier_form_is_never_reached(tiny_engine_factory):
    """EXACT entries stored before K was kept after RoPE sit under keys of the old chain root: a request
    derives other keys, misses them and computes (never rotating rotated keys or copying unrotated ones)."""
    import hashlib

    from blend.keys import token_digest

    eng = tiny_engine_factory()
    prompt = eng.build_prompt("What is listed?", make_docs(3))
    cold = tiny_engine_factory().generate(prompt, max_new_tokens=2, stop_at_newline=False)
    prefix = prompt.segments[:-1]
    prev = b"exact-root" + eng.segments.provenance.digest()  # the chain as it was
    runner = eng.runner
    L, H, D = runner.dims.num_layers, runner.dims.num_kv_heads, runner.dims.head_dim
    for seg in prefix:
        prev = hashlib.sha256(b"exact" + prev + token_digest(seg.token_ids)).digest()
        junk = torch.full((L, H, len(seg), D), 7.0)
        eng.store.put(Namespace.EXACT, prev, KVEntry(junk, junk, eng.provenance_json))
    ans = eng.generate(prompt, max_new_tokens=2, stop_at_newline=False)
    assert classes(ans) == [ReuseClass.COMPUTED] * 5
    assert torch.equal(ans.first_logits, cold.first_logits)


def test_a_blend_never_re_positions_k_after_rope(tiny_engine):
    from blend.blend_plan import plan_blend
    from blend.segment_values import ChunkKV

    runner = tiny_engine.runner
    prompt = tiny_engine.build_prompt("Why?", make_docs(2))
    L, H, D = runner.dims.num_layers, runner.dims.num_kv_heads, runner.dims.head_dim
    n = len(prompt.documents[1])
    kv = KVEntry(torch.zeros(L, H, n, D), torch.zeros(L, H, n, D), rotated=True)
    with pytest.raises(ValueError, match="before RoPE"):
        plan_blend(runner, prompt, [ChunkKV(kv, ReuseClass.BLENDED, "")], 1, len(prompt.preamble) + len(prompt.documents[0]),
                   ReusePolicy.blend(ratio=0.2))


def test_one_pass_is_a_full_prefill_in_one_causal_pass_that_stores_nothing(tiny_engine):
    """The benchmarks' reference: none() runs the exact path's segment-by-segment schedule (bit-identical
    to exact reuse), which reads every weight once per segment, 1.5x a one-pass prefill at ~600 tokens on
    the dev box, so every ratio against it was flattered. one_pass() is the full prefill a user would run."""
    from blend.evals.methods import parse_methods

    prompt = tiny_engine.build_prompt("Which river?", make_docs(4))
    before = {ns: len(list(tiny_engine.store.keys(ns))) for ns in Namespace}
    one = tiny_engine.generate(prompt, ReusePolicy.one_pass(), max_new_tokens=3)
    assert {ns: len(list(tiny_engine.store.keys(ns))) for ns in Namespace} == before  # nothing stored
    assert all(s.reuse_class is ReuseClass.COMPUTED for s in one.report.segments)
    calls = []
    real = tiny_engine.runner.run_layers
    tiny_engine.runner.run_layers = lambda h, *a, **kw: (calls.append(h.shape[0]), real(h, *a, **kw))[1]
    try:
        again = tiny_engine.generate(prompt, ReusePolicy.one_pass(), max_new_tokens=1)
    finally:
        tiny_engine.runner.run_layers = real
    assert calls[0] == len(prompt)  # the whole prompt in one forward
    none = tiny_engine.generate(prompt, ReusePolicy.none(), max_new_tokens=1)
    assert (again.first_logits - none.first_logits).abs().max() <= 1e-4  # float rounding apart
    full = next(m for m in parse_methods("full") if m.name == "full")
    assert full.policy() == ReusePolicy.one_pass()  # every eval's and bench's ratio divides by it
