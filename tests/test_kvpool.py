"""Recycled KV buffers (blend.kvpool): a finished request's buffers serve the next cache, never while
anything still reads them, and recycling changes no number."""

import gc

import pytest
import torch

from blend.kvcache import KVCache
from blend.kvpool import KVBufferPool
from blend.policy import ReusePolicy
from conftest import make_docs, unguarded_blend

CPU = torch.device("cpu")


def _cache(pool, capacity=100, layers=2):
    return KVCache(layers, 2, 4, capacity, torch.float32, CPU, pool)


def _ptrs(cache):
    return {t.untyped_storage().data_ptr() for t in (*cache._k, *cache._v)}


def test_a_dropped_caches_buffers_serve_the_next_cache():
    pool = KVBufferPool(1 << 20)
    first = _cache(pool)
    ptrs = _ptrs(first)
    del first
    second = _cache(pool, capacity=90)  # a similar length fits the same buffers
    assert _ptrs(second) == ptrs
    assert second.k[0].shape == (2, 90, 4)
    st = pool.stats()
    assert (st.reused, st.allocated) == (4, 4)


def test_buffers_still_viewed_wait_until_nothing_reads_them():
    pool = KVBufferPool(1 << 20)
    cache = _cache(pool)
    for layer in range(2):
        cache.write(layer, 0, torch.ones(2, 10, 4), torch.ones(2, 10, 4))
    cache.advance(10)
    prefix = cache.share(10)  # what a hot-prefix cache keeps
    ptrs = _ptrs(cache)
    del cache
    other = _cache(pool)
    assert not _ptrs(other) & ptrs, "a buffer a prefix still views was handed out"
    for layer in range(2):
        other.write(layer, 0, torch.zeros(2, 10, 4), torch.zeros(2, 10, 4))
    assert all(torch.equal(k, torch.ones(2, 10, 4)) for k in prefix.k)
    assert pool.stats().pending_bytes > 0
    del prefix
    assert pool.stats().pending_bytes == 0 and pool.stats().free_bytes > 0
    third = _cache(pool)  # once nothing views them, they serve the next cache
    assert _ptrs(third) == ptrs


def test_among_equal_fits_the_most_recently_given_back_comes_first():
    pool = KVBufferPool(1 << 20)
    older, newer = _cache(pool), _cache(pool)
    ptrs = _ptrs(newer)
    del older
    del newer
    assert _ptrs(_cache(pool)) == ptrs


def test_the_budget_bounds_the_free_bytes_and_zero_turns_recycling_off():
    pool = KVBufferPool(3 * 2 * 256 * 4 * 4)  # three buffers of 256 rows
    caches = [_cache(pool) for _ in range(3)]  # 12 buffers
    del caches
    assert pool.stats().free_bytes <= pool.budget_bytes
    off = KVBufferPool(0)
    a = _cache(off)
    del a
    b = _cache(off)  # allocated: nothing was taken back, nothing reused
    assert off.stats() == type(off.stats())(0, 0, 0, 0)
    assert not off.recycles and b.k[0].shape == (2, 100, 4)


def test_a_buffer_much_larger_than_the_request_is_not_used():
    pool = KVBufferPool(1 << 24)
    big = _cache(pool, capacity=2000)
    ptrs = _ptrs(big)
    del big
    small = _cache(pool, capacity=100)
    assert not _ptrs(small) & ptrs
    with pytest.raises(ValueError):
        KVBufferPool(-1)


