"""The decode pool: sequences' caches as slots of one allocation, attended once per layer.

Tolerances as in test_batch_decode.py: a pooled step (THROUGHPUT, two or more slots) agrees with
each sequence decoded from its own cache within float rounding (max abs logit difference <= 1e-4,
same argmax); a step of one slot, and INVARIANT mode, are bit-identical to the private cache.
"""

import pytest
import torch

from blend.batch_decode import DecodeBatching, DecodeStep, decode_batch
from blend.decode_pool import DecodePool, PoolSlotCache
from _serve_util import one_torch_thread  # noqa: F401 - module fixture
from test_batch_decode import THROUGHPUT_ATOL, prefilled

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def pool_for(engine, slots: int = 6, capacity: int = 1024) -> DecodePool:
    d, r = engine.runner.dims, engine.runner
    return DecodePool(d.num_layers, d.num_kv_heads, d.head_dim, slots, capacity, r.dtype, r.device)


def poison(pool: DecodePool) -> None:
    """Fill every row with NaN: what a recycled allocation may hold before anyone wrote it."""
    for k, v in zip(pool.k, pool.v):
        k.fill_(float("nan"))
        v.fill_(float("nan"))


def test_a_slot_holds_the_same_rows_and_decodes_bit_identically(tiny_engine):
    pool = pool_for(tiny_engine)
    mine, toks = prefilled(tiny_engine, 1)
    slot = pool.adopt(mine[0])
    assert isinstance(slot, PoolSlotCache) and slot.slot == 0 and pool.free_slots == 5
    assert slot.length == mine[0].length and slot.capacity == mine[0].capacity
    for layer in range(len(pool.k)):
        assert torch.equal(slot.view(layer)[0], mine[0].view(layer)[0])
        assert torch.equal(slot.view(layer)[1], mine[0].view(layer)[1])
    ref, _ = prefilled(tiny_engine, 1)
    t_slot, t_ref = toks[0], toks[0]
    for _ in range(3):  # a step of one sequence is the per-sequence program over the slot's views
        a = decode_batch(tiny_engine.runner, [slot], [t_slot])[0]
        b = decode_batch(tiny_engine.runner, [ref[0]], [t_ref])[0]
        assert torch.equal(a, b)
        t_slot = t_ref = int(a.argmax())


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2"])
def test_pooled_steps_match_each_sequence_alone(tiny_engine_factory, model):
    engine = tiny_engine_factory(model)
    pool = pool_for(engine)
    poison(pool)  # padding keys past a slot's length must never reach a row (0 x NaN)
    n = 4
    caches, toks = prefilled(engine, n)
    gap = pool.adopt(prefilled(engine, 1)[0][0])  # slot 0 busy, then freed: a hole in the range
    slots = [pool.adopt(c) for c in caches]
    pool.release(gap)
    assert [s.slot for s in slots] == [1, 2, 3, 4]
    alone, _ = prefilled(engine, n)
    order = [2, 0, 3, 1]  # the step's order is not the slots' order
    t = list(toks)
    for step in range(4):
        step_obj = DecodeStep(engine.runner, [slots[i] for i in order], [t[i] for i in order])
        assert step_obj.rows.pooled is not None and step_obj.rows.pooled.lo == 1
        rows = step_obj.finish()
        for j, i in enumerate(order):
            one = decode_batch(engine.runner, [alone[i]], [t[i]])[0]
            assert torch.isfinite(rows[j]).all()
            assert torch.allclose(rows[j], one, atol=THROUGHPUT_ATOL, rtol=0), (step, i)
            assert int(rows[j].argmax()) == int(one.argmax())
        t = [int(rows[order.index(i)].argmax()) for i in range(n)]
    for s, a in zip(slots, alone):  # the step wrote each sequence's rows at its own positions
        assert s.length == a.length and torch.equal(s.pos[: s.length], a.pos[: a.length])
        assert torch.allclose(s.view(1)[0], a.view(1)[0], atol=1e-5, rtol=0)


def test_a_released_slot_is_reused_and_its_old_rows_never_read(tiny_engine):
    pool = pool_for(tiny_engine, slots=2)
    long_caches, _ = prefilled(tiny_engine, 3, room=40)
    first = pool.adopt(long_caches[2])  # the longest prompt: its rows fill the slot far
    pool.release(first)
    short, toks = prefilled(tiny_engine, 2)
    a, b = pool.adopt(short[0]), pool.adopt(short[1])
    assert {a.slot, b.slot} == {0, 1} and pool.free_slots == 0
    assert pool.adopt(prefilled(tiny_engine, 1)[0][0]).__class__ is not PoolSlotCache  # full: stays private
    rows = decode_batch(tiny_engine.runner, [a, b], toks)
    ref, _ = prefilled(tiny_engine, 2)
    for i, c in enumerate(ref):
        assert torch.allclose(rows[i], decode_batch(tiny_engine.runner, [c], [toks[i]])[0], atol=THROUGHPUT_ATOL,
                              rtol=0)


