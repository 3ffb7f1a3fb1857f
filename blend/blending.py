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
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from blend.errors import InvalidPolicyError
from blend.kernels import kv_deviation, rope_mix, sparse_query_attention
from blend.keys import Namespace, StoreKey, canonical_key, exact_chain, key_hex
from blend.kvcache import KVCache
from blend.layers import attn_out, mlp_block, project_qkv, rms_norm
from blend.policy import ReusePolicy
from blend.prompt import Prompt, Segment, SegmentKind
from blend.report import DeviationStats, ReuseClass, ReuseReport, SegmentReport
from blend.rope import apply_rope
from blend.runner import SegmentKV
from blend.semantic import donor_chunk, register_donor
from blend.selectors import NEEDS_QUERY_ATTENTION, SelectionInputs, select, select_threshold
from blend.store.base import Lookup

if TYPE_CHECKING:
    from blend.engine import Engine


_BLENDED_KINDS = frozenset({SegmentKind.DOCUMENT})  # what a refused blend reports as fallback


def canonical_chunk_kv(engine: "Engine", preamble: Segment, ids, salt: str = "") -> SegmentKV:
    """A chunk's canonical KV: computed alone, right after the preamble.

    Args:
        engine: supplies the runner and the store (for the preamble's exact KV).
        preamble: the preamble segment.
        ids: the chunk's token ids.
        salt: the request's cache salt (keys the preamble's exact KV).

    Returns:
        The chunk's KV (K before RoPE), exactly as a later load will see it.
    """
    cache = engine.runner.new_cache(len(preamble) + len(ids))
    key = exact_chain(engine.provenance, [preamble.token_ids], salt)[0]
    engine._exact_segment(cache, preamble, key, ReuseReport(policy="canonical"))
    return engine._compute_stored(cache, Segment(SegmentKind.DOCUMENT, tuple(ids), ""))


@dataclass
class ChunkKV:
    """One document's KV for a blended request.

    Attributes:
        kv: K before RoPE and V, all layers.
        report: the document's report row (class, key, note).
        forced: (F,) int64 offsets inside the document that must be recomputed
            whatever the selector says (tokens the KV does not belong to:
            semantic reuse's edits); None when the KV is the document's own.
    """

    kv: SegmentKV
    report: SegmentReport
    forced: torch.Tensor | None = None

    @property
    def own_kv(self) -> bool:
        return self.forced is None


def _start_fetch(engine: "Engine", prompt: Prompt, salt: str = "") -> list[tuple[StoreKey, Future[Lookup] | None]]:
    """Key every document and start its lookup in the background (overlapped loading).

    Returns:
        (key, future) per document; the future is None when overlap is off.
    """
    prov_json = engine.provenance_json
    out = []
    for doc in prompt.documents:
        key = canonical_key(engine.provenance, prompt.preamble.token_ids, doc.token_ids, salt)
        fut = engine.prefetcher.submit(Namespace.CANONICAL, key, prov_json) if engine.config.overlap_loading else None
        out.append((key, fut))
    return out


def _fetch_chunks(engine: "Engine", prompt: Prompt, policy: ReusePolicy, report: ReuseReport,
                  pending: list[tuple[StoreKey, Future[Lookup] | None]]) -> list[ChunkKV]:
    """Canonical KV of every document: a hit is loaded; a miss or rejection is computed and stored."""
    out = []
    start = len(prompt.preamble)
    for i, (doc, (key, fut)) in enumerate(zip(prompt.documents, pending)):
        entry, rejected = engine.lookup(Namespace.CANONICAL, key, len(doc), report, fut)
        cls = ReuseClass.EXACT if i == 0 else ReuseClass.BLENDED
        rep = SegmentReport(doc.kind, cls, len(doc), start, key_hex(key))
        start += len(doc)
        if entry is not None:
            if not policy.cache_salt:  # a salted chunk is never a donor for other salts
                register_donor(engine, prompt.preamble.token_ids, doc.token_ids, key)
            out.append(ChunkKV(SegmentKV(entry.k, entry.v), rep))
            continue
        if rejected is None:
            if policy.semantic:
                donated = donor_chunk(engine, prompt, doc, rep, report)
                if donated is not None:
                    out.append(donated)
                    continue
            rep.reuse_class, rep.note = ReuseClass.COMPUTED, "miss: computed canonically, then reused"
        else:
            rep.reuse_class, rep.note = ReuseClass.REJECTED, rejected + "; recomputed"
        kv = canonical_chunk_kv(engine, prompt.preamble, doc.token_ids, policy.cache_salt)
        engine.store.put(Namespace.CANONICAL, key, engine._entry(kv))
        if not policy.cache_salt:
            register_donor(engine, prompt.preamble.token_ids, doc.token_ids, key)
        out.append(ChunkKV(kv, rep))
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
    if policy.semantic and not engine.config.experimental_semantic:
        raise InvalidPolicyError(
            "semantic reuse is experimental: enable it in the engine (EngineConfig(experimental_semantic=True) "
            "or --experimental-semantic) as well as in the policy"
        )


