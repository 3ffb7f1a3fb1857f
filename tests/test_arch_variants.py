"""Config variants of the supported architectures (Llama, Qwen2, Mistral): each one either keeps the invariants
(logits equal transformers', cold == warm bit for bit, blend at ratio 1.0 == full prefill, exact reuse
bit-identical to computing from scratch) or is refused with an error that names the config field."""

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, Qwen2Config

from blend.engine import Engine
from blend.engine_setup import EngineConfig
from blend.errors import PromptTooLongError, UnknownModelError
from blend.fingerprints import tokenizer_fingerprint, weights_fingerprint
from blend.gate import QualityGate
from blend.model import ModelRunner
from blend.models import LoadedModel
from blend.policy import ReusePolicy
from blend.tiny import build_from_config
from conftest import make_docs

_BASE = dict(vocab_size=259, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=4096,
             num_attention_heads=4, num_key_value_heads=2, bos_token_id=257, eos_token_id=258, pad_token_id=256,
             tie_word_embeddings=False)


def _rope(rope_type: str, **kw) -> dict:
    return {"rope_parameters": {"rope_type": rope_type, "rope_theta": 10_000.0, **kw}}


def _engine(cls, **kw) -> Engine:
    """A fresh engine (its own empty store, no gate) over a random model of ``cls(**_BASE, **kw)``."""
    model, tok = build_from_config(cls(**{**_BASE, **kw}))
    loaded = LoadedModel("variant", model, tok, weights_fingerprint(model), tokenizer_fingerprint(tok))
    return Engine(ModelRunner(loaded, torch.float32, torch.device("cpu")), EngineConfig("variant", quality_gate=False))


def _blend(ratio: float, **kw) -> ReusePolicy:
    return ReusePolicy.blend(ratio=ratio, guard_margin=None, **kw)


VARIANTS = {
    "llama-kv1": (LlamaConfig, {"num_key_value_heads": 1}),
    "llama-kv-eq-heads": (LlamaConfig, {"num_key_value_heads": 4}),
    "qwen2-kv1": (Qwen2Config, {"num_key_value_heads": 1}),
    "mistral-no-window": (MistralConfig, {"sliding_window": None}),
    "llama-head-dim-32": (LlamaConfig, {"head_dim": 32}),  # != hidden / heads = 16
    "qwen2-head-dim-8": (Qwen2Config, {"head_dim": 8}),
    "llama-tied": (LlamaConfig, {"tie_word_embeddings": True}),
    "qwen2-tied": (Qwen2Config, {"tie_word_embeddings": True}),
    "llama-theta-1e6": (LlamaConfig, _rope("default", rope_theta=1e6)),
    "qwen2-yarn": (Qwen2Config, _rope("yarn", factor=4.0, original_max_position_embeddings=1024)),
    "llama-yarn-attention-factor": (LlamaConfig, _rope("yarn", factor=4.0, original_max_position_embeddings=1024,
                                                       attention_factor=0.8, beta_fast=16.0, beta_slow=2.0)),
    "llama-longrope": (LlamaConfig, _rope("longrope", factor=4.0, short_factor=[1.0] * 8, long_factor=[4.0] * 8,
                                          original_max_position_embeddings=1024)),
    "llama-partial-rotary-default-rope": (LlamaConfig, _rope("default", partial_rotary_factor=0.5)),  # not read
    "llama-eps-1e-2": (LlamaConfig, {"rms_norm_eps": 1e-2}),
    "llama-gelu-tanh": (LlamaConfig, {"hidden_act": "gelu_pytorch_tanh"}),
    "qwen2-relu": (Qwen2Config, {"hidden_act": "relu"}),
    # a window that no layer applies: Llama's attention reads none; Qwen2's layers are all full attention
    "llama-stray-sliding-window": (LlamaConfig, {"sliding_window": 32}),
    "qwen2-window-on-no-layer": (Qwen2Config, {"use_sliding_window": True, "sliding_window": 32,
                                               "max_window_layers": 2}),
    "llama-one-layer": (LlamaConfig, {"num_hidden_layers": 1}),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_keeps_the_invariants(variant):
    cls, kw = VARIANTS[variant]
    eng = _engine(cls, **kw)
    prompt = eng.build_prompt("Which?", make_docs(3, words=12))
    assert len(prompt) > 64  # longer than any window above
    with torch.no_grad():
        ref = eng.runner.loaded.model(torch.tensor([prompt.token_ids])).logits[0, -1].float()
    full = eng.generate(prompt, ReusePolicy.none(), max_new_tokens=1).first_logits
    assert (full - ref).abs().max().item() <= 1e-4
    cold, warm = (eng.generate(prompt, ReusePolicy.exact(), max_new_tokens=1) for _ in range(2))
    assert warm.report.reused_tokens > 0
    assert torch.equal(cold.first_logits, full) and torch.equal(warm.first_logits, full)
    # one layer: no layer 1 to check at; a query-ranked blend checks at layer 0
    layers = {"check_layers": (0,), "selector": "query"} if eng.dims.num_layers == 1 else {}
    one = eng.generate(prompt, _blend(1.0, **layers), max_new_tokens=1).first_logits
    assert (one - full).abs().max().item() <= 1e-4
    fresh = _engine(cls, **kw)
    blends = [e.generate(prompt, _blend(0.15, **layers), max_new_tokens=1) for e in (fresh, fresh, eng)]
    assert all(torch.equal(b.first_logits, blends[0].first_logits) for b in blends[1:])


def test_the_rotary_module_is_left_usable_by_transformers_after_longrope_tables():
    """The engine builds LongRoPE tables through the transformers model's own rotary module, under inference
    mode: its inv_freq became an inference tensor, and the model's next forward outside inference mode failed
    (LongRoPE updates inv_freq in place: 'Inplace update to inference tensor outside InferenceMode')."""
    eng = _engine(LlamaConfig, **VARIANTS["llama-longrope"][1])
    ids = torch.tensor([eng.build_prompt("Which?", make_docs(1, words=8)).token_ids])
    hf = eng.runner.loaded.model
    with torch.no_grad():
        before = hf(ids).logits
    eng.generate(eng.build_prompt("Which?", make_docs(2, words=8)), ReusePolicy.exact(), max_new_tokens=2)
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, before)


