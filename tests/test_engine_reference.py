"""Invariant 1: with no reuse the engine equals the transformers forward."""

import pytest
import torch

from blend.engine import Engine
from blend.policy import ReusePolicy
from conftest import TINY_MODELS, make_docs


@pytest.mark.parametrize("model", TINY_MODELS)
def test_logits_equal_transformers(model):
    eng = Engine.load(model)
    prompt = eng.build_prompt("Which word comes first?", make_docs(3))
    hf = eng.runner.loaded.model
    with torch.no_grad():
        ref = hf(torch.tensor([prompt.token_ids])).logits[0, -1].float()
    for policy in (ReusePolicy.none(), ReusePolicy.exact()):
        ans = eng.generate(prompt, policy, max_new_tokens=1)
        assert (ans.first_logits - ref).abs().max().item() <= 1e-4, policy


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2"])
def test_greedy_matches_transformers_generate(model):
    eng = Engine.load(model)
    prompt = eng.build_prompt("Name a word.", make_docs(2, words=20))
    hf = eng.runner.loaded.model
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt.token_ids]), max_new_tokens=12, do_sample=False,
                          eos_token_id=sorted(eng.eos_ids), pad_token_id=256)
    want = out[0, len(prompt):].tolist()
    want = [t for t in want if t not in eng.eos_ids]
    got = eng.generate(prompt, ReusePolicy.exact(), max_new_tokens=12, stop_at_newline=False)
    assert got.token_ids == want


def test_bf16_close_to_transformers_bf16():
    eng = Engine.load("tiny-llama", dtype="bfloat16")
    prompt = eng.build_prompt("Which?", make_docs(2, words=15))
    hf = eng.runner.loaded.model.to(torch.bfloat16)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt.token_ids])).logits[0, -1].float()
    ans = eng.generate(prompt, ReusePolicy.none(), max_new_tokens=1)
    assert (ans.first_logits - ref).abs().max().item() <= 0.05
    assert int(ans.first_logits.argmax()) == int(ref.argmax())


def test_prompt_too_long_is_a_clear_error():
    from blend.errors import PromptTooLongError

    eng = Engine.load("tiny-llama")
    prompt = eng.build_prompt("q?", ["word " * 900])  # ~4.5k byte tokens > 4096 positions
    with pytest.raises(PromptTooLongError, match="exceeds the model's context"):
        eng.generate(prompt)


def test_dynamic_ntk_rope_follows_transformers_past_the_original_length():
    """Dynamic NTK: tables depend on the longest position of each forward, prefill and decode alike."""
    eng = Engine.load("tiny-llama-rope-dynamic")
    short = eng.build_prompt("Which?", make_docs(1, words=10))
    long = eng.build_prompt("Which word comes first?", make_docs(3, words=40))
    assert len(short) < 512 < len(long)  # original length 512 (context 512 x factor 4)
    hf = eng.runner.loaded.model
    for prompt in (short, long):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt.token_ids])).logits[0, -1].float()
        ans = eng.generate(prompt, ReusePolicy.none(), max_new_tokens=1)
        assert (ans.first_logits - ref).abs().max().item() <= 1e-4, len(prompt)
    with torch.no_grad():
        out = hf.generate(torch.tensor([long.token_ids]), max_new_tokens=8, do_sample=False,
                          eos_token_id=sorted(eng.eos_ids), pad_token_id=256)
    want = [t for t in out[0, len(long):].tolist() if t not in eng.eos_ids]
    got = eng.generate(long, ReusePolicy.none(), max_new_tokens=8, stop_at_newline=False)
    assert got.token_ids == want
    # past the original length a KV depends on the request's length: reuse is refused, said so,
    # and the answer is full prefill's, bit for bit (nothing stored)
    full = eng.generate(long, ReusePolicy.none(), max_new_tokens=1)
    for policy in (ReusePolicy.exact(), ReusePolicy.blend(ratio=0.2, force=True)):
        ans = eng.generate(long, policy, max_new_tokens=1)
        assert torch.equal(ans.first_logits, full.first_logits)
        assert "dynamic-NTK" in ans.report.gate
        assert {s.reuse_class.value for s in ans.report.segments[:-1]} == {"fallback"}
    assert eng.store.stats().entries == 0
    # within the original length the tables are the default ones: exact reuse as usual
    cold, warm = (eng.generate(short, ReusePolicy.exact(), max_new_tokens=1) for _ in range(2))
    assert torch.equal(cold.first_logits, warm.first_logits) and warm.report.reused_tokens > 0
    # the tables are a function of the length alone, whatever the module saw before
    a = eng.runner.rope(torch.arange(600))[0].clone()
    eng.runner.rope(torch.arange(1500))
    assert torch.equal(eng.runner.rope(torch.arange(600))[0], a)
    assert eng.dims.max_positions == 2048
