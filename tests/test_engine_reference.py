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
