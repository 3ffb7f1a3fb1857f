"""K stored before RoPE and rotated at use reproduces the transformers keys, at any position."""

import pytest
import torch

from blend.engine import Engine
from blend.model import project_qkv, rms_norm
from blend.rope import apply_rope, apply_rope_into
from conftest import TINY_MODELS


@pytest.mark.parametrize("model", TINY_MODELS)
@pytest.mark.parametrize("offset", [0, 1000, 3000])
def test_rope_at_use_equals_transformers_keys(model, offset):
    eng = Engine.load(model)
    hf = eng.runner.loaded.model
    layer = hf.model.layers[0]
    x = torch.randn(1, 24, hf.config.hidden_size)
    pos = torch.arange(offset, offset + 24)
    with torch.no_grad():
        # transformers' own path: k_proj, then its rotary embedding at these positions
        cos, sin = hf.model.rotary_emb(x, pos[None])
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        normed = layer.input_layernorm(x)
        d = eng.dims
        k_hf = layer.self_attn.k_proj(normed).view(1, 24, d.num_kv_heads, d.head_dim).transpose(1, 2)
        q_hf = layer.self_attn.q_proj(normed).view(1, 24, d.num_heads, d.head_dim).transpose(1, 2)
        _, k_hf_rot = apply_rotary_pos_emb(q_hf, k_hf, cos, sin)
        # the engine: K before RoPE (as stored), rotated at use
        w = eng.runner.layers[0]
        _, k_pre, _ = project_qkv(w, d, rms_norm(x[0], w.input_norm, d.eps))
        c, s = eng.runner.rope(pos)
        k_rot = apply_rope(k_pre, c, s)
    assert torch.allclose(k_rot, k_hf_rot[0], atol=1e-5, rtol=1e-5)


def test_same_document_repositioned_keys_equal_rope_at_new_positions():
    """A chunk's stored K rotated at 0, 1000, 3000 equals RoPE applied there (kernel path)."""
    from blend.kernels import rope_mix

    eng = Engine.load("tiny-llama")
    k_pre = torch.randn(eng.dims.num_kv_heads, 50, eng.dims.head_dim)
    v = torch.randn_like(k_pre)
    for start in (0, 1000, 3000):
        pos = torch.arange(start, start + 50)
        cos, sin = eng.runner.rope(pos)
        k_mix, v_mix = rope_mix(k_pre, v, cos, sin, torch.empty(0, dtype=torch.long),
                                k_pre[:, :0], v[:, :0])
        assert torch.allclose(k_mix, apply_rope(k_pre, cos, sin), atol=1e-6)
        assert torch.equal(v_mix, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary", [64, 32])
def test_rope_into_is_bit_identical_to_apply_rope(dtype, rotary):
    """A stored segment's load rotates straight into the cache; cold == warm needs the same bits."""
    x = torch.randn(3, 40, 64).to(dtype)  # (H, T, D)
    ang = torch.randn(40, rotary // 2)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)  # (T, R) fp32
    buf = torch.full((3, 50, 64), float("nan"), dtype=dtype)  # (H, N, D): a cache's rows
    apply_rope_into(buf[:, 5:45], x, cos, sin)
    assert torch.equal(buf[:, 5:45], apply_rope(x, cos, sin))
    assert buf[:, :5].isnan().all() and buf[:, 45:].isnan().all()  # nothing outside the rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rotary", [64, 32])
@pytest.mark.parametrize("layout", ["contiguous", "heads-strided"])
def test_apply_rope_is_the_textbook_form_bit_for_bit(dtype, rotary, layout):
    """x*cos + rotate_half(x)*sin (what transformers computes, tables cast to x's dtype), without its
    temporaries: the same bits in every dtype, for a strided x (queries viewed out of a projection) too."""
    from blend.rope import rotate_half

    gen = torch.Generator().manual_seed(4)
    x = torch.randn(40, 3, 64, generator=gen).to(dtype).transpose(0, 1) if layout == "heads-strided" \
        else torch.randn(3, 40, 64, generator=gen).to(dtype)  # (H, T, D)
    ang = torch.randn(40, rotary // 2, generator=gen)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)  # (T, R) fp32
    c, s = cos.to(dtype), sin.to(dtype)
    rot = x[..., :rotary]
    textbook = torch.cat((rot * c + rotate_half(rot) * s, x[..., rotary:]), dim=-1)
    got = apply_rope(x, cos, sin)
    assert got.is_contiguous() and got.dtype == dtype
    assert torch.equal(got, textbook)


def _longrope_rotary(original: int = 512):
    """A Llama rotary module with LongRoPE (short factors up to ``original`` positions, long ones past it)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hd = 16
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=hd,
                      max_position_embeddings=4 * original,
                      rope_parameters={"rope_type": "longrope", "rope_theta": 10_000.0, "factor": 4.0,
                                       "short_factor": [1.0] * (hd // 2), "long_factor": [4.0] * (hd // 2),
                                       "original_max_position_embeddings": original})
    return LlamaRotaryEmbedding(cfg)


def test_longrope_tables_do_not_depend_on_what_was_built_before():
    """LongRoPE picks its short or long factors by the sequence's length (as dynamic NTK rescales by it):
    tables grown past that length by an earlier, shorter request must not leak into a later one (a cold
    and a warm engine would rotate the same rows differently), and the engine must know the length."""
    from blend.rope import RopeTables

    pos = torch.arange(400)  # within the 512 trained positions: short factors
    with torch.no_grad():
        want, _ = _longrope_rotary()(torch.zeros(1), pos[None])  # (1, 400, R) transformers' own
    cold = RopeTables(_longrope_rotary(), torch.device("cpu"))
    warm = RopeTables(_longrope_rotary(), torch.device("cpu"))
    warm(torch.arange(300))  # an earlier request: the tables then grow to 600 rows for the next one
    assert torch.equal(cold(pos)[0], want[0])
    assert torch.equal(warm(pos)[0], want[0])
    assert cold.dynamic and cold.length_dependent_after == 512
    after_long = RopeTables(_longrope_rotary(), torch.device("cpu"))
    after_long(torch.arange(700))  # past 512: LongRoPE's long factors, written into inv_freq in place
    assert torch.equal(after_long(pos)[0], want[0])  # the short factors again (they were overwritten: off by 2.2)
