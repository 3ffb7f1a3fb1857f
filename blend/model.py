"""The engine's own forward over a transformers model's weights.

The engine never calls the transformers modules' forward: it reads their
weights once (fusing q/k/v and gate/up into single GEMMs: :mod:`blend.layer_weights`) and runs ONE
per-layer function, :func:`layer_forward`, for every kind of pass:

    layer_forward(w, dims, layer, h, rows)
        x = norm(h); q, k, v = project(x)        every active row
        q, h = rows.store_kv(layer, q, k, v, h)  where this layer's K/V go (a blend
                                                 check may drop rows here)
        attn = rows.attend(layer, q)             what the queries read
        h = h + o(attn); h = h + mlp(norm(h))

A :class:`LayerRows` says where K/V go and what is attended: :class:`AppendRows`
(a segment appended at the end of the cache: prefill, chunked prefill, decode)
here, and the blend path's re-positioned rows in :mod:`blend.blending`.

Computing a segment and loading it from the store are interchangeable: both
leave the same rows (K after RoPE at the segment's positions, V) in the
cache, which is what makes the cold path and the hit path the same program.

Shapes: hidden rows are (S, C) with no batch dim; heads are head-major
(H, S, D) so attention and KV rows index along dim 1.
"""

from __future__ import annotations

from dataclasses import replace
from enum import Enum
from functools import lru_cache
import threading
from typing import Callable, Protocol, Sequence

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from blend.cancel import PrefillCancelled, cancel_flag
from blend.gemm import GemmBackend, dense, linear, pack, packs_natively
from blend.kernels.suffix_attention import causal_suffix_attention, causal_suffix_attention_parts
from blend.kvcache import KVCache, KVEntry
from blend.kv_load import load_entries
from blend.kvpool import KVBufferPool
from blend.layer_weights import LayerWeights, ModelDims, dims_of, extract_layer
from blend.errors import UnknownModelError
from blend.models import LoadedModel
from blend.rope import RopeTables, apply_rope, partial_rotary_factor


# ---- the steps of one layer -------------------------------------------------------------

def rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32, as transformers does. h: (S, C) -> (S, C).

    Args:
        h: hidden rows, (S, C).
        weight: the norm's scale, (C,).
        eps: the config's epsilon, added to the mean square.

    Returns:
        The normalized rows, (S, C) in ``h``'s dtype (times ``weight``, in its dtype's promotion).
    """
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
    qkv = linear(x.to(w.w_qkv.dtype), w.w_qkv, w.b_qkv).to(x.dtype)  # (S, (Hq + 2 Hkv) D)
    hq, hkv, d = dims.num_heads, dims.num_kv_heads, dims.head_dim
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q = q.view(s, hq, d).transpose(0, 1)  # (Hq, S, D)
    k = k.view(s, hkv, d).transpose(0, 1)  # (Hkv, S, D)
    v = v.view(s, hkv, d).transpose(0, 1)  # (Hkv, S, D)
    return q, k, v


def causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """Additive mask: 0 where key j is visible to query i (k_pos[j] <= q_pos[i]), -inf elsewhere.

    Args:
        q_pos: the queries' absolute positions, (S,).
        k_pos: the keys' absolute positions, (T,).
        dtype: the mask's dtype (the attention scores').

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
    out = causal_suffix_attention(q, k, v, scale)  # (Hq, S, D)
    return out.transpose(0, 1).reshape(q.shape[1], -1)  # (S, Hq D)


