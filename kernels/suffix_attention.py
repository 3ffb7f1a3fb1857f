"""Chunked prefill's attention on CPU: the queries of a segment appended after cached rows.

The cached prefix is visible to every query and the segment's own rows are causal among them, so
instead of one masked call over the whole rectangle the two parts run as torch's fused CPU flash op
and merge by their log-sum-exp (:func:`causal_suffix_attention`, :func:`causal_suffix_attention_parts`),
or run as oneDNN's GEMMs where those measured faster (``onednn_attention``). The flash op's wrapper
(:func:`flash`) and the merge (:func:`merge_by_lse`) also run the blend's query blocks (``query_blocks``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .onednn_attention import suffix_onednn, use_onednn_suffix

FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
# Below this many grouped query rows (g x S) the prefix attention reads K/V in place (GQA as
# more query rows per KV head) instead of repeating it per query head; the CPU flash op
# switches to larger query tiles at 768 rows, where the repeat is the cheaper layout again.
GROUPED_PREFIX_MAX_ROWS = 768


def flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's CPU flash op -> (out, lse), its operands' last dim made dense first: called directly (not
    through SDPA, which does this itself) the op reads a (B, H, N, D) operand whose D stride is not 1 as
    if it were (wrong numbers, no error; found 2026-12-05 with K/V stored dim-major). No copy otherwise.

    Args:
        q: (B, H, S, D) queries; k, v: (B, H, T, D), as many heads as q.
        **kw: the op's own keywords (``scale``, ``is_causal``, ``attn_mask``).

    Returns:
        out (B, H, S, D) in q's dtype, and the rows' log-sum-exp (B, H, S) float32.
    """
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    return FLASH_CPU(q, k, v, **kw)


def causal_suffix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of the last S key rows' queries: keys [0, T-S) all visible, the last S causal.

    This is chunked prefill (a segment appended after cached context). An
    explicit (S, T) mask makes SDPA compute the whole rectangle; instead the
    visible prefix and the causal square run as two fused CPU flash calls whose
    outputs merge by their log-sum-exp (for few queries under GQA, the prefix call
    reads K/V in place: the query heads of a KV head become its query rows)::

        keys       [ prefix P, no mask ][ own S rows, causal ]
        out  =  (o_p * exp(lse_p - m) + o_s * exp(lse_s - m)) / (exp(lse_p - m) + exp(lse_s - m))

    Args:
        q: (Hq, S, D) queries after RoPE, sitting at the positions of k's last S rows.
        k, v: (Hkv, T, D), T >= S, Hq % Hkv == 0; keys after RoPE.
        scale: softmax scale.

    Returns:
        (Hq, S, D) in q's dtype.
    """
    p = k.shape[1] - q.shape[1]
    if p > 0 and use_onednn_suffix(q, k.shape[1]):  # one masked GEMM per query block (onednn_attention)
        return suffix_onednn(q, k, v, scale)
    if p == 0:  # no cached prefix: plain causal attention
        return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=float(scale),
                                              enable_gqa=q.shape[0] != k.shape[0])[0]
    return causal_suffix_attention_parts(q, k[:, :p], v[:, :p], k[:, p:], v[:, p:], scale)


def causal_suffix_attention_parts(q: torch.Tensor, k_pre: torch.Tensor, v_pre: torch.Tensor, k_own: torch.Tensor,
                                  v_own: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`causal_suffix_attention` with the visible prefix and the queries' own rows in two tensors
    (the same program: the contiguous form calls this with its two slices), so a prefix held
    elsewhere (a cache's shared, read-only prefix) is attended in place, without a copy.

    Args:
        q: (Hq, S, D) queries after RoPE, at the positions of ``k_own``'s rows.
        k_pre, v_pre: (Hkv, P, D), P >= 1, every row visible to every query.
        k_own, v_own: (Hkv, S, D), causal among the queries.
        scale: softmax scale.

    Returns:
        (Hq, S, D) in q's dtype.
    """
    hq, s, _ = q.shape
    hkv = k_pre.shape[0]
    gqa = hq != hkv
    if use_onednn_suffix(q, k_pre.shape[1] + s):  # the same program as the contiguous form's, over a copy
        return suffix_onednn(q, torch.cat([k_pre, k_own], dim=1), torch.cat([v_pre, v_own], dim=1), scale)
    if FLASH_CPU is None or q.device.type != "cpu":
        k, v = torch.cat([k_pre, k_own], dim=1), torch.cat([v_pre, v_own], dim=1)  # (Hkv, T, D)
        p, t = k_pre.shape[1], k.shape[1]
        pos = torch.arange(t, device=q.device)
        visible = pos[None, :] <= pos[p:, None]  # (S, T)
        return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=visible, scale=float(scale),
                                              enable_gqa=gqa)[0]
    g = hq // hkv
    if gqa and g * s < GROUPED_PREFIX_MAX_ROWS:
        # the prefix needs no mask, so the g query heads of a KV head are g x S query rows of it:
        # no copy of the (long) prefix K/V; the causal square repeats its own S rows only
        qg = q.reshape(hkv, g * s, q.shape[2])  # (Hkv, g S, D): query head h reads KV head h // g
        o_p, lse_p = flash(qg[None], k_pre[None], v_pre[None], scale=float(scale))  # (1,Hkv,gS,D)
        o_p, lse_p = o_p.reshape(1, hq, s, -1), lse_p.reshape(1, hq, s)  # (1, Hq, S, D), (1, Hq, S)
        ks = k_own.repeat_interleave(g, dim=0)  # (Hq, S, D)
        vs = v_own.repeat_interleave(g, dim=0)  # (Hq, S, D)
        o_s, lse_s = flash(q[None], ks[None], vs[None], is_causal=True, scale=float(scale))
    else:
        if gqa:  # the CPU flash op wants equal head counts
            k_pre, v_pre = k_pre.repeat_interleave(g, dim=0), v_pre.repeat_interleave(g, dim=0)  # (Hq, P, D)
            k_own, v_own = k_own.repeat_interleave(g, dim=0), v_own.repeat_interleave(g, dim=0)  # (Hq, S, D)
        o_p, lse_p = flash(q[None], k_pre[None], v_pre[None], scale=float(scale))  # (1,Hq,S,D) (1,Hq,S)
        o_s, lse_s = flash(q[None], k_own[None], v_own[None], is_causal=True, scale=float(scale))
    return merge_by_lse(o_p, lse_p, o_s, lse_s)[0].to(q.dtype)  # (Hq, S, D)


def merge_by_lse(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    """Attention over two disjoint key sets merged into attention over both, from each part's output
    (..., S, D) and log-sum-exp (..., S); float32. A part whose row saw no key has lse -inf (weight 0).

    Args:
        o1, lse1: the first part's output (..., S, D) and log-sum-exp (..., S).
        o2, lse2: the second part's, the same shapes.

    Returns:
        (..., S, D) float32.
    """
    m = torch.maximum(lse1, lse2)  # (..., S)
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)  # (..., S) each
    return (o1.float() * w1[..., None] + o2.float() * w2[..., None]) / (w1 + w2)[..., None]
