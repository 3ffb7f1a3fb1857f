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

    layers < c1          all rows active (fresh K/V everywhere); with candidate
                         pre-selection (probe selectors, ``candidates`` F) the
                         probe runs first and only the F x budget rows the
                         question reads most are active here (layer 0's cached
                         KV is exact, so nothing else needs computing)
    layer c1 (check)     fresh vs cached deviation -> selector keeps
                         budget = round(ratio * reused doc tokens) rows of docs 2..k,
                         plus every question row
    layers > c1          only kept rows; later check layers narrow further

Ratio 0 without a threshold skips the check entirely: only the question is
computed, over the cached KV of every document (plain full KV reuse).

:func:`prefill_blend` reads top to bottom: plan -> fetch (:mod:`blend.blend_fetch`) ->
layer loop (the model's one ``layer_forward``; the check layer selects) -> finish. The
engine has already decided that blending is allowed (gate, length, validity).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import torch

from blend.blend_fetch import fetch_documents, start_fetch
from blend.blend_plan import BlendPlan, CheckSpec, pass_layers, plan_blend
from blend.blend_values import BlendContext, BlendOutcome, BlendResume, CheckInput
from blend.keys import key_hex
from blend.kernels import (
    BlockPlan, kv_deviation, plan_query_blocks, query_attention_mass, sparse_query_attention,
)
from blend.kvcache import KVCache
from blend.model import ModelRunner
from blend.policy import BudgetMode, GuardMode, ReuseMode, ReusePolicy
from blend.prefix_cache import remember_hot
from blend.probe import top
from blend.probe_pass import ProbeResult, probe_gemm_dtype, recompute_dtype, run_probe, run_probe_first
from blend.prompt import Prompt, SegmentKind
from blend.report import DeviationStats, ReuseClass, SegmentReport
from blend.rope import apply_rope
from blend.segment_values import ChunkKV
from blend.segments import SegmentCache
from blend.selectors import NEEDS_QUERY_ATTENTION, SelectionInputs, select, select_auto, select_threshold


@dataclass(frozen=True)
class Selection:
    """A check layer's verdict."""

    keep: torch.Tensor  # (A',) sorted positions into the active rows: kept doc rows, then the question
    deviation: DeviationStats | None  # at the first check layer
    ratio: float | None = None  # the share an adaptive budget or a threshold selected (None: a fixed ratio)


class Checker:
    """The check step: fresh vs cached KV of the active document rows, then the selector.

    Args:
        plan: the request's rows.
        policy: selector, ratios, threshold, seed.
        scale: the model's softmax scale.
    """

    def __init__(self, plan: BlendPlan, policy: ReusePolicy, scale: float) -> None:
        self.plan, self.policy, self.scale = plan, policy, scale

    def select(self, check: CheckSpec, active: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               k_all: torch.Tensor, k_pos: torch.Tensor, probe: ProbeResult | None = None) -> Selection:
        """Select at one check layer.

        Args:
            check: the check layer.
            active: (A,) sorted active rows relative to e; document rows (< nb) come first.
            q, k, v: fresh q (Hq, A, D), k and v (Hkv, A, D) of the active rows at this layer.
            k_all: (Hkv, T, D) the layer's mixed keys after RoPE; k_pos: (T,) their positions.
            probe: the query probe's result (first check layer, when the policy needs it).
        """
        plan, policy, layer = self.plan, self.policy, check.layer
        n_doc = int((active < plan.nb).sum())
        rows = active[:n_doc]  # (N,) candidate rows relative to e
        is_forced = plan.forced[rows]  # (N,)
        free = torch.nonzero(~is_forced).flatten()  # (M,) positions into rows the selector may choose
        layer_k, layer_v = plan.cached(layer, k.dtype)  # (Hkv, nb, D) x2
        cached_v = layer_v[:, rows[free]]  # (Hkv, M, D)
        dev_k = kv_deviation(k[:, free], layer_k[:, rows[free]])  # (M,)
        dev_v = kv_deviation(v[:, free], cached_v)  # (M,)
        v_norm = cached_v.float().pow(2).sum(dim=(0, 2)).sqrt().clamp_min(1e-12)  # (M,)
        query_attn = None
        if policy.selector in NEEDS_QUERY_ATTENTION:
            qi = torch.arange(n_doc, active.shape[0])
            q_rot = apply_rope(q[:, qi], plan.cos[active[qi]], plan.sin[active[qi]])  # (Hq, Nq, D)
            mass = query_attention_mass(q_rot, plan.pos[active[qi]], k_all, k_pos, self.scale)  # (T,)
            query_attn = mass[k_pos.shape[0] - plan.n + rows[free]]
        inp = SelectionInputs(dev_k, dev_v, dev_v / v_norm, plan.doc[rows[free]], plan.offset[rows[free]],
                              query_attn, policy.seed, probe_attn=None if probe is None else probe.weight[rows[free]],
                              v_norm=v_norm)
        cap = int(math.floor(policy.max_ratio * plan.budget_base + 1e-9))  # a cap: never over max_ratio
        chosen = None
        if policy.budget is BudgetMode.AUTO and probe is not None:  # per prompt, reported as the ratio chosen
            picked = select_auto(inp, policy.auto_target, cap, probe.entropy)
            chosen = picked.numel() / max(plan.budget_base, 1)
        elif policy.threshold is not None:  # reported as the share it selected, as an adaptive budget's
            picked = select_threshold(inp, policy.threshold, cap)
            chosen = picked.numel() / max(plan.budget_base, 1)
        else:
            budget = int(round(check.ratio * plan.budget_base))
            picked = select(policy.selector, inp, budget)
            if picked.numel() < budget:  # fewer rows to choose from than the ratio asks (the first document,
                # exact, counts in the base): the report gives the share recomputed, not the policy's ratio
                chosen = picked.numel() / max(plan.budget_base, 1)
        stats = None
        if check.index == 0 and free.numel():
            qs = torch.quantile(dev_v, torch.tensor([0.5, 0.9]))
            stats = DeviationStats(
                layer=layer, mean=float(dev_v.mean()), p50=float(qs[0]), p90=float(qs[1]), max=float(dev_v.max()),
                selected_min=float(dev_v[picked].min()) if picked.numel() else None,  # None: no row (valid JSON)
            )
        keep_doc = torch.sort(torch.cat([free[picked], torch.nonzero(is_forced).flatten()])).values
        return Selection(torch.cat([keep_doc, torch.arange(n_doc, active.shape[0])]), stats, chosen)


class BlendRows:
    """The model's :class:`~blend.model.LayerRows` for a blended prefill.

    Each layer's K/V for rows [e, T) are the cached rows re-positioned, with the
    active rows' fresh K/V mixed in (``rope_mix``); the active queries attend
    over the whole mixed cache (``sparse_query_attention``). At a check layer
    the :class:`Checker` narrows the active rows. A policy that needs the query
    probe runs it at the first check layer; above it the probe left every cached
    row re-positioned in the cache, so only the active rows are written there.
    """

    gemm_tile = None

    def __init__(self, plan: BlendPlan, cache: KVCache, checker: Checker, model: ModelRunner,
                 probe: bool, question: bool = True, widen: CheckInput | None = None) -> None:
        self.plan, self.cache, self.checker, self.model = plan, cache, checker, model
        self.question = question  # False: the question's rows stop after the last check layer
        # a second pass (:func:`widen_blend`): it starts at the first pass's check input and keeps every
        # row that pass recomputed
        self.widen = widen
        self.check_input: CheckInput | None = None  # this pass's, once its first check layer ran
        self.scale = model.dims.scale
        self.use_probe = probe and bool(plan.checks)
        self.probe: ProbeResult | None = None
        pol = checker.policy  # the probe's settings, the same wherever it runs
        self.probe_dtype = probe_gemm_dtype(pol.probe_precision, model.dtype, model.device)
        # the recomputed rows' attention above the last check layer (at and below it every row is still
        # judged in the engine's dtype, so the precision never changes which rows are recomputed)
        self.attention_dtype = recompute_dtype(pol.attention_precision, model.dtype)
        self.probe_entropy = pol.budget is BudgetMode.AUTO  # only the adaptive budget reads it
        self.ratio: float | None = None
        # each check layer at the checker's policy's ratio (a widened pass's differs from its plan's)
        self.checks = {c.layer: replace(c, ratio=pol.ratio_at(c.index)) for c in plan.checks}
        # reused rows' attention temperature: above the first check layer (below it a row is either
        # fresh or about to be judged; with no check layer, full reuse, nothing is tempered)
        self.temperature = pol.reused_temperature if plan.checks else 1.0
        self.active = torch.arange(plan.n) if plan.checks else plan.always()  # (A,) sorted rows relative to e
        # layers above this one read cached rows (every layer without a check: full reuse); up to the
        # first check every row is fresh (or, with candidates, the probe re-positioned every layer)
        self.reads_cached_above = plan.checks[0].layer if plan.checks else -1
        if widen is not None:
            self.active, self.probe = widen.active, widen.probe
        elif self.use_probe and checker.policy.candidates is not None:
            self._probe_first(checker.policy)
        self.first_selected = self.active[self.active < plan.nb]  # doc rows kept at the first check
        self.check_rows: list[int] = []  # document rows kept above each check layer, in order
        self.deviation: DeviationStats | None = None
        self.k_pos = cache.pos[: plan.e + plan.n]  # (T,)
        self._queries: _ActiveQueries | None = None  # the active rows' positions, tables and attention plan

    def _probe_first(self, policy: ReusePolicy) -> None:
        """Candidate pre-selection: the probe runs before the layer loop, then only the rows the
        question attends to most (``candidates`` x the largest budget a check layer may keep),
        the forced rows and the question are computed up to the first check layer."""
        plan = self.plan
        self.probe = run_probe_first(self.model, plan, self.cache, plan.checks[0].layer,
                                     gemm_dtype=self.probe_dtype, want_entropy=self.probe_entropy)
        share = policy.max_ratio if policy.budget is BudgetMode.AUTO or policy.threshold is not None \
            else plan.checks[0].ratio
        free = torch.nonzero(~plan.forced).flatten()  # (M,) document rows a selector may choose
        want = policy.candidates * round(share * plan.budget_base)  # a float: a huge factor may overflow int
        n_cand = free.numel() if want >= free.numel() else int(math.ceil(want))
        picked = free[top(self.probe.weight[free], n_cand)]  # (<= n_cand,)
        self.active = torch.unique(torch.cat([picked, plan.always()]))  # (A,) sorted

    def store_kv(self, layer, q, k, v, h):
        plan, active = self.plan, self.active
        if layer > self.reads_cached_above and active.shape[0] < plan.n:  # (every row recomputed: none read)
            plan.prepare(layer, self.cache, self.temperature)  # cached rows re-positioned and tempered (once)
        plan.write_fresh(layer, self.cache, active, k, v)  # the active rows over them
        check = self.checks.get(layer)
        if check is None:
            return q, h
        if check.index == 0 and self.use_probe and self.probe is None:  # later checks rank by the same probe
            self.probe = run_probe(self.model, plan, self.cache, layer, h[active >= plan.nb],
                                   gemm_dtype=self.probe_dtype, want_entropy=self.probe_entropy)
        k_all, _ = self.cache.view(layer, plan.e + plan.n)  # (Hkv, T, D)
        sel = self.checker.select(check, active, q, k, v, k_all, self.k_pos, self.probe)
        keep = sel.keep
        if not self.question and check.index == len(self.checks) - 1:
            # document rows never attend to the question (causal): its rows go after the last check layer
            # (a selector that reads the question's attention needs them at every check layer)
            keep = keep[active[keep] < plan.nb]
        if check.index == 0 and self.widen is not None:
            keep = self._widened(active, keep)
        self.active = active[keep]
        self.check_rows.append(int((self.active < plan.nb).sum()))
        if check.index == 0:
            self.first_selected = self.active[self.active < plan.nb]
            self.deviation, self.ratio = sel.deviation, sel.ratio
            self.check_input = CheckInput(layer, active, h, self.probe, self.first_selected)
            if self.widen is not None:  # the report's rows: recomputed by either pass
                self.first_selected = torch.unique(torch.cat([self.widen.selected, self.first_selected]))
        return q[:, keep], h[keep]

    def _widened(self, active: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """A second pass's rows above its check layer: the selector's ``keep`` (positions into the
        sorted ``active``) and every row the first pass recomputed there, so that no row keeps a first
        pass's fresh KV without being computed again. Returns sorted positions into ``active``."""
        mask = torch.isin(active, self.widen.selected)  # (A,) rows the first pass recomputed above the check
        mask[keep] = True
        return torch.nonzero(mask).flatten()

    def attend(self, layer, q):
        plan, active = self.plan, self.active
        if active.numel() == 0:  # a context-only blend that recomputes no row: layers only re-position
            return q.new_zeros(0, q.shape[0] * q.shape[2])  # (0, Hq D)
        k_all, v_all = self.cache.view(layer, plan.e + plan.n)  # (Hkv, T, D)
        last = plan.last_check
        dtype = self.attention_dtype if last is not None and layer > last else q.dtype
        rows = self._active_queries(active, dtype)
        q_rot = apply_rope(q, rows.cos, rows.sin)  # (Hq, A, D)
        if dtype != q.dtype:  # bf16 attention (RecomputePrecision.BF16): the cache itself keeps its dtype
            q_rot, k_all, v_all = q_rot.to(dtype), k_all.to(dtype), v_all.to(dtype)
        attn = sparse_query_attention(q_rot, rows.pos, k_all, v_all, self.k_pos, self.scale,
                                      plan=rows.attention).to(q.dtype)  # (Hq, A, D)
        return attn.transpose(0, 1).reshape(q.shape[1], -1)  # (A, Hq D)

    def _active_queries(self, active: torch.Tensor, dtype: torch.dtype) -> "_ActiveQueries":
        """What the active rows' attention reads besides q, K and V: the same at every layer between
        two check layers, so made when ``active`` (or the attention's dtype) changes, not at every layer."""
        if self._queries is None or self._queries.active is not active or self._queries.dtype != dtype:
            plan, dims = self.plan, self.model.dims
            pos = plan.pos[active]  # (A,)
            blocks = plan_query_blocks(pos, self.k_pos, dims.num_heads, dims.num_kv_heads, dtype=dtype) \
                if pos.device.type == "cpu" else None
            self._queries = _ActiveQueries(active, dtype, pos, plan.cos[active], plan.sin[active], blocks)
        return self._queries


@dataclass(frozen=True)
class _ActiveQueries:
    """The active rows of a blended pass, as their attention reads them."""

    active: torch.Tensor  # (A,) the rows (relative to e) these were made for
    dtype: torch.dtype  # the attention's dtype they were made for (the CPU plan's route depends on it)
    pos: torch.Tensor  # (A,) their positions
    cos: torch.Tensor  # (A, R) RoPE tables at those positions
    sin: torch.Tensor  # (A, R)
    attention: BlockPlan | None  # the CPU attention's plan (None off the CPU)


NO_ROWS = torch.empty(0, dtype=torch.long)


def _exact_outcome(segments: SegmentCache, prompt: Prompt, cache: KVCache, reports: list[SegmentReport],
                   lookup_s: float, salt: str) -> BlendOutcome:
    """A blend whose every document was exact at its place: the question computed as the exact path
    computes it; a prefix found stored in full is remembered as hot (its second use)."""
    logits, tail, waited = segments.compute_question(cache, prompt.segments[:-1], prompt.question, True, salt)
    remember_hot(segments, cache, prompt.segments[:-1], prompt.question, (*reports, *tail), salt)
    return BlendOutcome(logits, (*reports, *tail), None, lookup_s + waited, ratio=0.0, applied=ReuseMode.EXACT)


def prefill_blend(model: ModelRunner, segments: SegmentCache, prompt: Prompt, policy: ReusePolicy,
                  cache: KVCache, question: bool = True) -> BlendOutcome:
    """Blended prefill of ``prompt`` into ``cache`` (blending already allowed by the engine).

    Args:
        model: the model runner.
        segments: the engine's segment cache (keys, store, canonical chunks).
        prompt: the request.
        policy: a blend policy.
        cache: an empty cache with room for the prompt.
        question: False: the caller computes the question itself (a serving engine that takes the
            context's KV): once the last check layer has selected, the question's rows are not computed
            further, the cache ends before the question and the logits are None. The context's
            rows are the same numbers either way (no document row attends to the question).

    Returns:
        First-token logits (None without the question) and the rows of the report.
    """
    salt = policy.cache_salt
    pending = start_fetch(segments, prompt, salt)  # chunk loads overlap the preamble and earlier chunks
    pre_key = segments.exact_keys([prompt.preamble], salt)[0]
    pre = segments.append_exact(cache, prompt.preamble, pre_key)
    chunks, n_exact, waited = fetch_documents(segments, prompt, pending, policy)
    lookup_s = pre.lookup_s + waited
    t_load = time.perf_counter()
    model.load_many(cache, [c.kv for c in chunks[:n_exact]])  # one rotation per layer over them all
    lookup_s += time.perf_counter() - t_load
    reports = [SegmentReport(SegmentKind.PREAMBLE, pre.reuse_class, len(prompt.preamble), 0, key_hex(pre_key),
                             note=pre.note)]
    blended = chunks[n_exact:]
    if not blended:  # nothing to re-position: this is the exact path (a conversation's turns included)
        return _exact_outcome(segments, prompt, cache, [*reports, *_doc_reports(prompt, chunks, NO_ROWS, 0)],
                              lookup_s, salt)

    plan = plan_blend(model, prompt, blended, n_exact, cache.length, policy)
    cache.set_positions(plan.e, plan.pos)
    skip_q = not question and bool(plan.checks)  # with no check layer the question runs whole
    rows = BlendRows(plan, cache, Checker(plan, policy, model.dims.scale), model, policy.needs_probe,
                     question=not skip_q)
    h = model.run_layers(model.embed(plan.ids[rows.active]), rows, layers=pass_layers(model, plan, policy))  # (A, C)
    cache.advance(plan.nb if skip_q else plan.n)
    context = BlendContext(prompt, tuple(chunks), n_exact, tuple(reports))
    out = _finish(model, context, plan, rows, None if skip_q else h, lookup_s)
    if skip_q or not policy.guarded or rows.check_input is None or policy.guard_mode is GuardMode.RESTART:
        return out
    return replace(out, resume=BlendResume(plan, policy, rows.check_input, context, cache.length))


def widen_blend(model: ModelRunner, resume: BlendResume, cache: KVCache, ratio: float) -> BlendOutcome:
    """The near-tie guard's second pass over a finished blend's ``cache`` (:attr:`GuardMode.WIDEN`): the
    first pass's rows entering its check layer go on, selected again at ``ratio`` among its candidates
    (every row the first pass recomputed kept).

    This computes what one blend would have if its check layer had kept those rows: below the check
    nothing changes (the same candidates, the same probe), and above it every row the first pass wrote
    is written again.

    Args:
        model: the model runner of the first pass.
        resume: the first pass's :attr:`BlendOutcome.resume` (its policy's ``guard_widens(ratio)`` holds).
        cache: the first pass's cache, as it left it.
        ratio: the share of the reused document tokens the check layer keeps.

    Returns:
        The outcome to answer from; its ``ratio`` is the share of the reused document rows it recomputed
        above the check (all it spent: it computes nothing below).
    """
    if cache.length != resume.length:
        raise ValueError("widen_blend needs the cache as the first pass left it")
    plan, at = resume.plan, resume.at
    policy = resume.policy.at_guard_ratio(ratio)
    rows = BlendRows(plan, cache, Checker(plan, policy, model.dims.scale), model, policy.needs_probe,
                     widen=at)
    h = model.run_layers(at.h, rows, start=at.layer, layers=pass_layers(model, plan, policy))  # (A', C)
    share = rows.first_selected.numel() / max(plan.budget_base, 1)  # every row the first pass kept is kept
    return replace(_finish(model, resume.context, plan, rows, h, 0.0), ratio=share)


def _finish(model: ModelRunner, context: BlendContext, plan: BlendPlan, rows: BlendRows, h: torch.Tensor | None,
            lookup_s: float) -> BlendOutcome:
    """A blended pass's outcome: first-token logits from the last row of ``h`` (None: the question
    was left to the caller) and the report's rows."""
    q = context.prompt.question
    reports = [*context.head, *_doc_reports(context.prompt, list(context.chunks), rows.first_selected,
                                            context.n_exact)]
    reports.append(SegmentReport(q.kind, ReuseClass.COMPUTED, len(q), plan.e + plan.nb))
    logits = None if h is None else model.logits(h[-1:])[0]  # (V,)
    # document rows whose re-positioned KV stayed at some layer: a later check layer may drop rows the first kept
    kept = plan.nb - int((rows.active < plan.nb).sum())
    return BlendOutcome(logits, tuple(reports), rows.deviation, lookup_s, rows.ratio, approximate=kept > 0,
                        check_rows=tuple(rows.check_rows))


def _doc_reports(prompt: Prompt, chunks: list[ChunkKV], selected: torch.Tensor, n_exact: int) -> list[SegmentReport]:
    """Each document's report row; rows selected at the first check layer are attributed
    to the blended documents (``selected`` indexes the blended rows, relative to e)."""
    out, start, lo = [], len(prompt.preamble), 0
    for i, (doc, c) in enumerate(zip(prompt.documents, chunks)):
        offsets: tuple[int, ...] = ()
        if i >= n_exact:
            hi = lo + len(doc)
            mine = selected[(selected >= lo) & (selected < hi)]  # sorted: active rows stay sorted
            offsets = tuple(int(x) for x in mine - lo)
            lo = hi
        forced = 0 if c.forced is None else int(c.forced.numel())
        out.append(SegmentReport(doc.kind, c.reuse_class, len(doc), start, c.key, len(offsets), c.note, offsets,
                                 forced))
        start += len(doc)
    return out