def attn_out(w: LayerWeights, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """Residual add of the attention output projection. (S, C).

    Args:
        w: the layer's weights (``w_o``).
        h: the hidden rows before the attention block, (S, C).
        attn: their attention output, (S, Hq D).

    Returns:
        ``h`` plus the projected attention, (S, C) in ``h``'s dtype.
    """
    return h + linear(attn.to(w.w_o.dtype), w.w_o).to(h.dtype)


@lru_cache(maxsize=None)
def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation function a config names (transformers' ``ACT2FN``), looked up once: ``ACT2FN[name]``
    builds a new module at every lookup, ~8 us a layer on the request path.

    Args:
        name: the config's ``hidden_act`` (``silu``, ``gelu_pytorch_tanh``, ...).

    Returns:
        The function, elementwise on a tensor of any shape.
    """
    return ACT2FN[name].forward


def mlp_block(w: LayerWeights, dims: ModelDims, h: torch.Tensor) -> torch.Tensor:
    """Residual SwiGLU MLP: h + down(act(gate(x)) * up(x)), x = norm(h). (S, C).

    Args:
        w: the layer's weights (``post_norm``, ``w_gate_up``, ``w_down``).
        dims: the model's shapes (its norm epsilon and activation).
        h: the hidden rows after the attention block, (S, C).

    Returns:
        The layer's output rows, (S, C) in ``h``'s dtype.
    """
    x = rms_norm(h, w.post_norm, dims.eps).to(w.w_gate_up.dtype)  # (S, C) in the weights' dtype
    gate, up = linear(x, w.w_gate_up).chunk(2, dim=-1)  # (S, I), (S, I)
    return h + linear(activation(dims.act)(gate) * up, w.w_down).to(h.dtype)


class LayerRows(Protocol):
    """Where a pass's fresh K/V go and what its queries attend to, layer by layer.

    ``gemm_tile``: None runs each GEMM over all rows at once; an int runs them on
    fixed tiles of that many rows (the caller pads), so a row's numbers do not
    depend on how many other rows share the pass (batch-invariant decoding).
    """

    gemm_tile: int | None

    def store_kv(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Put this layer's fresh K (before RoPE) and V; return the queries and hidden
        rows that go on (a blend check layer keeps a subset). q: (Hq, A, D); h: (A, C)."""
        ...

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Attention output rows (A, Hq D) of queries q (Hq, A, D), before RoPE."""
        ...


def _attention_rows(w: LayerWeights, dims: ModelDims, layer: int, h: torch.Tensor, rows: LayerRows
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's K/V and attention over the hidden rows h (A, C), all rows in one GEMM.

    Returns:
        The hidden rows that go on (A', C) and their attention output (A', Hq D).
    """
    q, k, v = project_qkv(w, dims, rms_norm(h, w.input_norm, dims.eps))  # (Hq,A,D) (Hkv,A,D) x2
    q, h = rows.store_kv(layer, q, k, v, h)
    return h, rows.attend(layer, q)


def layer_attention_only(w: LayerWeights, dims: ModelDims, layer: int, h: torch.Tensor, rows: LayerRows) -> None:
    """A layer's K/V and attention over the hidden rows h (A, C), without the output projection and
    MLP: for a pass that only reads what its rows attend to at its last layer (the query probe).

    Args:
        w: the layer's weights.
        dims: the model's shapes.
        layer: the layer's index.
        h: the active hidden rows, (A, C).
        rows: where the fresh K/V go and what the queries attend to (their attention is read there).
    """
    _attention_rows(w, dims, layer, h, rows)


def layer_forward(w: LayerWeights, dims: ModelDims, layer: int, h: torch.Tensor, rows: LayerRows) -> torch.Tensor:
    """One decoder layer over the active hidden rows h (A, C) -> (A', C).

    Args:
        w: the layer's weights.
        dims: the model's shapes.
        layer: the layer's index.
        h: the active hidden rows, (A, C).
        rows: where the fresh K/V go and what the queries attend to; its ``gemm_tile`` (an int) runs the
            GEMMs on tiles of that many rows.

    Returns:
        The hidden rows that go on, (A', C): all of them, or the subset ``rows.store_kv`` keeps (a blend's
        check layer).
    """
    tile = rows.gemm_tile
    if tile is None:
        h, attn = _attention_rows(w, dims, layer, h, rows)  # (A', C), (A', Hq D)
        return mlp_block(w, dims, attn_out(w, h, attn))
    spans = [(lo, lo + tile) for lo in range(0, h.shape[0], tile)]
    parts = [project_qkv(w, dims, rms_norm(h[lo:hi], w.input_norm, dims.eps)) for lo, hi in spans]
    q, k, v = (torch.cat([p[i] for p in parts], dim=1) for i in range(3))  # (Hq,A,D) (Hkv,A,D) x2
    q, h = rows.store_kv(layer, q, k, v, h)
    attn = rows.attend(layer, q)  # (A, Hq D)
    return torch.cat([mlp_block(w, dims, attn_out(w, h[lo:hi], attn[lo:hi])) for lo, hi in spans])


def _packed(w: LayerWeights, gemm: GemmBackend) -> LayerWeights:
    """A layer's GEMM matrices in the backend's layout (norms and bias as they are)."""
    if gemm is GemmBackend.TORCH:
        return w
    return replace(w, w_qkv=pack(w.w_qkv, gemm), w_o=pack(w.w_o, gemm), w_gate_up=pack(w.w_gate_up, gemm),
                   w_down=pack(w.w_down, gemm))


class AppendMode(Enum):
    """How an appended segment's queries see the cache."""

    CAUSAL = "causal"  # the segment starts the cache: plain causal attention
    SUFFIX = "suffix"  # every earlier row sits at an earlier position: chunked prefill, no mask
    MASK = "mask"  # re-positioned rows before it: a mask from positions


class AppendRows:
    """A segment appended at the end of the cache: its rows get positions
    ``start..start+S`` and attend causally to everything before them.

    Args:
        cache: the request's cache; rows [0, cache.length) are visible context.
        cos, sin: (S, R) rotary tables at the segment's positions.
        scale: softmax scale.
        mode: see :class:`AppendMode`.
        mask: (S, T) additive mask in MASK mode (None: every key visible).
        keep_kv: collect the segment's K (before RoPE) and V for the store.
    """

    gemm_tile = None

    def __init__(self, cache: KVCache, start: int, cos: torch.Tensor, sin: torch.Tensor, scale: float,
                 mode: AppendMode, mask: torch.Tensor | None, keep_kv: bool) -> None:
        self.cache, self.start, self.cos, self.sin, self.scale = cache, start, cos, sin, scale
        self.end = start + cos.shape[0]
        self.mode, self.mask = mode, mask
        self.kept: tuple[list[torch.Tensor], list[torch.Tensor]] | None = ([], []) if keep_kv else None

    def store_kv(self, layer, q, k, v, h):
        if self.kept is not None:
            self.kept[0].append(k)
            self.kept[1].append(v)
        self.cache.write(layer, self.start, apply_rope(k, self.cos, self.sin), v)
        return q, h

    def attend(self, layer, q):
        q_rot = apply_rope(q, self.cos, self.sin)  # (Hq, S, D)
        parts = self.cache.prefix_parts(layer)
        if self.mode is AppendMode.SUFFIX and parts is not None and self.start == self.cache.prefix_length:
            # right after an attached prefix: read it in place (the same program as over copied rows)
            k_own, v_own = self.cache.own_rows(layer, self.start, self.end)  # (Hkv, S, D)
            out = causal_suffix_attention_parts(q_rot, *parts, k_own, v_own, self.scale)  # (Hq, S, D)
            return out.transpose(0, 1).reshape(q.shape[1], -1)  # (S, Hq D)
        k_all, v_all = self.cache.view(layer, self.end)  # (Hkv, T, D)
        if self.mode is AppendMode.SUFFIX:
            return attend_suffix(q_rot, k_all, v_all, self.scale)  # (S, Hq D)
        return attend(q_rot, k_all, v_all, self.scale, self.mask, self.mode is AppendMode.CAUSAL)  # (S, Hq D)

    def entry(self) -> KVEntry | None:
        """The segment's K (before RoPE) and V, (L, Hkv, S, D) each, if kept."""
        return None if self.kept is None else KVEntry(torch.stack(self.kept[0]), torch.stack(self.kept[1]))


class ModelRunner:
    """Weights, RoPE tables and the layer loop of a loaded transformers model.

    Args:
        loaded: model, tokenizer and fingerprints.
        dtype: compute dtype.
        device: compute device.
    """

    def __init__(self, loaded: LoadedModel, dtype: torch.dtype, device: torch.device,
                 gemm: GemmBackend = GemmBackend.TORCH) -> None:
        hf = loaded.model
        self.loaded = loaded
        self.dtype = dtype
        self.device = device
        self.gemm = gemm  # every linear layer of every pass runs on it (so cold == warm stays bit for bit)
        self.dims: ModelDims = dims_of(hf.config)
        base = hf.model
        self.embed_w = base.embed_tokens.weight.detach().to(device=device, dtype=dtype)  # (V, C)
        self.final_norm = base.norm.weight.detach().to(device=device, dtype=dtype)  # (C,)
        self.lm_head = pack(hf.lm_head.weight.detach().to(device=device, dtype=dtype), gemm)  # (V, C)
        self.layers: list[LayerWeights] = [_packed(extract_layer(layer, dtype, device), gemm) for layer in base.layers]
        self.rope = RopeTables(base.rotary_emb.to(device), device)
        width = self.rope(torch.zeros(1, dtype=torch.long, device=device))[0].shape[-1]
        if width != self.dims.head_dim:  # partial rotary: these families' attention rotates every dim
            raise UnknownModelError(f"partial_rotary_factor={partial_rotary_factor(hf.config)} (rotary tables {width} "
                                    f"wide for heads of {self.dims.head_dim}) is not supported: transformers' "
                                    f"attention for {hf.config.model_type} rotates the whole head")
        self._gemm_copies: dict[torch.dtype, list[LayerWeights]] = {}  # dtype -> layers (lazy)
        self._copies_lock = threading.Lock()  # one build per dtype when concurrent requests first need it
        self.kv_pool = KVBufferPool()  # every cache's K/V buffers, recycled between requests

    def layers_in(self, dtype: torch.dtype) -> list[LayerWeights]:
        """The layers with their GEMM matrices (and the Q/K/V bias the GEMM adds) in ``dtype`` (norms
        stay in the compute dtype; activations are cast at each GEMM): a lower-precision copy for the
        blend's query probe and, under ``linear_precision``, its recomputed rows above the last check
        layer; made once, under a lock (concurrent requests that first need it wait for one build). The
        compute dtype returns the layers."""
        if dtype == self.dtype:
            return self.layers
        copies = self._gemm_copies.get(dtype)
        if copies is not None:
            return copies
        with self._copies_lock:
            return self._build_copies(dtype)

    def _build_copies(self, dtype: torch.dtype) -> list[LayerWeights]:
        """:meth:`layers_in`'s copy for ``dtype``, built unless another thread built it first (the caller
        holds the lock)."""
        if dtype not in self._gemm_copies:
            copies = [replace(w, w_qkv=dense(w.w_qkv).to(dtype), w_o=dense(w.w_o).to(dtype),
                              w_gate_up=dense(w.w_gate_up).to(dtype), w_down=dense(w.w_down).to(dtype),
                              b_qkv=None if w.b_qkv is None else w.b_qkv.to(dtype))
                      for w in self.layers]
            if self.gemm is GemmBackend.ONEDNN and packs_natively(dtype):
                # bf16 F.linear runs oneDNN's bf16 kernel already: packed, it skips a weight reorder per call
                copies = [_packed(w, self.gemm) for w in copies]
            self._gemm_copies[dtype] = copies
        return self._gemm_copies[dtype]

    def has_layers_in(self, dtype: torch.dtype) -> bool:
        """Whether :meth:`layers_in` would return without building anything for ``dtype``."""
        return dtype == self.dtype or dtype in self._gemm_copies

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """(S,) int64 -> (S, C) hidden rows."""
        return F.embedding(ids, self.embed_w)

    def logits(self, h_last: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head of hidden rows (S, C) -> (S, V) float32."""
        return linear(rms_norm(h_last, self.final_norm, self.dims.eps), self.lm_head).float()

    def new_cache(self, capacity: int) -> KVCache:
        d = self.dims
        return KVCache(d.num_layers, d.num_kv_heads, d.head_dim, capacity, self.dtype, self.device, self.kv_pool)

    def ids(self, token_ids) -> torch.Tensor:
        """Token ids as an (S,) int64 tensor on the compute device."""
        return torch.tensor(list(token_ids), dtype=torch.long, device=self.device)

    def run_layers(self, h: torch.Tensor, rows: LayerRows, start: int = 0,
                   layers: list[LayerWeights] | None = None) -> torch.Tensor:
        """Layers ``start``.. over hidden rows h (A, C) (the input of layer ``start``);
        returns the last layer's rows (A', C). ``layers``: other weights (:meth:`layers_in`).
        Raises PrefillCancelled before a layer once its :func:`~blend.cancel.cancellable` flag is set."""
        cancel = cancel_flag()
        for i, w in enumerate(self.layers if layers is None else layers):
            if i >= start:
                if cancel is not None and cancel.is_set():
                    raise PrefillCancelled
                h = layer_forward(w, self.dims, i, h, rows)
        return h

    def prefill(self, cache: KVCache, ids: torch.Tensor, keep_kv: bool = True) -> tuple[torch.Tensor, KVEntry | None]:
        """Compute a segment appended at the end of ``cache`` (positions continue).

        Args:
            cache: the request's cache; rows [0, cache.length) are visible context.
            ids: (S,) token ids.
            keep_kv: also return the segment's K (before RoPE) and V for the store.

        Returns:
            hidden rows after the last layer (S, C), and the segment's KV (or None).
        """
        start, s = cache.length, ids.shape[0]
        pos = torch.arange(start, start + s, device=self.device)  # (S,)
        cos, sin = self.rope(pos)  # (S, R)
        cache.set_positions(start, pos)
        # appended after context that sits before it (always, unless rows were re-positioned):
        # chunked prefill without a materialised mask
        if start == 0:
            mode = AppendMode.CAUSAL
        elif s > 1 and int(cache.pos[:start].max()) < start:
            mode = AppendMode.SUFFIX
        else:
            mode = AppendMode.MASK
        mask = causal_mask(pos, cache.pos[: start + s], self.dtype) if mode is AppendMode.MASK else None  # (S, T)
        rows = AppendRows(cache, start, cos, sin, self.dims.scale, mode, mask, keep_kv)
        h = self.run_layers(self.embed(ids), rows)  # (S, C)
        cache.advance(s)
        return h, rows.entry()

    def load(self, cache: KVCache, seg: KVEntry) -> None:
        """Append a stored segment to ``cache`` at the next positions (see :meth:`load_many`)."""
        self.load_many(cache, (seg,))

    def load_many(self, cache: KVCache, segs: Sequence[KVEntry]) -> None:
        """Append stored segments, in order, at the next positions, K rotated there (see
        :func:`blend.kv_load.load_entries`: the same numbers as loading each in turn).

        Args:
            cache: the request's cache (the segments go at its end).
            segs: stored entries, (L, Hkv, S_j, D) K and V each; none: nothing happens.
        """
        load_entries(cache, segs, self.rope, self.dims, self.dtype, self.device)

    def decode_step(self, cache: KVCache, token: int) -> torch.Tensor:
        """Feed one token; return next-token logits (V,) float32."""
        h, _ = self.prefill(cache, self.ids([token]), keep_kv=False)
        return self.logits(h[-1:])[0]