@dataclass(frozen=True)
class BlendRows:
    """Per-request tensors of the re-positioned rows [e, T) (n = blended doc rows + question rows)."""

    k: torch.Tensor  # (L, Hkv, n, D) cached K before RoPE (zeros for question rows)
    v: torch.Tensor  # (L, Hkv, n, D) cached V
    pos: torch.Tensor  # (n,) int64 new absolute positions
    cos: torch.Tensor  # (n, R) rotary tables at ``pos``
    sin: torch.Tensor  # (n, R)
    doc: torch.Tensor  # (nb,) int64 blended-document index of each document row
    offset: torch.Tensor  # (nb,) int64 offset of each document row inside its document
    forced: torch.Tensor  # (nb,) bool rows that must be recomputed (semantic edits)
    nb: int  # document rows; rows >= nb are the question
    budget_base: int  # reused document tokens the ratio counts


def _blend_rows(engine: "Engine", blended: list[ChunkKV], nq: int, e: int, budget_base: int) -> BlendRows:
    d, dt, dev = engine.dims, engine.dtype, engine.device
    pad = torch.zeros(d.num_layers, d.num_kv_heads, nq, d.head_dim, dtype=dt, device=dev)
    k = torch.cat([c.kv.k.to(device=dev, dtype=dt) for c in blended] + [pad], dim=2)  # (L, Hkv, n, D)
    v = torch.cat([c.kv.v.to(device=dev, dtype=dt) for c in blended] + [pad], dim=2)  # (L, Hkv, n, D)
    lens = [c.kv.k.shape[2] for c in blended]
    nb = sum(lens)
    pos = torch.arange(e, e + nb + nq, device=dev)  # (n,)
    cos, sin = engine.runner.rope(pos)  # (n, R)
    forced = torch.zeros(nb, dtype=torch.bool)
    lo = 0
    for c, n_c in zip(blended, lens):
        if c.forced is not None:
            forced[lo + c.forced] = True
        lo += n_c
    return BlendRows(
        k=k, v=v, pos=pos, cos=cos, sin=sin,
        doc=torch.cat([torch.full((n_c,), j, dtype=torch.long) for j, n_c in enumerate(lens)]),
        offset=torch.cat([torch.arange(n_c) for n_c in lens]),
        forced=forced, nb=nb, budget_base=budget_base,
    )


def prefill_blend(engine: "Engine", prompt: Prompt, policy: ReusePolicy, cache: KVCache,
                  report: ReuseReport) -> torch.Tensor:
    """Blended prefill of ``prompt`` into ``cache``; returns first-token logits (V,) float32."""
    _validate(engine, policy)
    runner, d = engine.runner, engine.dims
    report.selector, report.ratio = policy.selector, policy.ratio
    if len(prompt) < policy.min_prompt_tokens:
        return engine.prefill_refused(prompt, cache, report, f"prompt of {len(prompt)} tokens < "
                                      f"min_prompt_tokens={policy.min_prompt_tokens}", _BLENDED_KINDS)
    verdict = engine.gate_verdict(policy)
    if verdict:
        return engine.prefill_refused(prompt, cache, report, verdict, _BLENDED_KINDS)

    pending = _start_fetch(engine, prompt, policy.cache_salt)  # chunk loads overlap the preamble and earlier chunks
    pre_key = exact_chain(engine.provenance, [prompt.preamble.token_ids], policy.cache_salt)[0]
    report.segments.append(engine._exact_segment(cache, prompt.preamble, pre_key, report))
    chunks = _fetch_chunks(engine, prompt, policy, report, pending)
    report.segments.extend(c.report for c in chunks)
    # doc 1 sits at its canonical position: its own KV is exact there
    n_exact = 1 if chunks and chunks[0].own_kv else 0
    t_load = time.perf_counter()
    for c in chunks[:n_exact]:
        runner.load(cache, c.kv)
    report.timings.lookup_s += time.perf_counter() - t_load
    q = prompt.question
    blended = chunks[n_exact:]
    if not blended:  # nothing to re-position: this is the exact path
        start = cache.length
        h, _ = runner.prefill(cache, engine._ids(q.token_ids), keep_kv=False)
        report.segments.append(SegmentReport(q.kind, ReuseClass.COMPUTED, len(q), start))
        return runner.logits(h[-1:])[0]

    e = cache.length
    rows = _blend_rows(engine, blended, len(q), e, sum(len(doc) for doc in prompt.documents))
    nb, n = rows.nb, rows.pos.shape[0]
    cache.set_positions(e, rows.pos)
    k_pos = cache.pos[: e + n]  # (T,)
    ids = torch.tensor([t for doc in prompt.documents[n_exact:] for t in doc.token_ids] + list(q.token_ids),
                       dtype=torch.long, device=engine.device)  # (n,)
    always = torch.cat([torch.nonzero(rows.forced).flatten(), torch.arange(nb, n)])  # forced + question rows

    checks = list(policy.check_layers)
    if policy.ratio == 0.0 and policy.threshold is None:
        checks = []  # full KV reuse: nothing is ever selected, so nothing needs checking
    active = torch.arange(n) if checks else always  # (A,) sorted rows relative to e
    h = runner.embed(ids[active])  # (A, C)
    first_selected = active[active < nb]
    for layer, w in enumerate(runner.layers):
        qh, kh, vh = project_qkv(w, d, rms_norm(h, w.input_norm, d.eps))  # (Hq,A,D) (Hkv,A,D) x2
        k_mix, v_mix = rope_mix(rows.k[layer], rows.v[layer], rows.cos, rows.sin, active, kh, vh,
                                trusted_indices=True)  # (Hkv, n, D) x2; active: sorted distinct rows
        cache.write(layer, e, k_mix, v_mix)
        k_all, v_all = cache.view(layer, e + n)  # (Hkv, T, D)
        if checks and layer == checks[0]:
            ci = len(policy.check_layers) - len(checks)
            checks.pop(0)
            keep = _check(engine, policy, ci, layer, rows, active, qh, kh, vh, k_all, k_pos, report)
            qh, h, active = qh[:, keep], h[keep], active[keep]
            if ci == 0:
                first_selected = active[active < nb]
        q_rot = apply_rope(qh, rows.cos[active], rows.sin[active])  # (Hq, A, D)
        attn = sparse_query_attention(q_rot, rows.pos[active], k_all, v_all, k_pos, d.scale)  # (Hq, A, D)
        h = attn_out(w, h, attn.transpose(0, 1).reshape(h.shape[0], -1))
        h = mlp_block(w, d, h)
    cache.advance(n)
    _count_recomputed(first_selected, blended)
    report.segments.append(SegmentReport(q.kind, ReuseClass.COMPUTED, len(q), e + nb))
    return runner.logits(h[-1:])[0]


