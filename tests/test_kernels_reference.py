"""The torch references checked against independent naive formulations (the oracle's oracle),
and the argument checks both backends share."""

import math

import pytest
import torch

from blend.kernels import kv_deviation_ref, rope_mix_ref, sparse_query_attention_ref
from blend.kernels.testing import Layout, assert_close_tol, make_attention_inputs, make_rope_mix_inputs, rotary_tables

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _naive_rope_mix(inp):
    """Explicit loops: scatter fresh rows one by one, rotate dim pairs one by one, in float64."""
    k = inp.cached_k.double().clone()
    v = inp.cached_v.clone()
    for i, row in enumerate(inp.fresh_idx.tolist()):
        k[:, row] = inp.fresh_k[:, i].double()
        v[:, row] = inp.fresh_v[:, i]
    out = k.clone()
    r = inp.cos.shape[1]
    half = r // 2
    for t in range(k.shape[1]):
        for j in range(half):
            c1, s1 = inp.cos[t, j].item(), inp.sin[t, j].item()
            c2, s2 = inp.cos[t, half + j].item(), inp.sin[t, half + j].item()
            x1, x2 = k[:, t, j], k[:, t, half + j]
            out[:, t, j] = x1 * c1 - x2 * s1
            out[:, t, half + j] = x2 * c2 + x1 * s2
    return out, v


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d,r", [(16, 16), (12, 8)])
def test_rope_mix_ref_matches_naive_loops(dtype, d, r):
    inp = make_rope_mix_inputs(hkv=2, t=9, d=d, rot_dim=r, fresh_idx=torch.tensor([7, 2, 4]), dtype=dtype)
    k_ref, v_ref = rope_mix_ref(*inp.args())
    k_naive, v_naive = _naive_rope_mix(inp)
    assert_close_tol(k_ref, k_naive.to(dtype))
    assert torch.equal(v_ref, v_naive)


