"""Hot prefixes: a prefix found stored again is attached to the next request's cache (K after RoPE,
read in place by the first chunk) instead of loaded, and the answer stays bit-identical."""

from __future__ import annotations

import time

import pytest
import torch

from blend.keys import Namespace
from blend.kvcache import RotatedPrefix
from blend.policy import ReusePolicy
from blend.prefix_cache import PrefixCache
from blend.prompt import Role, SegmentKind, Turn
from blend.report import ReuseClass
from conftest import make_docs, unguarded_blend

DOCS = make_docs(3, words=30, seed=21)


def test_the_third_exact_request_attaches_the_prefix_and_answers_bit_for_bit(tiny_engine_factory):
    eng = tiny_engine_factory()
    prompt = eng.build_prompt("Where is the harbor?", DOCS)
    none = tiny_engine_factory().generate(prompt, ReusePolicy.none(), max_new_tokens=6)
    cold = eng.generate(prompt, ReusePolicy.exact(), max_new_tokens=6)  # computes and stores: not hot
    assert eng.segments.hot.kept == 0
    warm = eng.generate(prompt, ReusePolicy.exact(), max_new_tokens=6)  # loads every segment: remembered
    assert eng.segments.hot.kept == 1 and eng.segments.hot.hits == 0
    hot = eng.generate(prompt, ReusePolicy.exact(), max_new_tokens=6)  # attached
    assert eng.segments.hot.hits >= 1
    for ans in (cold, warm, hot):
        assert torch.equal(ans.first_logits, none.first_logits) and ans.token_ids == none.token_ids
    assert [(s.kind, s.reuse_class, s.tokens, s.start, s.key) for s in hot.report.segments] == \
        [(s.kind, s.reuse_class, s.tokens, s.start, s.key) for s in warm.report.segments]
    hits = eng.segments.hot.hits  # another document order or another salt: not this prefix
    eng.generate(eng.build_prompt("Where is the harbor?", DOCS[::-1]), ReusePolicy.exact(), max_new_tokens=1)
    salted = eng.generate(prompt, ReusePolicy.exact(cache_salt="b"), max_new_tokens=1)
    assert eng.segments.hot.hits == hits
    assert {s.reuse_class for s in salted.report.segments} == {ReuseClass.COMPUTED}


def test_a_question_after_an_attached_prefix_reads_it_in_place(tiny_engine_factory):
    eng = tiny_engine_factory()
    prompt = eng.build_prompt("Which bridge?", DOCS)
    for _ in range(2):
        eng.generate(prompt, ReusePolicy.exact(), max_new_tokens=1)
    logits, cache, report = eng.prefill(prompt, ReusePolicy.exact())
    assert cache.prefix_length == len(prompt) - len(prompt.question)  # nothing copied yet
    ref, ref_cache, _ = tiny_engine_factory().prefill(prompt, ReusePolicy.none())
    assert torch.equal(logits, ref)
    k, v = cache.view(0)  # anything that needs the rows contiguous copies the prefix in, once
    assert cache.prefix_length == 0 and torch.equal(k, ref_cache.view(0)[0]) and torch.equal(v, ref_cache.view(0)[1])


def test_a_conversation_and_a_blend_over_exact_documents_use_the_hot_prefix(tiny_engine_factory):
    eng = tiny_engine_factory()
    history = (Turn(Role.USER, "Where is the harbor?"), Turn(Role.ASSISTANT, "North."),
               Turn(Role.USER, "And the bridge?"), Turn(Role.ASSISTANT, "South."))
    third = eng.build_prompt("And the tower?", DOCS, history=history)
    none = tiny_engine_factory().generate(third, ReusePolicy.none(), max_new_tokens=4)
    for _ in range(3):  # computes, loads (remembered: documents and both turns), attaches
        got = eng.generate(third, ReusePolicy.exact(), max_new_tokens=4)
        assert torch.equal(got.first_logits, none.first_logits) and got.token_ids == none.token_ids
    assert eng.segments.hot.hits >= 1
    assert [s.kind for s in got.report.segments[-3:]] == [SegmentKind.TURN, SegmentKind.TURN, SegmentKind.QUESTION]
    blend = eng.generate(third, unguarded_blend(ratio=0.15, take_exact=True), max_new_tokens=4)  # all exact: exact path
    assert torch.equal(blend.first_logits, none.first_logits)
    assert all(s.reuse_class is ReuseClass.EXACT for s in blend.report.segments[:-1])


def test_the_lru_keeps_its_budget():
    def prefix(n: int) -> RotatedPrefix:
        t = torch.zeros(1, n, 4)
        return RotatedPrefix((t,), (t,))

    cache = PrefixCache(budget_bytes=prefix(10).nbytes * 2)
    cache.put(b"a" * 32, prefix(10))
    cache.put(b"b" * 32, prefix(10))
    assert cache.get(b"a" * 32, 10) is not None  # a is now the most recent
    cache.put(b"c" * 32, prefix(10))
    assert b"b" * 32 not in cache and b"a" * 32 in cache and b"c" * 32 in cache
    assert cache.get(b"a" * 32, 11) is None  # another length: not this prefix
    empty = PrefixCache(0)
    empty.put(b"d" * 32, prefix(1))  # budget 0 keeps nothing
    assert b"d" * 32 not in empty and empty.get(b"d" * 32, 1) is None and not empty.holds(b"d" * 32, 1)
    assert empty.kept == 0 and empty.hits == 0