def test_longrope_past_its_trained_length_refuses_reuse_and_equals_transformers():
    eng = _engine(LlamaConfig, max_position_embeddings=512,
                  **_rope("longrope", factor=4.0, short_factor=[1.0] * 8, long_factor=[4.0] * 8,
                          original_max_position_embeddings=64))
    prompt = eng.build_prompt("Which?", make_docs(3, words=12))
    assert 64 < len(prompt) <= 512
    with torch.no_grad():
        ref = eng.runner.loaded.model(torch.tensor([prompt.token_ids])).logits[0, -1].float()
    full = eng.generate(prompt, ReusePolicy.none(), max_new_tokens=1).first_logits
    assert (full - ref).abs().max().item() <= 1e-4
    for policy in (ReusePolicy.exact(), _blend(0.2, force=True)):
        ans = eng.generate(prompt, policy, max_new_tokens=1)
        assert torch.equal(ans.first_logits, full)
        assert "LongRoPE changes past 64 positions" in ans.report.gate
    assert eng.store.stats().entries == 0


def test_a_window_transformers_applies_refuses_longer_prompts_naming_the_field():
    """Within its window a windowed model is full attention (computed); past it the engine refuses (it attends to
    every earlier key), naming sliding_window; without a window the limit names max_position_embeddings."""
    docs = make_docs(3, words=12)
    for cls, kw in ((MistralConfig, {"sliding_window": 32}),
                    (Qwen2Config, {"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 1})):
        eng = _engine(cls, **kw)
        assert eng.dims.max_positions == 32
        with pytest.raises(PromptTooLongError, match="context of 32 .*sliding_window=32"):
            eng.generate(eng.build_prompt("Which?", docs), max_new_tokens=1)
    short = _engine(LlamaConfig, max_position_embeddings=48)
    with pytest.raises(PromptTooLongError, match=r"context of 48 \(max_position_embeddings=48\)"):
        short.generate(short.build_prompt("Which?", docs), max_new_tokens=1)
    dynamic = _engine(LlamaConfig, max_position_embeddings=16, **_rope("dynamic", factor=2.0))
    with pytest.raises(PromptTooLongError, match="max_position_embeddings=16 x the dynamic-NTK RoPE factor 2"):
        dynamic.generate(dynamic.build_prompt("Which?", docs), max_new_tokens=1)


def test_query_heads_not_split_evenly_over_kv_heads_are_refused_at_load():
    """transformers builds such a model and fails on every forward; the engine failed on every request with
    a shape error from its attention kernel."""
    with pytest.raises(UnknownModelError, match="num_attention_heads=6 is not a multiple of num_key_value_heads=4"):
        _engine(LlamaConfig, hidden_size=96, num_attention_heads=6, num_key_value_heads=4)


def test_a_one_layer_model_refuses_gated_blends_clearly():
    """The quality gate's blends check at layer 1: on a one-layer model every gated blend request raised an error
    about check layers (1,), which the request (checking at layer 0) never asked for."""
    eng = _engine(LlamaConfig, num_hidden_layers=1)
    eng.gate = QualityGate(progress=False)
    prompt = eng.build_prompt("Which?", make_docs(2, words=12))
    full = eng.generate(prompt, ReusePolicy.none(), max_new_tokens=1)
    ans = eng.generate(prompt, ReusePolicy.blend(check_layers=(0,), selector="query"), max_new_tokens=1)
    assert "num_hidden_layers=1" in ans.report.gate and "force" in ans.report.gate
    assert torch.equal(ans.first_logits, full.first_logits)
    forced = eng.generate(prompt, ReusePolicy.blend(ratio=1.0, check_layers=(0,), selector="query", force=True,
                                                    guard_margin=None), max_new_tokens=1)
    assert not forced.report.gate and (forced.first_logits - full.first_logits).abs().max().item() <= 1e-4
