"""One decoder layer, as small named steps over the transformers weights.

The engine never calls the transformers modules' forward: it reads their
weights once (fusing q/k/v and gate/up into single GEMMs) and runs these
functions, so the blend path can run any step on any subset of rows.

Shapes: hidden rows are (S, C) with no batch dim; heads are head-major
(H, S, D) so attention and KV rows index along dim 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN


@dataclass(frozen=True)
class LayerWeights:
    """Weights of one decoder layer in the engine's dtype and device."""

    input_norm: torch.Tensor  # (C,)
    post_norm: torch.Tensor  # (C,)
    w_qkv: torch.Tensor  # ((Hq + 2 Hkv) D, C)
    b_qkv: torch.Tensor | None  # ((Hq + 2 Hkv) D,)  Qwen2 has q/k/v biases
    w_o: torch.Tensor  # (C, Hq D)
    w_gate_up: torch.Tensor  # (2 I, C)
    w_down: torch.Tensor  # (C, I)


@dataclass(frozen=True)
class ModelDims:
    """Static shape facts the steps need."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    eps: float
    act: str
    vocab: int
    max_positions: int

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5


def dims_of(config) -> ModelDims:
    """Read the model config into :class:`ModelDims`."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return ModelDims(
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        hidden=config.hidden_size,
        intermediate=config.intermediate_size,
        eps=config.rms_norm_eps,
        act=config.hidden_act,
        vocab=config.vocab_size,
        max_positions=context_length(config),
    )


def context_length(config) -> int:
    """Longest sequence the model serves: ``max_position_embeddings``, times the
    factor for dynamic-NTK RoPE (which rescales past the trained length by design)."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    n = int(config.max_position_embeddings)
    if isinstance(rope, dict) and "dynamic" in str(rope.get("rope_type", rope.get("type", ""))):
        return int(n * float(rope.get("factor", 1.0)))
    return n


def extract_layer(layer: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> LayerWeights:
    """Copy one transformers decoder layer's weights into a :class:`LayerWeights`."""
    att, mlp = layer.self_attn, layer.mlp

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(device=device, dtype=dtype).contiguous()

    biases = [p.bias for p in (att.q_proj, att.k_proj, att.v_proj)]
    b_qkv = None
    if any(b is not None for b in biases):
        b_qkv = cast(torch.cat([b if b is not None else torch.zeros(p.out_features)
                                for b, p in zip(biases, (att.q_proj, att.k_proj, att.v_proj))]))
    return LayerWeights(
        input_norm=cast(layer.input_layernorm.weight),
        post_norm=cast(layer.post_attention_layernorm.weight),
        w_qkv=cast(torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight])),
        b_qkv=b_qkv,
        w_o=cast(att.o_proj.weight),
        w_gate_up=cast(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])),
        w_down=cast(mlp.down_proj.weight),
    )


def rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32, as transformers does. h: (S, C) -> (S, C)."""
    dtype = h.dtype
    x = h.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def project_qkv(w: LayerWeights, dims: ModelDims, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Normed hidden rows -> q, k (before RoPE), v.

    Args:
        x: (S, C) normed hidden rows.

    Returns:
        q (Hq, S, D), k (Hkv, S, D), v (Hkv, S, D).
    """
    s = x.shape[0]
    qkv = F.linear(x, w.w_qkv, w.b_qkv)  # (S, (Hq + 2 Hkv) D)
    hq, hkv, d = dims.num_heads, dims.num_kv_heads, dims.head_dim
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q = q.view(s, hq, d).transpose(0, 1)  # (Hq, S, D)
    k = k.view(s, hkv, d).transpose(0, 1)  # (Hkv, S, D)
    v = v.view(s, hkv, d).transpose(0, 1)  # (Hkv, S, D)
    return q, k, v


def causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """Additive mask: 0 where key j is visible to query i (k_pos[j] <= q_pos[i]), -inf elsewhere.

    Returns:
        (S, T) mask in ``dtype``, or None when every key is visible to every query.
    """
    visible = k_pos[None, :] <= q_pos[:, None]  # (S, T)
    if bool(visible.all()):
        return None
    return torch.zeros(visible.shape, dtype=dtype, device=q_pos.device).masked_fill(~visible, float("-inf"))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           mask: torch.Tensor | None, causal: bool = False) -> torch.Tensor:
    """Grouped-query attention with the torch SDPA kernel.

    Args:
        q: (Hq, S, D) after RoPE; k, v: (Hkv, T, D) (k after RoPE).
        mask: (S, T) additive mask from :func:`causal_mask`, or None.
        causal: plain causal attention with S == T (ignores ``mask``).

    Returns:
        (S, Hq D) attention output rows.
    """
    gqa = q.shape[0] != k.shape[0]
    # 4-D inputs take SDPA's fused CPU kernel; 3-D ones fall back to the slow math path
    out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=None if causal else mask,
                                         is_causal=causal, scale=scale, enable_gqa=gqa)[0]  # (Hq, S, D)
    return out.transpose(0, 1).reshape(q.shape[1], -1)  # (S, Hq D)


def attend_suffix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Chunked-prefill attention: q are the last S rows of k/v; earlier keys all visible.

    Args:
        q: (Hq, S, D) after RoPE; k, v: (Hkv, T, D), T >= S.

    Returns:
        (S, Hq D) attention output rows.
    """
    from blend.kernels.reference import causal_suffix_attention

    out = causal_suffix_attention(q, k, v, scale)  # (Hq, S, D)
    return out.transpose(0, 1).reshape(q.shape[1], -1)  # (S, Hq D)


def attn_out(w: LayerWeights, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """Residual add of the attention output projection. (S, C)."""
    return h + F.linear(attn, w.w_o)


def mlp_block(w: LayerWeights, dims: ModelDims, h: torch.Tensor) -> torch.Tensor:
    """Residual SwiGLU MLP: h + down(act(gate(x)) * up(x)), x = norm(h). (S, C)."""
    x = rms_norm(h, w.post_norm, dims.eps)  # (S, C)
    gate, up = F.linear(x, w.w_gate_up).chunk(2, dim=-1)  # (S, I), (S, I)
    return h + F.linear(ACT2FN[dims.act](gate) * up, w.w_down)
