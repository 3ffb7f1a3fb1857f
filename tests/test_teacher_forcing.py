"""Teacher forcing from a kept cache equals teacher forcing after a fresh prefill, bit for bit."""

import pytest
import torch

from blend.policy import ReusePolicy
from conftest import make_docs

POLICIES = {
    "full": ReusePolicy.none(),
    "exact": ReusePolicy.exact(),
    "prefix": ReusePolicy.exact(prefix_limit=1),
    "blend": ReusePolicy.blend(ratio=0.3, force=True),
    "reuse": ReusePolicy.blend(ratio=0.0, force=True),
}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_kept_cache_matches_fresh_prefill(tiny_engine, name):
    policy = POLICIES[name]
    prompt = tiny_engine.build_prompt("Which words?", make_docs(3))
    tiny_engine.precompute(prompt, policy)
    ref = tiny_engine.generate(prompt, ReusePolicy.none(), max_new_tokens=6, stop_at_newline=False)
    cont = ref.token_ids[:5] or [1, 2, 3]
    ans = tiny_engine.generate(prompt, policy, max_new_tokens=6, stop_at_newline=False, keep_cache=True)
    assert ans.cache is not None
    fresh = tiny_engine.teacher_forced_logits(prompt, policy, cont)
    kept = tiny_engine.teacher_forced_logits(prompt, policy, cont, answer=ans)
    assert kept.shape == (len(cont) + 1, fresh.shape[1])
    assert torch.equal(kept, fresh)
    assert ans.cache is None  # consumed


def test_cache_not_kept_by_default_and_too_small_cache_refills(tiny_engine):
    prompt = tiny_engine.build_prompt("Which words?", make_docs(2))
    assert tiny_engine.generate(prompt, max_new_tokens=2).cache is None
    short = tiny_engine.generate(prompt, ReusePolicy.none(), max_new_tokens=1, keep_cache=True)
    cont = [5, 6, 7]  # longer than the cache's decode room: falls back to a fresh prefill
    got = tiny_engine.teacher_forced_logits(prompt, ReusePolicy.none(), cont, answer=short)
    assert torch.equal(got, tiny_engine.teacher_forced_logits(prompt, ReusePolicy.none(), cont))


def test_prefix_computes_the_tail_in_one_block_and_reports_every_segment(tiny_engine):
    prompt = tiny_engine.build_prompt("Why?", make_docs(4))
    full = tiny_engine.generate(prompt, ReusePolicy.none(), max_new_tokens=1)
    cold = tiny_engine.generate(prompt, ReusePolicy.exact(prefix_limit=1), max_new_tokens=1)
    warm = tiny_engine.generate(prompt, ReusePolicy.exact(prefix_limit=1), max_new_tokens=1)
    assert torch.equal(cold.first_logits, warm.first_logits)
    assert (full.first_logits - warm.first_logits).abs().max() <= 1e-4
    segs = warm.report.segments
    assert len(segs) == len(prompt.segments)
    assert [s.start for s in segs] == [sum(len(p) for p in prompt.segments[:i]) for i in range(len(segs))]
    assert warm.report.reused_tokens == len(prompt.segments[0])


def test_one_pass_matches_step_by_step_decoding(tiny_engine):
    prompt = tiny_engine.build_prompt("Which words?", make_docs(2))
    policy = ReusePolicy.none()
    got = tiny_engine.teacher_forced_logits(prompt, policy, [7, 8, 9, 10])
    logits, cache, _ = tiny_engine.prefill(prompt, policy, 4)
    steps = [logits] + [tiny_engine.runner.decode_step(cache, t) for t in (7, 8, 9, 10)]
    assert torch.allclose(got, torch.stack(steps), atol=1e-4, rtol=1e-4)
    assert torch.equal(tiny_engine.teacher_forced_logits(prompt, policy, []), logits[None])


def test_past_a_length_dependent_ropes_trained_length_it_feeds_tokens_as_decoding_does(tiny_engine_factory):
    """Dynamic NTK rescales a pass's tables by its longest position: one pass over a continuation that crosses
    the trained length rotated every row for the last one (0.42 apart from decoding, 41 argmax flips)."""
    engine = tiny_engine_factory("tiny-llama-rope-dynamic")
    prompt = engine.build_prompt("question?", make_docs(1, words=25, seed=3))
    after = engine.runner.rope.length_dependent_after
    cont = [97 + (i * 7) % 26 for i in range(after + 40 - len(prompt))]
    got = engine.teacher_forced_logits(prompt, ReusePolicy.none(), cont)
    logits, cache, _ = engine.prefill(prompt, ReusePolicy.none(), len(cont))
    steps = torch.stack([logits] + [engine.runner.decode_step(cache, t) for t in cont])
    assert torch.allclose(got, steps, atol=1e-4, rtol=1e-4)