def test_what_does_not_fit_stays_private_and_mixed_steps_run_per_sequence(tiny_engine):
    pool = pool_for(tiny_engine, capacity=8)
    caches, toks = prefilled(tiny_engine, 2)
    assert pool.adopt(caches[0]) is caches[0] and pool.free_slots == 6  # capacity beyond the pool's rows
    big = pool_for(tiny_engine)
    slot = big.adopt(caches[1])
    step = DecodeStep(tiny_engine.runner, [caches[0], slot], toks)
    assert step.rows.pooled is None  # one private cache: every sequence over its own
    step.finish()
    with pytest.raises(ValueError, match="slots >= 1"):
        pool_for(tiny_engine, slots=0)


def test_invariant_mode_never_pools_and_stays_bit_identical(tiny_engine):
    pool = pool_for(tiny_engine)
    caches, toks = prefilled(tiny_engine, 3)
    slots = [pool.adopt(c) for c in caches]
    step = DecodeStep(tiny_engine.runner, slots, toks, DecodeBatching.INVARIANT)
    assert step.rows.pooled is None
    rows = step.finish()
    ref, _ = prefilled(tiny_engine, 3)
    assert torch.equal(rows, decode_batch(tiny_engine.runner, ref, toks, DecodeBatching.INVARIANT))


def test_a_bf16_engine_pools_with_its_softmax_in_float32(tiny_engine_factory):
    """bf16 scores go through a float32 softmax; the bmm pairs round in bf16 where the per-sequence
    SDPA accumulates in float32, so a pooled row is within a few bf16 steps of the sequence alone
    (measured 0.018-0.023 on logits of magnitude ~1.8), with the same argmax."""
    engine = tiny_engine_factory(dtype="bfloat16")
    pool = pool_for(engine)
    caches, toks = prefilled(engine, 3)
    rows = decode_batch(engine.runner, [pool.adopt(c) for c in caches], toks)
    alone, _ = prefilled(engine, 3)
    for i in range(3):
        one = decode_batch(engine.runner, [alone[i]], [toks[i]])[0]
        assert torch.isfinite(rows[i]).all() and rows[i].dtype == one.dtype
        assert (rows[i].float() - one.float()).abs().max() < 0.05
        assert int(rows[i].argmax()) == int(one.argmax())


def test_a_failed_move_into_the_pool_gives_its_slot_back(tiny_engine, monkeypatch):
    pool = pool_for(tiny_engine, slots=1)
    mine, _ = prefilled(tiny_engine, 1)

    def broken(self, start, pos):
        raise RuntimeError("copy failed")

    monkeypatch.setattr(PoolSlotCache, "set_positions", broken)
    with pytest.raises(RuntimeError, match="copy failed"):
        pool.adopt(mine[0])
    assert pool.free_slots == 1  # not leaked: the next sequence gets it
    monkeypatch.undo()
    assert isinstance(pool.adopt(mine[0]), PoolSlotCache) and pool.free_slots == 0


def test_rows_a_sequence_decoded_alone_survive_a_second_sequence_joining(tiny_engine):
    """A one-sequence step writes its rows into its slot without moving ``reads_upto``: the first pooled
    step then zeroed them, and the sequence read zeros for the tokens it had generated (0.07-0.1 off,
    and greedy answers parted, on a server idle between bursts)."""
    pool = pool_for(tiny_engine)
    (a,), (ta,) = prefilled(tiny_engine, 1, room=16)
    (ref,), _ = prefilled(tiny_engine, 1, room=16)
    slot = pool.adopt(a)
    (b,), (tb,) = prefilled(tiny_engine, 1, room=16)
    t_slot = t_ref = ta
    for step in range(10):
        if step < 5:  # alone
            got = decode_batch(tiny_engine.runner, [slot], [t_slot])[0]
        else:  # a second request has joined: pooled steps
            if step == 5:
                b = pool.adopt(b)
            got, other = decode_batch(tiny_engine.runner, [slot, b], [t_slot, tb])
            tb = int(other.argmax())
        want = decode_batch(tiny_engine.runner, [ref], [t_ref])[0]
        assert torch.allclose(got, want, atol=THROUGHPUT_ATOL, rtol=0), step
        t_slot, t_ref = int(got.argmax()), int(want.argmax())
    k = pool.k[0][slot.slot, :, : slot.length]  # (Hkv, T, D)
    assert all(float(k[:, t].abs().max()) > 0 for t in range(slot.length))
