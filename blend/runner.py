"""The engine's own forward: segment prefill, segment load, decode step.

A prompt is run segment by segment over one :class:`KVCache`. Computing a
segment and loading it from the store are interchangeable: both leave the
same rows (K after RoPE at the segment's positions, V) in the cache, which is
what makes the cold path and the hit path the same program.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from blend.kvcache import KVCache
from blend.layers import (
    LayerWeights, ModelDims, attend, attend_suffix, attn_out, causal_mask, dims_of, extract_layer, mlp_block,
    project_qkv, rms_norm,
)
from blend.models import LoadedModel
from blend.rope import RopeTables, apply_rope


@dataclass(frozen=True)
class SegmentKV:
    """What a computed segment leaves for the store: K before RoPE and V, all layers."""

    k: torch.Tensor  # (L, Hkv, S, D)
    v: torch.Tensor  # (L, Hkv, S, D)


class ModelRunner:
    """Runs a loaded transformers model with the engine's layer loop.

    Args:
        loaded: model, tokenizer and fingerprints.
        dtype: compute dtype.
        device: compute device.
    """

    def __init__(self, loaded: LoadedModel, dtype: torch.dtype, device: torch.device) -> None:
        hf = loaded.model
        self.loaded = loaded
        self.dtype = dtype
        self.device = device
        self.dims: ModelDims = dims_of(hf.config)
        base = hf.model
        self.embed_w = base.embed_tokens.weight.detach().to(device=device, dtype=dtype)  # (V, C)
        self.final_norm = base.norm.weight.detach().to(device=device, dtype=dtype)  # (C,)
        self.lm_head = hf.lm_head.weight.detach().to(device=device, dtype=dtype)  # (V, C)
        self.layers: list[LayerWeights] = [extract_layer(layer, dtype, device) for layer in base.layers]
        self.rope = RopeTables(base.rotary_emb.to(device), device)

    # ---- small steps -------------------------------------------------------------------

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """(S,) int64 -> (S, C) hidden rows."""
        return F.embedding(ids, self.embed_w)

    def logits(self, h_last: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head of hidden rows (S, C) -> (S, V) float32."""
        return F.linear(rms_norm(h_last, self.final_norm, self.dims.eps), self.lm_head).float()

    def new_cache(self, capacity: int) -> KVCache:
        d = self.dims
        return KVCache(d.num_layers, d.num_kv_heads, d.head_dim, capacity, self.dtype, self.device)

    # ---- segments ----------------------------------------------------------------------

    def prefill(self, cache: KVCache, ids: torch.Tensor, keep_kv: bool = True) -> tuple[torch.Tensor, SegmentKV | None]:
        """Compute a segment appended at the end of ``cache`` (positions continue).

        Args:
            cache: the request's cache; rows [0, cache.length) are visible context.
            ids: (S,) token ids.
            keep_kv: also return the segment's K (before RoPE) and V for the store.

        Returns:
            hidden rows after the last layer (S, C), and the segment's KV (or None).
        """
        d = self.dims
        start = cache.length
        s = ids.shape[0]
        pos = torch.arange(start, start + s, device=self.device)  # (S,)
        cos, sin = self.rope(pos)  # (S, R)
        cache.set_positions(start, pos)
        causal = start == 0
        # appended after context that sits before it (always, unless rows were re-positioned):
        # chunked prefill without a materialised mask
        suffix = not causal and s > 1 and int(cache.pos[:start].max()) < start
        mask = None if causal or suffix else causal_mask(pos, cache.pos[: start + s], self.dtype)  # (S, T)
        ks, vs = [], []
        h = self.embed(ids)  # (S, C)
        for i, w in enumerate(self.layers):
            q, k, v = project_qkv(w, d, rms_norm(h, w.input_norm, d.eps))  # (Hq,S,D) (Hkv,S,D) x2
            if keep_kv:
                ks.append(k)
                vs.append(v)
            cache.write(i, start, apply_rope(k, cos, sin), v)
            k_all, v_all = cache.view(i, start + s)  # (Hkv, T, D)
            q_rot = apply_rope(q, cos, sin)  # (Hq, S, D)
            if suffix:
                attn = attend_suffix(q_rot, k_all, v_all, d.scale)  # (S, Hq D)
            else:
                attn = attend(q_rot, k_all, v_all, d.scale, mask, causal)  # (S, Hq D)
            h = attn_out(w, h, attn)
            h = mlp_block(w, d, h)
        cache.advance(s)
        seg = SegmentKV(torch.stack(ks), torch.stack(vs)) if keep_kv else None  # (L, Hkv, S, D)
        return h, seg

    def load(self, cache: KVCache, seg: SegmentKV) -> None:
        """Append a stored segment (K before RoPE) to ``cache`` at the next positions."""
        start = cache.length
        s = seg.k.shape[2]
        pos = torch.arange(start, start + s, device=self.device)  # (S,)
        cos, sin = self.rope(pos)  # (S, R)
        cache.set_positions(start, pos)
        for i in range(self.dims.num_layers):
            k = seg.k[i].to(device=self.device, dtype=self.dtype)  # (Hkv, S, D)
            v = seg.v[i].to(device=self.device, dtype=self.dtype)  # (Hkv, S, D)
            cache.write(i, start, apply_rope(k, cos, sin), v)
        cache.advance(s)

    def decode_step(self, cache: KVCache, token: int) -> torch.Tensor:
        """Feed one token; return next-token logits (V,) float32."""
        h, _ = self.prefill(cache, torch.tensor([token], device=self.device), keep_kv=False)
        return self.logits(h[-1:])[0]