def _check(engine: "Engine", policy: ReusePolicy, ci: int, layer: int, rows: BlendRows, active: torch.Tensor,
           qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, k_all: torch.Tensor, k_pos: torch.Tensor,
           report: ReuseReport) -> torch.Tensor:
    """One check layer: compare fresh and cached KV of the active document rows and select.

    Args:
        active: (A,) sorted active rows; document rows (< rows.nb) come first.
        qh, kh, vh: fresh q/k/v of the active rows at this layer.

    Returns:
        (A',) sorted positions into ``active`` to keep: selected and forced
        document rows, then every question row.
    """
    nd = int((active < rows.nb).sum())
    cand = active[:nd]  # (N,) candidate rows relative to e
    is_forced = rows.forced[cand]  # (N,)
    free = torch.nonzero(~is_forced).flatten()  # (M,) positions into cand the selector may choose
    dev_k = kv_deviation(kh[:, free], rows.k[layer][:, cand[free]])  # (M,)
    dev_v = kv_deviation(vh[:, free], rows.v[layer][:, cand[free]])  # (M,)
    v_norm = rows.v[layer][:, cand[free]].float().pow(2).sum(dim=(0, 2)).sqrt().clamp_min(1e-12)  # (M,)
    query_attn = None
    if policy.selector in NEEDS_QUERY_ATTENTION:
        qi = torch.arange(nd, active.shape[0])
        q_rot = apply_rope(qh[:, qi], rows.cos[active[qi]], rows.sin[active[qi]])  # (Hq, Nq, D)
        mass = _question_attention(q_rot, rows.pos[active[qi]], k_all, k_pos, engine.dims.scale)  # (T,)
        query_attn = mass[k_pos.shape[0] - rows.pos.shape[0] + cand[free]]
    inp = SelectionInputs(dev_k, dev_v, dev_v / v_norm, rows.doc[cand[free]], rows.offset[cand[free]],
                          query_attn, policy.seed)
    budget = int(round(policy.ratio_at(ci) * rows.budget_base))
    if policy.threshold is not None:
        picked = select_threshold(inp, policy.threshold, int(round(policy.max_ratio * rows.budget_base)))
    else:
        picked = select(policy.selector, inp, budget)
    if ci == 0 and free.numel():
        qs = torch.quantile(dev_v, torch.tensor([0.5, 0.9]))
        report.deviation = DeviationStats(
            layer=layer, mean=float(dev_v.mean()), p50=float(qs[0]), p90=float(qs[1]), max=float(dev_v.max()),
            selected_min=float(dev_v[picked].min()) if picked.numel() else float("nan"),
        )
    keep_doc = torch.sort(torch.cat([free[picked], torch.nonzero(is_forced).flatten()])).values
    return torch.cat([keep_doc, torch.arange(nd, active.shape[0])])


def _count_recomputed(selected: torch.Tensor, blended: list[ChunkKV]) -> None:
    """Attribute document rows selected at the first check layer to their documents."""
    lo = 0
    for c in blended:
        hi = lo + c.report.tokens
        mine = selected[(selected >= lo) & (selected < hi)]
        c.report.recomputed = int(mine.numel())
        c.report.recomputed_offsets = tuple(int(x) for x in torch.sort(mine - lo).values)
        lo = hi

