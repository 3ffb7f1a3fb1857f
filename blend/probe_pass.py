"""The query probe's forward pass: the question's rows alone, from the check layer to the top.

At the check layer c every row's fresh K/V is in the request's cache. The
probe runs the question's rows through layers c..L-1 over that, and above c
over the re-positioned cached KV of every document (what a ratio-0 blend would
read), recording the question's attention to each document row at every
layer. Its cost is the question's rows through L-c layers (a few percent of a
full prefill). It writes layers > c of the cache; the blend's own pass
rewrites every row of those layers afterwards.

Position layout (rows relative to e, the first re-positioned row)::

    rows   0 ........ nb-1 | nb ...... n-1
           document rows    | question rows   (q_rows = nb..n-1)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blend.kernels import rope_mix
from blend.kvcache import KVCache
from blend.layers import LayerWeights, ModelDims, attn_out, mlp_block, project_qkv, rms_norm
from blend.rope import apply_rope


@dataclass(frozen=True)
class ProbeRows:
    """The re-positioned rows a probe reads (the tensors of the blend's own row table)."""

    k: torch.Tensor  # (L, Hkv, n, D) cached K before RoPE
    v: torch.Tensor  # (L, Hkv, n, D) cached V
    pos: torch.Tensor  # (n,) int64 absolute positions
    cos: torch.Tensor  # (n, R)
    sin: torch.Tensor  # (n, R)
    nb: int  # document rows; rows >= nb are the question


def _attend_probs(q_rot: torch.Tensor, q_pos: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor,
                  k_pos: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a few queries with its probabilities.

    Args:
        q_rot: (Hq, S, D) after RoPE; k_all, v_all: (Hkv, T, D), K after RoPE.

    Returns:
        output (S, Hq D) in q's dtype, and probabilities (Hq, S, T) float32.
    """
    hq, s, dd = q_rot.shape
    hkv = k_all.shape[0]
    qg = q_rot.float().reshape(hkv, (hq // hkv) * s, dd)  # (Hkv, g S, D): query head h reads KV head h // g
    scores = torch.matmul(qg, k_all.float().transpose(1, 2)).view(hq, s, -1) * scale  # (Hq, S, T)
    scores = scores.masked_fill(~(k_pos[None, :] <= q_pos[:, None]), float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # (Hq, S, T)
    out = torch.matmul(probs.reshape(hkv, (hq // hkv) * s, -1), v_all.float()).view(hq, s, dd)  # (Hq, S, D)
    return out.transpose(0, 1).reshape(q_rot.shape[1], -1).to(q_rot.dtype), probs


def run_probe(layers: list[LayerWeights], dims: ModelDims, cache: KVCache, e: int, check: int,
              rows: ProbeRows, h_q: torch.Tensor, q_q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The question's attention to every document row at layers check..L-1.

    Args:
        layers: the model's layer weights.
        dims: model dimensions.
        cache: the request's cache; layer ``check`` holds fresh K/V of every row [e, e+n).
        e: cache row of the first re-positioned row.
        check: the check layer.
        rows: the re-positioned rows.
        h_q: (Nq, C) hidden rows of the question at the check layer's input.
        q_q: (Hq, Nq, D) the question's queries at the check layer (before RoPE).

    Returns:
        (L - check, nb) float32: attention mass from the question to each document
        row, mean over heads and question tokens, one row per layer; and (C,) the
        last question row's hidden state after the last layer (the probe's own
        first-token logits come from it: a ratio-0 blend with a fresh check layer).
    """
    n = rows.pos.shape[0]
    q_rows = torch.arange(rows.nb, n)  # (Nq,)
    k_pos = cache.pos[: e + n]  # (T,)
    cos, sin, pos = rows.cos[q_rows], rows.sin[q_rows], rows.pos[q_rows]
    out, h, q = [], h_q, q_q
    for layer in range(check, dims.num_layers):
        w = layers[layer]
        if layer > check:
            q, kh, vh = project_qkv(w, dims, rms_norm(h, w.input_norm, dims.eps))  # (Hq,Nq,D) (Hkv,Nq,D) x2
            k_mix, v_mix = rope_mix(rows.k[layer], rows.v[layer], rows.cos, rows.sin, q_rows, kh, vh,
                                    trusted_indices=True)  # (Hkv, n, D) x2
            cache.write(layer, e, k_mix, v_mix)
        k_all, v_all = cache.view(layer, e + n)  # (Hkv, T, D)
        attn, probs = _attend_probs(apply_rope(q, cos, sin), pos, k_all, v_all, k_pos, dims.scale)
        out.append(probs.mean(dim=(0, 1))[e:e + rows.nb])  # (nb,)
        h = mlp_block(w, dims, attn_out(w, h, attn))
    return torch.stack(out), h[-1]  # (L - check, nb), (C,)
