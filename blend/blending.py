"""Blended reuse: canonical chunk KV re-positioned, a selected few rows recomputed.

Position layout of one blended request (T rows)::

    abs. position  0          p          e                                 e+nb        T
                   | preamble | doc 1    | doc 2      | doc 3  | ... doc k | question |
    KV source      | exact prefix hit    | canonical rows, re-positioned   | computed |
    recompute?     | never               | candidates (selector, ratio)    | always   |

    canonical KV of doc j was computed alone right after the preamble, at
    positions [p, p + len_j). Here it sits at [s_j, s_j + len_j): K is stored
    before RoPE, so rotating it at s_j.. re-positions it exactly. Doc 1 sits at
    its canonical position, so its KV is exact and never recomputed.

Layer loop over the non-exact rows [e, T) ("active" rows get Q/K/V, attention
and MLP; the others read their cached, re-positioned rows):

    layers < c1          all rows active (fresh K/V everywhere)
    layer c1 (check)     fresh vs cached deviation -> selector keeps
                         budget = round(ratio * reused doc tokens) rows of docs 2..k,
                         plus every question row
    layers > c1          only kept rows; later check layers narrow further

Ratio 0 without a threshold skips the check entirely: only the question is
computed, over the cached KV of every document (plain full KV reuse).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from blend.errors import InvalidPolicyError
from blend.kernels import kv_deviation, rope_mix, sparse_query_attention
from blend.keys import Namespace, canonical_key, exact_chain, key_hex
from blend.kvcache import KVCache
from blend.layers import attn_out, mlp_block, project_qkv, rms_norm
from blend.policy import ReusePolicy
from blend.prompt import Prompt, Segment, SegmentKind
from blend.report import DeviationStats, ReuseClass, ReuseReport, SegmentReport
from blend.rope import apply_rope
from blend.runner import SegmentKV
from blend.selectors import NEEDS_QUERY_ATTENTION, SelectionInputs, select, select_threshold
from blend.store.base import LookupStatus

if TYPE_CHECKING:
    from blend.engine import Engine


def canonical_chunk_kv(engine: "Engine", preamble: Segment, ids) -> SegmentKV:
    """A chunk's canonical KV: computed alone, right after the preamble.

    Args:
        engine: supplies the runner and the store (for the preamble's exact KV).
        preamble: the preamble segment.
        ids: the chunk's token ids.

    Returns:
        The chunk's KV (K before RoPE), exactly as a later load will see it.
    """
    cache = engine.runner.new_cache(len(preamble) + len(ids))
    key = exact_chain(engine.provenance, [preamble.token_ids])[0]
    engine._exact_segment(cache, preamble, key, ReuseReport(policy="canonical"))
    return engine._compute_stored(cache, Segment(SegmentKind.DOCUMENT, tuple(ids), ""))


def _fetch_chunks(engine: "Engine", prompt: Prompt, report: ReuseReport) -> list[tuple[SegmentKV, SegmentReport]]:
    """Canonical KV of every document: a hit is loaded; a miss or rejection is computed and stored."""
    prov_json = engine.provenance.canonical_json()
    out = []
    start = len(prompt.preamble)
    for i, doc in enumerate(prompt.documents):
        key = canonical_key(engine.provenance, prompt.preamble.token_ids, doc.token_ids)
        t0 = time.perf_counter()
        found = engine.store.get(Namespace.CANONICAL, key, prov_json)
        report.timings.lookup_s += time.perf_counter() - t0
        cls = ReuseClass.EXACT if i == 0 else ReuseClass.BLENDED
        rep = SegmentReport(doc.kind, cls, len(doc), start, key_hex(key))
        if found.status is LookupStatus.HIT and found.entry.num_tokens == len(doc):
            kv = SegmentKV(found.entry.k, found.entry.v)
        else:
            if found.status is LookupStatus.MISS:
                rep.reuse_class, rep.note = ReuseClass.COMPUTED, "miss: computed canonically, then reused"
            else:
                rep.reuse_class = ReuseClass.REJECTED
                rep.note = (found.reason or "stored entry has the wrong length") + "; recomputed"
            kv = canonical_chunk_kv(engine, prompt.preamble, doc.token_ids)
            engine.store.put(Namespace.CANONICAL, key, engine._entry(kv))
        out.append((kv, rep))
        start += len(doc)
    return out


def _question_attention(q_rot: torch.Tensor, q_pos: torch.Tensor, k_all: torch.Tensor,
                        k_pos: torch.Tensor, scale: float) -> torch.Tensor:
    """Mean attention probability from question queries to every key.

    Args:
        q_rot: (Hq, Nq, D) question queries after RoPE.
        k_all: (Hkv, T, D) keys after RoPE.

    Returns:
        (T,) float32 attention mass, averaged over heads and question tokens.
    """
    group = q_rot.shape[0] // k_all.shape[0]
    k = k_all.float().repeat_interleave(group, dim=0)  # (Hq, T, D)
    scores = torch.matmul(q_rot.float(), k.transpose(1, 2)) * scale  # (Hq, Nq, T)
    scores = scores.masked_fill(~(k_pos[None, :] <= q_pos[:, None]), float("-inf"))
    return torch.softmax(scores, dim=-1).mean(dim=(0, 1))  # (T,)


def _validate(engine: "Engine", policy: ReusePolicy) -> None:
    n = engine.dims.num_layers
    if policy.check_layers[-1] >= n:
        raise InvalidPolicyError(f"check layers {policy.check_layers} outside the model's {n} layers (0..{n - 1})")


def prefill_blend(engine: "Engine", prompt: Prompt, policy: ReusePolicy, cache: KVCache,
                  report: ReuseReport) -> torch.Tensor:
    """Blended prefill of ``prompt`` into ``cache``; returns first-token logits (V,) float32."""
    _validate(engine, policy)
    runner, d = engine.runner, engine.dims
    report.selector, report.ratio = policy.selector, policy.ratio
    if len(prompt) < policy.min_prompt_tokens:
        report.gate = f"prompt of {len(prompt)} tokens < min_prompt_tokens={policy.min_prompt_tokens}"
        return _fallback(engine, prompt, cache, report)
    verdict = engine.gate_verdict(policy)
    if verdict:
        report.gate = verdict
        return _fallback(engine, prompt, cache, report)

    pre_key = exact_chain(engine.provenance, [prompt.preamble.token_ids])[0]
    report.segments.append(engine._exact_segment(cache, prompt.preamble, pre_key, report))
    chunks = _fetch_chunks(engine, prompt, report)
    t_load = time.perf_counter()
    if chunks:  # doc 1 sits at its canonical position: its KV is exact
        runner.load(cache, chunks[0][0])
    report.timings.lookup_s += time.perf_counter() - t_load
    report.segments.extend(rep for _, rep in chunks)
    q = prompt.question
    if len(chunks) <= 1:  # nothing to re-position: this is the exact path
        start = cache.length
        h, _ = runner.prefill(cache, engine._ids(q.token_ids), keep_kv=False)
        report.segments.append(SegmentReport(q.kind, ReuseClass.COMPUTED, len(q), start))
        return runner.logits(h[-1:])[0]

    blended = chunks[1:]
    e = cache.length
    nb = sum(kv.k.shape[2] for kv, _ in blended)
    nq = len(q)
    n = nb + nq
    reused_doc_tokens = sum(len(doc) for doc in prompt.documents)
    dt, dev = engine.dtype, engine.device
    L, hkv, hd = d.num_layers, d.num_kv_heads, d.head_dim
    pad = torch.zeros(L, hkv, nq, hd, dtype=dt, device=dev)  # question rows have no cached KV
    k_rows = torch.cat([kv.k.to(device=dev, dtype=dt) for kv, _ in blended] + [pad], dim=2)  # (L, Hkv, n, D)
    v_rows = torch.cat([kv.v.to(device=dev, dtype=dt) for kv, _ in blended] + [pad], dim=2)  # (L, Hkv, n, D)
    doc_of = torch.cat([torch.full((kv.k.shape[2],), j, dtype=torch.long) for j, (kv, _) in enumerate(blended)])
    offset_of = torch.cat([torch.arange(kv.k.shape[2]) for kv, _ in blended])
    pos = torch.arange(e, e + n, device=dev)  # (n,) new absolute positions
    cos, sin = runner.rope(pos)  # (n, R)
    cache.set_positions(e, pos)
    k_pos = cache.pos[: e + n]  # (T,)
    ids = torch.tensor([t for doc in prompt.documents[1:] for t in doc.token_ids] + list(q.token_ids),
                       dtype=torch.long, device=dev)  # (n,)
    question_rows = torch.arange(nb, n, device=dev)

    threshold_mode = policy.threshold is not None
    checks = list(policy.check_layers)
    if policy.ratio == 0.0 and not threshold_mode:
        checks = []  # full KV reuse: nothing is ever selected, so nothing needs checking
    active = torch.arange(n, device=dev) if checks else question_rows  # (A,) rows relative to e
    h = runner.embed(ids[active])  # (A, C)
    first_selected = torch.empty(0, dtype=torch.long)
    for layer, w in enumerate(runner.layers):
        qh, kh, vh = project_qkv(w, d, rms_norm(h, w.input_norm, d.eps))  # (Hq,A,D) (Hkv,A,D) x2
        k_mix, v_mix = rope_mix(k_rows[layer], v_rows[layer], cos, sin, active, kh, vh)  # (Hkv, n, D)
        cache.write(layer, e, k_mix, v_mix)
        k_all, v_all = cache.view(layer, e + n)  # (Hkv, T, D)
        if checks and layer == checks[0]:
            ci = len(policy.check_layers) - len(checks)
            keep = _check(engine, policy, ci, layer, active, nb, reused_doc_tokens, qh, kh, vh,
                          k_rows[layer], v_rows[layer], cos, sin, pos, k_all, k_pos, doc_of, offset_of, report)
            if ci == 0:
                first_selected = active[keep[keep < int((active < nb).sum())]]
            checks.pop(0)
            qh, h, active = qh[:, keep], h[keep], active[keep]
        q_rot = apply_rope(qh, cos[active], sin[active])  # (Hq, A, D)
        attn = sparse_query_attention(q_rot, pos[active], k_all, v_all, k_pos, d.scale)  # (Hq, A, D)
        h = attn_out(w, h, attn.transpose(0, 1).reshape(h.shape[0], -1))
        h = mlp_block(w, d, h)
    cache.advance(n)
    _count_recomputed(report, first_selected, blended)
    report.segments.append(SegmentReport(q.kind, ReuseClass.COMPUTED, nq, e + nb))
    return runner.logits(h[-1:])[0]


def _check(engine, policy, ci, layer, active, nb, reused_doc_tokens, qh, kh, vh, k_cached, v_cached,
           cos, sin, pos, k_all, k_pos, doc_of, offset_of, report) -> torch.Tensor:
    """One check layer: compare fresh and cached KV of the active document rows and select.

    Returns:
        positions into ``active`` to keep (selected document rows, then every question row).
    """
    is_doc = active < nb  # (A,)
    cand = active[is_doc]  # (N,) candidate rows relative to e
    nd = int(is_doc.sum())
    dev_k = kv_deviation(kh[:, :nd], k_cached[:, cand])  # (N,)
    dev_v = kv_deviation(vh[:, :nd], v_cached[:, cand])  # (N,)
    v_norm = v_cached[:, cand].float().pow(2).sum(dim=(0, 2)).sqrt().clamp_min(1e-12)  # (N,)
    query_attn = None
    if policy.selector in NEEDS_QUERY_ATTENTION:
        qrows = torch.arange(nd, active.shape[0])
        q_rot = apply_rope(qh[:, qrows], cos[active[qrows]], sin[active[qrows]])  # (Hq, Nq, D)
        mass = _question_attention(q_rot, pos[active[qrows]], k_all, k_pos, engine.dims.scale)  # (T,)
        query_attn = mass[k_pos.shape[0] - pos.shape[0] + cand]
    inp = SelectionInputs(dev_k, dev_v, dev_v / v_norm, doc_of[cand], offset_of[cand], query_attn, policy.seed)
    budget = int(round(policy.ratio_at(ci) * reused_doc_tokens))
    if policy.threshold is not None:
        keep_doc = select_threshold(inp, policy.threshold, int(round(policy.max_ratio * reused_doc_tokens)))
    else:
        keep_doc = select(policy.selector, inp, budget)
    if ci == 0 and nd:
        q = torch.quantile(dev_v, torch.tensor([0.5, 0.9]))
        report.deviation = DeviationStats(
            layer=layer, mean=float(dev_v.mean()), p50=float(q[0]), p90=float(q[1]), max=float(dev_v.max()),
            selected_min=float(dev_v[keep_doc].min()) if keep_doc.numel() else float("nan"),
        )
    return torch.cat([keep_doc, torch.arange(nd, active.shape[0])])


def _count_recomputed(report: ReuseReport, selected: torch.Tensor, blended) -> None:
    """Attribute rows selected at the first check layer to their documents."""
    lo = 0
    counts = {}
    for _, rep in blended:
        hi = lo + rep.tokens
        counts[id(rep)] = int(((selected >= lo) & (selected < hi)).sum())
        lo = hi
    for _, rep in blended:
        rep.recomputed = counts[id(rep)]


def _fallback(engine: "Engine", prompt: Prompt, cache: KVCache, report: ReuseReport) -> torch.Tensor:
    """Blend refused: compute the whole prompt (documents reported as ``fallback``)."""
    logits = engine._prefill_full(prompt, cache, report)
    for rep in report.segments:
        if rep.kind is SegmentKind.DOCUMENT:
            rep.reuse_class = ReuseClass.FALLBACK
            rep.note = report.gate
    return logits
