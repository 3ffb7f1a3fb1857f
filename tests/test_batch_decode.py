"""Batched decode: one step over several caches of different lengths.

Tolerances: INVARIANT mode is bit-identical to decoding each sequence alone
(torch.equal); THROUGHPUT mode agrees within float rounding (fp32: max abs
logit difference <= 1e-4) and is bit-identical at batch size 1.
"""

import pytest
import torch

from blend.batch_decode import INVARIANT_TILE, DecodeBatching, decode_batch
from blend.policy import ReusePolicy
from _serve_util import one_torch_thread  # noqa: F401 - module fixture
from conftest import make_docs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

THROUGHPUT_ATOL = 1e-4


def prefilled(engine, n: int, room: int = 8):
    """n prompts of different lengths and policies: (caches, first tokens)."""
    caches, toks = [], []
    for i in range(n):
        prompt = engine.build_prompt(f"question {i}?", make_docs(1 + i % 3, words=10 + 7 * i, seed=i))
        policy = ReusePolicy.blend(ratio=0.3) if i % 2 else ReusePolicy.exact()
        logits, cache, _ = engine.prefill(prompt, policy, room)
        caches.append(cache)
        toks.append(int(logits.argmax()))
    return caches, toks


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2"])
def test_invariant_mode_is_bit_identical_to_one_at_a_time(tiny_engine_factory, model):
    engine = tiny_engine_factory(model)
    n = INVARIANT_TILE + 3  # two tiles
    alone_caches, toks = prefilled(engine, n)
    alone = [decode_batch(engine.runner, [c], [t], DecodeBatching.INVARIANT)[0] for c, t in zip(alone_caches, toks)]
    caches, _ = prefilled(engine, n)
    for step in range(3):
        order = [(i * 7 + step * 5) % n for i in range(n)]  # each sequence sits elsewhere in the batch
        rows = decode_batch(engine.runner, [caches[i] for i in order], [toks[i] for i in order],
                            DecodeBatching.INVARIANT)
        for j, i in enumerate(order):
            if step == 0:
                assert torch.equal(rows[j], alone[i]), i
        toks = [int(r.argmax()) for r in rows[torch.argsort(torch.tensor(order))]]
    assert all(c.length == a.length + 2 for c, a in zip(caches, alone_caches))


def test_throughput_mode_within_rounding_and_exact_alone(tiny_engine):
    caches, toks = prefilled(tiny_engine, 5)
    rows = decode_batch(tiny_engine.runner, caches, toks)
    alone, _ = prefilled(tiny_engine, 5)
    for i in range(5):
        one = decode_batch(tiny_engine.runner, [alone[i]], [toks[i]])[0]
        assert torch.allclose(rows[i], one, atol=THROUGHPUT_ATOL, rtol=0)
        assert int(rows[i].argmax()) == int(one.argmax())
    # batch of one: the same program as the runner's own decode step
    ref = tiny_engine.runner.decode_step(prefilled(tiny_engine, 1)[0][0], toks[0])
    assert torch.equal(decode_batch(tiny_engine.runner, [prefilled(tiny_engine, 1)[0][0]], [toks[0]])[0], ref)


def test_rows_are_written_at_each_sequences_own_position(tiny_engine):
    caches, toks = prefilled(tiny_engine, 3)
    lengths = [c.length for c in caches]
    decode_batch(tiny_engine.runner, caches, toks)
    for c, n in zip(caches, lengths):
        assert c.length == n + 1 and int(c.pos[n]) == n


def test_a_full_cache_is_refused(tiny_engine):
    caches, toks = prefilled(tiny_engine, 1, room=1)
    decode_batch(tiny_engine.runner, caches, toks)
    with pytest.raises(ValueError, match="full"):
        decode_batch(tiny_engine.runner, caches, toks)
    with pytest.raises(ValueError, match="one token per cache"):
        decode_batch(tiny_engine.runner, caches, [])


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2"])
@pytest.mark.parametrize("batching", list(DecodeBatching))
def test_decode_numbers_change_with_the_thread_count_by_rounding_only(tiny_engine_factory, model, batching):
    # The scheduler may give THROUGHPUT decode steps every core while no prefill runs. Whether a GEMM's
    # sums depend on the thread count is the BLAS library's and the CPU's business (on AMD EPYC a 5-row
    # fp32 GEMM differs by ~1e-6 between 1 and 2 threads; elsewhere it is bitwise equal), so the bound
    # promised is float rounding; INVARIANT mode never changes its thread count (next test).
    engine = tiny_engine_factory(model)
    rows = {}
    for threads in (1, 2):
        caches, toks = prefilled(engine, 5)
        torch.set_num_threads(threads)
        try:
            rows[threads] = decode_batch(engine.runner, caches, toks, batching)
        finally:
            torch.set_num_threads(1)
    assert torch.allclose(rows[1], rows[2], atol=THROUGHPUT_ATOL, rtol=0)
    assert torch.equal(rows[1].argmax(-1), rows[2].argmax(-1))