@pytest.mark.parametrize("rope_scaling", [
    None,
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
])
def test_rope_mix_ref_matches_hf_apply_rotary_pos_emb(rope_scaling):
    """HF's own tables (any scaling, YaRN attention factor included) plug straight into rope_mix."""
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    from transformers import LlamaConfig

    d, hkv, t = 32, 2, 11
    cfg = LlamaConfig(hidden_size=d * 4, num_attention_heads=4, num_key_value_heads=hkv,
                      max_position_embeddings=256, rope_scaling=rope_scaling)
    positions = torch.arange(t) + 150  # the chunk's new absolute positions
    rotary = llama.LlamaRotaryEmbedding(config=cfg)
    cos, sin = rotary(torch.zeros(1, t, d), positions[None])  # (1, T, D)
    k = torch.randn(hkv, t, d)
    fresh_idx = torch.tensor([10, 3])
    fresh_k = torch.randn(hkv, 2, d)
    k_ours, _ = rope_mix_ref(k, torch.zeros_like(k), cos[0], sin[0], fresh_idx, fresh_k, torch.zeros(hkv, 2, d))
    mixed = k.index_copy(1, fresh_idx, fresh_k)
    _, k_hf = llama.apply_rotary_pos_emb(mixed[None], mixed[None], cos, sin)  # (1, Hkv, T, D)
    assert_close_tol(k_ours, k_hf[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kv_deviation_ref_matches_naive_loops(dtype):
    fresh, cached = torch.randn(3, 6, 10).to(dtype), torch.randn(3, 6, 10).to(dtype)
    expected = torch.empty(6)
    for s in range(6):
        total = 0.0
        for h in range(3):
            for d in range(10):
                total += (fresh[h, s, d].double().item() - cached[h, s, d].double().item()) ** 2
        expected[s] = math.sqrt(total)
    assert_close_tol(kv_deviation_ref(fresh, cached), expected, torch.float32)


def _naive_attention(q, q_pos, k, v, k_pos, scale):
    """Per head, per query: explicit masked softmax in float64; no visible key -> zeros."""
    hq, s, d = q.shape
    group = hq // k.shape[0]
    out = torch.zeros(hq, s, d, dtype=torch.float64)
    for h in range(hq):
        kh, vh = k[h // group].double(), v[h // group].double()
        for i in range(s):
            visible = [j for j in range(k.shape[1]) if k_pos[j] <= q_pos[i]]
            if not visible:
                continue
            logits = torch.stack([(q[h, i].double() * kh[j]).sum() * scale for j in visible])
            w = torch.exp(logits - logits.max())
            w = w / w.sum()
            out[h, i] = sum(w[n] * vh[j] for n, j in enumerate(visible))
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [1, 3])
def test_sparse_attention_ref_matches_naive_loops(dtype, group):
    k_pos = torch.tensor([4, 0, 9, 2, 2, 7, 5, 8, 1])  # shuffled, one repeated
    inp = make_attention_inputs(hkv=2, group=group, t=9, d=8, q_rows=torch.tensor([3, 1, 7]), dtype=dtype,
                                layout=Layout.TOKEN_MAJOR, k_pos=k_pos)
    q_pos = torch.tensor([2, 0, -1])  # the last query sees nothing
    expected = _naive_attention(inp.q, q_pos, inp.k, inp.v, inp.k_pos, inp.scale)
    actual = sparse_query_attention_ref(inp.q, q_pos, inp.k, inp.v, inp.k_pos, inp.scale)
    assert actual.dtype == dtype
    assert_close_tol(actual, expected.to(dtype))
    assert torch.equal(actual[:, 2], torch.zeros_like(actual[:, 2]))


def test_sparse_attention_ref_all_rows_equals_causal_sdpa():
    """Every row selected at positions 0..T-1 is plain causal attention."""
    t, d = 23, 16
    inp = make_attention_inputs(hkv=1, group=2, t=t, d=d, q_rows=torch.arange(t), dtype=torch.float32,
                                k_pos=torch.arange(t))
    expected = torch.nn.functional.scaled_dot_product_attention(
        inp.q, inp.k.expand(2, t, d), inp.v.expand(2, t, d), is_causal=True)
    assert_close_tol(sparse_query_attention_ref(*inp.args()), expected)


def test_rotary_tables_match_hf_default():
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=64 * 2, num_attention_heads=2, rope_theta=1e5)
    pos = torch.arange(40) * 3  # small positions: HF builds its tables in fp32, ours in fp64
    cos, sin = llama.LlamaRotaryEmbedding(config=cfg)(torch.zeros(1, 40, 64), pos[None])
    ours_cos, ours_sin = rotary_tables(pos, 64, base=1e5)
    assert_close_tol(ours_cos, cos[0])
    assert_close_tol(ours_sin, sin[0])


# ---- argument checks (shared by both backends) ------------------------------------------

def _rope_args(**over):
    inp = make_rope_mix_inputs(hkv=2, t=8, d=16, rot_dim=16, fresh_idx=torch.tensor([1, 5]), dtype=torch.float32)
    args = dict(zip(["cached_k", "cached_v", "cos", "sin", "fresh_idx", "fresh_k", "fresh_v"], inp.args()))
    args.update(over)
    return args


@pytest.mark.parametrize("over,match", [
    (dict(fresh_idx=torch.tensor([5, 5])), "duplicate"),
    (dict(fresh_idx=torch.tensor([1, 8])), r"\[0, 8\)"),
    (dict(fresh_idx=torch.tensor([1, 5], dtype=torch.int32)), "int64"),
    (dict(fresh_k=torch.randn(2, 3, 16)), "fresh_k"),
    (dict(cached_v=torch.randn(2, 8, 16, dtype=torch.float16)), "dtype"),
    (dict(cos=torch.randn(8, 18), sin=torch.randn(8, 18)), "rotary dim"),
    (dict(cos=torch.randn(8, 6), sin=torch.randn(8, 7)), "sin"),
    (dict(cached_k=torch.randn(2, 8, 16, dtype=torch.float64)), "fp32/fp16/bf16"),
])
def test_rope_mix_ref_rejects_bad_arguments(over, match):
    with pytest.raises(ValueError, match=match):
        rope_mix_ref(**_rope_args(**over))


@pytest.mark.parametrize("over,match", [
    (dict(k=torch.randn(3, 9, 8), v=torch.randn(3, 9, 8)), "multiple"),
    (dict(q_pos=torch.tensor([1, 2])), "q_pos"),
    (dict(k_pos=torch.arange(9, dtype=torch.int32)), "int64"),
    (dict(v=torch.randn(2, 9, 8, dtype=torch.bfloat16)), "dtype"),
    (dict(scale=torch.tensor(0.3)), "scale"),
])
def test_sparse_attention_ref_rejects_bad_arguments(over, match):
    inp = make_attention_inputs(hkv=2, group=2, t=9, d=8, q_rows=torch.tensor([3, 1, 7]), dtype=torch.float32)
    args = dict(q=inp.q, q_pos=inp.q_pos, k=inp.k, v=inp.v, k_pos=inp.k_pos, scale=inp.scale)
    args.update(over)
    with pytest.raises(ValueError, match=match):
        sparse_query_attention_ref(**args)


def test_kv_deviation_ref_rejects_shape_mismatch():
    with pytest.raises(ValueError, match="match"):
        kv_deviation_ref(torch.randn(2, 3, 4), torch.randn(2, 4, 4))