def test_blends_over_exact_documents_make_the_prefix_hot_on_their_own(tiny_engine_factory):
    """An exact request stores this order; the first blend finds every document exact (and remembers
    the prefix), the next attaches it: bit-identical to no reuse all the way."""
    eng = tiny_engine_factory()
    prompt = eng.build_prompt("Which tower?", DOCS)
    none = tiny_engine_factory().generate(prompt, ReusePolicy.none(), max_new_tokens=3)
    eng.generate(prompt, ReusePolicy.exact(), max_new_tokens=1)
    first = eng.generate(prompt, unguarded_blend(ratio=0.15, take_exact=True), max_new_tokens=3)
    assert eng.segments.hot.kept == 1
    again = eng.generate(prompt, unguarded_blend(ratio=0.15, take_exact=True), max_new_tokens=3)
    assert eng.segments.hot.hits >= 1
    for ans in (first, again):
        assert torch.equal(ans.first_logits, none.first_logits) and ans.token_ids == none.token_ids
        assert all(s.reuse_class is ReuseClass.EXACT for s in ans.report.segments[:-1])


def test_shared_rows_are_read_only(tiny_engine_factory):
    import pytest

    eng = tiny_engine_factory()
    prompt = eng.build_prompt("Which tower?", DOCS)
    _, cache, _ = eng.prefill(prompt, ReusePolicy.none())
    shared = cache.share(10)
    assert shared.length == 10
    with pytest.raises(RuntimeError, match="shared"):
        cache.write(0, 5, *cache.view(0, 1))
    cache.write(0, 10, *cache.view(0, 1))  # after them: fine


def test_a_turn_after_an_attached_prefix_stores_its_part_without_copying_the_prefix_in(tiny_engine_factory):
    """The question's last part is stored (K after RoPE) from the cache's own rows: the attached prefix
    stays attached until something needs the rows contiguous."""
    eng = tiny_engine_factory()
    history = (Turn(Role.USER, "Where is the harbor?"), Turn(Role.ASSISTANT, "North."))
    prompt = eng.build_prompt("And the tower?", DOCS, history=history)
    for _ in range(2):
        eng.generate(prompt, ReusePolicy.exact(), max_new_tokens=1)
    parts = prompt.question.parts()
    eng.store.delete(Namespace.EXACT, eng.segments.exact_keys([*prompt.segments[:-1], *parts])[-1])
    logits, cache, _ = eng.prefill(prompt, ReusePolicy.exact())
    assert cache.prefix_length == len(prompt) - len(parts[-1])  # attached, not copied in
    key = eng.segments.exact_keys([*prompt.segments[:-1], *parts])[-1]
    stored = eng.store.get(Namespace.EXACT, key, eng.provenance_json).entry  # stored again by this request
    start = cache.prefix_length
    for layer in range(eng.runner.dims.num_layers):
        k, v = cache.view(layer)
        assert torch.equal(stored.k[layer], k[:, start:]) and torch.equal(stored.v[layer], v[:, start:])


def test_a_prefix_fill_retried_after_a_failed_put_stores_what_a_clean_engine_computes(tiny_engine_factory):
    """A put that raises after its segment was appended to the fill's cache: a retried step must
    not append that segment again (what follows would be stored, computed after a duplicate, under
    exact keys)."""
    from blend.prefix_fill import PrefixFill, order_segments
    eng = tiny_engine_factory()
    prompt = eng.build_prompt("q?", make_docs(4, words=20))
    fill = PrefixFill(eng.segments, order_segments(prompt))
    put, calls = eng.store.put, [0]

    def flaky(*a, **kw):
        calls[0] += 1
        if calls[0] == 3:
            raise OSError("transient store failure")
        return put(*a, **kw)

    eng.store.put = flaky
    with pytest.raises(OSError):
        fill.run()
    fill.run()  # the caller retries
    eng.store.put = put
    warm = eng.generate(prompt, ReusePolicy.exact(), max_new_tokens=1)
    assert [s.reuse_class for s in warm.report.segments[:-1]] == [ReuseClass.EXACT] * 5
    clean = tiny_engine_factory().generate(prompt, ReusePolicy.none(), max_new_tokens=1)
    assert torch.equal(warm.first_logits, clean.first_logits)


def test_precompute_under_the_exact_policy_returns_with_its_writes_in_every_tier(tiny_engine_factory, tmp_path):
    from blend.store.spec import open_store
    store = open_store(f"memory,disk:{tmp_path / 'kv'}")
    eng = tiny_engine_factory(store=store)
    disk = store.tiers[-1]
    put = disk.put

    def slow_put(*a, **kw):
        time.sleep(0.2)
        return put(*a, **kw)

    disk.put = slow_put
    prompt = eng.build_prompt("q?", make_docs(2, words=20))
    eng.precompute(prompt, ReusePolicy.exact())
    keys = eng.segments.prefix_keys(prompt.segments[:-1])
    assert all(store.tiers[-1].contains(ns, key) for ns, key in keys)