def test_one_takes_buffers_all_have_one_row_count():
    # a budget that keeps part of a dropped cache's buffers, then a cache of another length: K and V of a
    # layer must still share strides (kernels writing both check it), so every buffer of a take has one row count
    pool = KVBufferPool(1 << 24)
    small, large = _cache(pool, capacity=200), _cache(pool, capacity=300)  # 256 and 512 rows (quantum 256)
    del small, large
    assert pool.stats().free_bytes == 4 * 2 * (256 + 512) * 4 * 4
    pool.budget_bytes = 6 * 2 * 256 * 4 * 4  # drops the oldest: three of 512 rows are left
    pool.stats()
    mixed = _cache(pool, capacity=240)  # three free buffers fit, the fourth is allocated: at their row count
    rows = {t.untyped_storage().nbytes() for t in (*mixed._k, *mixed._v)}
    assert len(rows) == 1
    assert {t.stride() for t in (*mixed._k, *mixed._v)} == {mixed._k[0].stride()}


def test_buffers_are_normal_tensors_whatever_mode_allocated_them():
    # a scratch cache made under inference mode must not leave an inference tensor to a later cache made
    # outside it: that cache writes its rows in place (decoding), which inference tensors refuse there
    pool = KVBufferPool(1 << 20)
    with torch.inference_mode():
        scratch = _cache(pool)
        assert not any(t.is_inference() for t in scratch._k)
    del scratch
    cache = _cache(pool)
    assert _ptrs(cache) and not any(t.is_inference() for t in (*cache._k, *cache._v))
    cache.write(0, 0, torch.ones(2, 3, 4), torch.ones(2, 3, 4))  # outside inference mode: no error


def test_other_devices_allocate_as_without_a_pool():
    pool = KVBufferPool(1 << 20)
    (t,) = pool.take(1, 2, 10, 4, torch.float32, torch.device("meta"))
    assert t.shape == (2, 10, 4) and t.device.type == "meta"
    pool.give([t])
    assert pool.stats().pending_bytes == 0


def _poisoned(monkeypatch):
    """Every buffer the pool hands out is filled with NaN first: a read of a row nobody wrote shows."""
    take = KVBufferPool.take

    def poisoned(self, *a, **kw):
        bufs = take(self, *a, **kw)
        for b in bufs:
            b.fill_(float("nan"))
        return bufs

    monkeypatch.setattr(KVBufferPool, "take", poisoned)


def test_recycled_buffers_change_no_number(tiny_engine_factory, monkeypatch):
    """Requests of several lengths and methods, in turn, over recycled (and poisoned) buffers give the
    first logits and tokens of an engine that allocates every cache, bit for bit."""
    _poisoned(monkeypatch)
    docs = make_docs(4, words=40, seed=3)
    fresh = tiny_engine_factory()
    fresh.runner.kv_pool.budget_bytes = 0
    pooled = tiny_engine_factory()
    prompts = [fresh.build_prompt("what is it?", docs[:n]) for n in (4, 2, 3, 4)]
    prompts += [fresh.build_prompt("and then?", docs[::-1][:n]) for n in (4, 3)]
    policies = [ReusePolicy.none(), ReusePolicy.exact(), unguarded_blend(0.3), unguarded_blend(0.15)]
    for p in prompts:
        for pol in policies:
            a = fresh.generate(p, pol, max_new_tokens=3, stop_at_newline=False)
            b = pooled.generate(p, pol, max_new_tokens=3, stop_at_newline=False)
            assert torch.equal(a.first_logits, b.first_logits), pol
            assert a.token_ids == b.token_ids
    gc.collect()
    assert pooled.runner.kv_pool.stats().reused > 0


def test_a_cache_dropped_while_its_own_thread_takes_buffers_does_not_deadlock():
    """A garbage collection inside take() can drop a cache whose finalizer gives buffers back on the same
    thread, under the pool's lock: the give must not wait for it, and the buffers are reclaimed later."""
    pool = KVBufferPool(1 << 20)
    cache = _cache(pool)
    ptrs = _ptrs(cache)
    cache.cycle = cache  # only the cycle collector frees it
    del cache
    with pool._lock:  # what take() holds when a collection runs inside it
        gc.collect()
    assert pool.stats().free_bytes > 0
    assert _ptrs(_cache(pool)) == ptrs
