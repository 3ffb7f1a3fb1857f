"""A model's shape and one decoder layer's weights, read once from a transformers model.

:func:`dims_of` reads the config into :class:`ModelDims` (the context it serves included: a sliding
window or dynamic-NTK RoPE change it); :func:`extract_layer` copies a layer's weights into a
:class:`LayerWeights`, q/k/v and gate/up fused into single GEMMs, refusing projections whose weight alone
does not say what they compute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blend.errors import UnknownModelError


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
    context_from: str  # the config field(s) that set max_positions (named by the error that refuses a longer prompt)

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5


def dims_of(config) -> ModelDims:
    """Read the model config into :class:`ModelDims`.

    Args:
        config: a transformers Llama/Qwen2/Mistral config.

    Returns:
        Its dims.

    Raises:
        UnknownModelError: query heads that do not split evenly over the K/V heads (transformers' own
            attention fails on every forward of such a model).
    """
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % kv_heads:
        raise UnknownModelError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}: "
                                "grouped-query attention needs each K/V head to serve the same number of query heads")
    limit, context_from = context_length(config)
    return ModelDims(
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        hidden=config.hidden_size,
        intermediate=config.intermediate_size,
        eps=config.rms_norm_eps,
        act=config.hidden_act,
        vocab=config.vocab_size,
        max_positions=limit,
        context_from=context_from,
    )


def sliding_window(config) -> int | None:
    """The attention window transformers' attention applies for this config, else None.

    Mistral: ``sliding_window`` on every layer. Qwen2: ``sliding_window`` on the layers its ``layer_types``
    mark ``sliding_attention`` (transformers derives them from ``use_sliding_window`` and
    ``max_window_layers``; with none of them, or ``use_sliding_window`` off, there is no window). Llama: none,
    whatever its config carries (its attention reads no window). Another type's window is taken as given.

    Args:
        config: a transformers config.

    Returns:
        The window, in tokens, or None where the model's attention has none.
    """
    window = getattr(config, "sliding_window", None)
    model_type = getattr(config, "model_type", "")
    if not window or model_type == "llama":
        return None
    if model_type == "qwen2":
        types = getattr(config, "layer_types", None)
        if not getattr(config, "use_sliding_window", False) or (types is not None and "sliding_attention" not in types):
            return None
    return int(window)


def context_length(config) -> tuple[int, str]:
    """Longest sequence the model serves: ``max_position_embeddings``, times the
    factor for dynamic-NTK RoPE (which rescales past the trained length by design), at most a
    sliding attention window: the engine attends to every earlier key, which is the windowed
    model's attention only while a sequence fits in its window.

    Args:
        config: a transformers config (``max_position_embeddings`` required).

    Returns:
        The length, and the config field(s) that set it (for the error that refuses a longer prompt).
    """
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    n = int(config.max_position_embeddings)
    source = f"max_position_embeddings={n}"
    if isinstance(rope, dict) and "dynamic" in str(rope.get("rope_type", rope.get("type", ""))):
        factor = float(rope.get("factor", 1.0))
        n = int(n * factor)
        source += f" x the dynamic-NTK RoPE factor {factor:g}"
    window = sliding_window(config)
    if window is not None and window < n:
        return window, (f"sliding_window={window}: kvblend attends to every earlier key, which is the model's "
                        "windowed attention only while a sequence fits in the window")
    return n, source


def extract_layer(layer: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> LayerWeights:
    """Copy one transformers decoder layer's weights into a :class:`LayerWeights`.

    Args:
        layer: one decoder layer of a transformers Llama-family model.
        dtype: the dtype of the copies.
        device: where the copies live.

    Returns:
        Its weights, q/k/v and gate/up fused, contiguous.

    Raises:
        UnknownModelError: a projection that is not a plain ``torch.nn.Linear``, or a bias other than q/k/v's.
    """
    att, mlp = layer.self_attn, layer.mlp

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(device=device, dtype=dtype).contiguous()

    linears = (att.q_proj, att.k_proj, att.v_proj, att.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    odd = sorted({type(m).__name__ for m in linears if type(m) is not torch.nn.Linear})
    if odd:  # a quantized or adapted projection computes more than its .weight: refused, never read raw
        raise UnknownModelError(f"projection layers of type {', '.join(odd)} are not supported (torch Linear only)")
    extra = [name for name, m in (("o_proj", att.o_proj), ("gate_proj", mlp.gate_proj), ("up_proj", mlp.up_proj),
                                  ("down_proj", mlp.down_proj)) if getattr(m, "bias", None) is not None]
    if extra:  # only the q/k/v biases are carried (Qwen2's): refuse rather than drop these
        raise UnknownModelError(f"biases on {', '.join(extra)} are not supported (a config with attention_bias or "
                                "mlp_bias); only q/k/v biases are")
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
