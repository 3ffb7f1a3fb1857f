"""The blend's CPU attention: a subset of queries over every key, in query blocks planned from the positions.

:func:`plan_query_blocks` derives a :class:`BlockPlan` from the positions and head counts (the route, the
query blocks with their masks, the queries that see no key); :func:`sparse_query_attention_blocked` runs it:
each block as the CPU flash op over its unmasked shared key prefix and its masked span, merged by their
log-sum-exp, or as oneDNN's GEMMs (``onednn_attention``); a suffix of the keys as chunked prefill
(``suffix_attention``), anything else as the torch reference (``reference``).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from enum import Enum

import torch

from .checks import AttentionShape, check_attention, nondecreasing, same_positions
from .onednn_attention import blocks_onednn, use_onednn
from .reference import sparse_query_attention_ref
from .suffix_attention import FLASH_CPU, causal_suffix_attention, flash, merge_by_lse


# sparse_query_attention_blocked: query blocks of ~BLOCK_ROWS queries (BLOCKS_MIN to BLOCKS_MAX of them);
# a block whose shared key prefix is at least SPLIT_MIN_PREFIX keys attends to it without a mask
# (a second call and a merge cost less than masking that many keys; below it they cost more: a
# ~600-token blend measured 5% slower splitting every block)
BLOCK_ROWS, BLOCKS_MIN, BLOCKS_MAX = 64, 4, 16
SPLIT_MIN_PREFIX = 1024
# On the flash route a block takes at least BLOCK_ROWS queries and at least one per FLASH_KEYS_PER_ROW keys
# (2 to BLOCKS_MAX blocks): larger query tiles run the flash op faster per pair (3.6 ns at 204 grouped rows,
# 2.9 at 1,024, AMX Xeon), and longer keys make that worth the larger masked spans. A blend's attention
# after its check layer measured 0.88x at ~6k tokens (3 blocks instead of 14), 0.90-0.95x at ~3k and
# 0.86-0.95x at ~600 (docs/results/issue18/attention_per_pair/).
FLASH_KEYS_PER_ROW, FLASH_BLOCKS_MIN = 20, 2


def default_blocks(queries: int, keys: int, onednn: bool) -> int:
    """Query blocks of a blocked call with ``queries`` over ``keys`` (see :func:`plan_query_blocks`).

    Args:
        queries: S; keys: T.
        onednn: the blocks run as oneDNN GEMMs (AMD CPUs), which mask only each block's span: one per
            :data:`BLOCK_ROWS` queries, as measured there.

    Returns:
        The number of blocks: oneDNN, one per :data:`BLOCK_ROWS` queries; the flash op, one per
        ``max(BLOCK_ROWS, keys // FLASH_KEYS_PER_ROW)`` queries; each clamped to its minimum
        (:data:`BLOCKS_MIN`, :data:`FLASH_BLOCKS_MIN`) and :data:`BLOCKS_MAX`.
    """
    if onednn:
        return min(BLOCKS_MAX, max(BLOCKS_MIN, queries // BLOCK_ROWS))
    rows = max(BLOCK_ROWS, keys // FLASH_KEYS_PER_ROW)
    return min(BLOCKS_MAX, max(FLASH_BLOCKS_MIN, round(queries / rows)))


def _is_suffix(q_pos: torch.Tensor, k_pos: torch.Tensor) -> bool:
    """Queries sit exactly at the last S of strictly increasing key positions (so after every other key)."""
    s, t = q_pos.shape[0], k_pos.shape[0]
    return 2 <= s <= t and torch.equal(q_pos, k_pos[t - s:]) and bool((k_pos[1:] > k_pos[:-1]).all())


class AttentionRoute(Enum):
    """How :func:`sparse_query_attention_blocked` computes a call (decided by positions alone)."""

    REFERENCE = "reference"  # the masked SDPA reference (unsorted positions, few queries, no flash op)
    SUFFIX = "suffix"  # the queries are every row of a suffix of the keys: chunked prefill
    BLOCKS = "blocks"  # query blocks: an unmasked shared prefix and a masked own span each


@dataclass(frozen=True)
class QueryBlock:
    """Queries [a, b) of a blocked call: keys [0, lo) are seen by all of them, [lo, tb) by some."""

    a: int
    b: int
    lo: int
    tb: int
    mask: torch.Tensor | None  # (1, 1, g Sb, tb - lo) additive float32 mask of the span (None: no span)
    none: torch.Tensor | None  # (g Sb,) bool: rows that see no key of the span (None: no span, or oneDNN)


@dataclass(frozen=True)
class BlockPlan:
    """Everything :func:`sparse_query_attention_blocked` derives from the positions and head counts:
    the route, the query blocks with their masks, the blind queries. A blend's active rows and key
    positions are the same at every layer between two check layers, so the pass builds this once
    for them (:func:`plan_query_blocks`) instead of once per layer."""

    route: AttentionRoute
    q_pos: torch.Tensor  # (S,) the positions it was made for
    k_pos: torch.Tensor  # (T,)
    q_heads: int
    kv_heads: int
    blocks: tuple[QueryBlock, ...] = ()
    blind: int = 0  # queries [0, blind) see no key (a prefix: the queries are sorted)
    onednn: bool = False  # the blocks run on oneDNN's GEMMs (``onednn_attention``), not the flash op

    def fits(self, q_pos: torch.Tensor, k_pos: torch.Tensor, shp: AttentionShape) -> bool:
        """Whether the plan was made for a call at these positions with these head counts (the same
        position tensors, as a caller reusing its plan passes them, cost nothing; others are compared)."""
        return ((self.q_heads, self.kv_heads) == (shp.q_heads, shp.kv_heads)
                and same_positions(self.q_pos, q_pos) and same_positions(self.k_pos, k_pos))


def plan_query_blocks(q_pos: torch.Tensor, k_pos: torch.Tensor, q_heads: int, kv_heads: int,
                      blocks: int | None = None, dtype: torch.dtype = torch.float32) -> BlockPlan:
    """The plan of :func:`sparse_query_attention_blocked` for these positions (see there).

    Args:
        q_pos: (S,) int64 query positions; k_pos: (T,) int64 key positions (one device).
        q_heads, kv_heads: head counts (q_heads % kv_heads == 0).
        blocks: query blocks (default: :func:`default_blocks`).
        dtype: the calls' q/K/V dtype: only float32 may take oneDNN's route (its GEMMs are float32;
            other dtypes keep the flash op in their own dtype). A plan serves any dtype correctly.

    Returns:
        The plan; valid for any q, k, v of these sizes at these positions.
    """
    s, t = q_pos.shape[0], k_pos.shape[0]
    onednn = use_onednn(t, q_pos.device, dtype)
    blocks = blocks or default_blocks(s, t, onednn)
    sizes = dict(q_pos=q_pos, k_pos=k_pos, q_heads=q_heads, kv_heads=kv_heads)
    if (FLASH_CPU is None or q_pos.device.type != "cpu" or s < 2 * blocks or t == 0
            or not (nondecreasing(q_pos) and nondecreasing(k_pos))):
        return BlockPlan(AttentionRoute.REFERENCE, **sizes)
    if _is_suffix(q_pos, k_pos):
        return BlockPlan(AttentionRoute.SUFFIX, **sizes)
    g = q_heads // kv_heads
    ends = torch.searchsorted(k_pos, q_pos.contiguous(), right=True)  # (S,) visible key prefix per query
    ends_l = ends.tolist()
    bounds = [round(i * s / blocks) for i in range(blocks + 1)]
    out = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        if a == b:
            continue
        lo, tb = ends_l[a], ends_l[b - 1]  # keys [0, lo) seen by all; [lo, tb) by some
        if lo < SPLIT_MIN_PREFIX and not onednn:  # flash: a short shared prefix is one masked call over
            lo = 0  # the block's keys (oneDNN's one GEMM per block masks only the span at any lo)
        mask = none = None
        if tb > lo:
            visible = k_pos[None, lo:tb] <= q_pos[a:b, None]  # (Sb, tb - lo)
            span = torch.zeros(visible.shape, device=q_pos.device).masked_fill_(~visible, float("-inf"))
            mask = span.repeat(g, 1)[None, None]  # (1, 1, g Sb, tb - lo)
            if not onednn:  # (only the flash route's log-sum-exp merge reads it)
                none = (ends[a:b] == lo).repeat(g)  # (g Sb,) rows that see no key of the span
        if lo == 0 and mask is None:  # no query of the block sees a key: zeroed with the other blind queries
            continue
        out.append(QueryBlock(a, b, lo, tb, mask, none))
    blind = bisect.bisect_right(ends_l, 0)  # queries before every key (a prefix: ends are sorted)
    return BlockPlan(AttentionRoute.BLOCKS, **sizes, blocks=tuple(out), blind=blind, onednn=onednn)


def _blocks_flash(qf: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor, scale: float, plan: BlockPlan,
                  out: torch.Tensor) -> None:
    """The query blocks of a BLOCKS plan on the CPU flash op, written into ``out`` (blind queries untouched).

    Args:
        qf: (Hq, S, D) queries after RoPE; kf, vf: (Hkv, T, D) keys and values; one dtype (float32, or
            bf16 / fp16: the op keeps its softmax and sums in float32, and a block's two parts merge in
            float32, as a chunked prefill's do).
        scale: softmax scale.
        plan: the call's plan (its float32 span masks serve every dtype).
        out: (Hq, S, D) float32.
    """
    hq, _, d = qf.shape
    hkv = kf.shape[0]
    g = hq // hkv
    for blk in plan.blocks:
        a, b, lo, tb = blk.a, blk.b, blk.lo, blk.tb
        qg = qf[:, a:b].reshape(hkv, g * (b - a), d)  # (Hkv, g Sb, D): query head h reads KV head h // g
        parts = []
        if lo > 0:  # (1, Hkv, g Sb, D), (1, Hkv, g Sb)
            parts.append(flash(qg[None], kf[None, :, :lo], vf[None, :, :lo], scale=float(scale)))
        if blk.mask is not None:
            o, lse = flash(qg[None], kf[None, :, lo:tb], vf[None, :, lo:tb], attn_mask=blk.mask,
                           scale=float(scale))
            parts.append((o, lse.masked_fill(blk.none, float("-inf"))))
        o = merge_by_lse(*parts[0], *parts[1]) if len(parts) == 2 else parts[0][0]  # (1, Hkv, g Sb, D)
        out[:, a:b] = o[0].reshape(hq, b - a, d)


def sparse_query_attention_blocked(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float,
    blocks: int | None = None,
    plan: BlockPlan | None = None,
) -> torch.Tensor:
    """The CPU path of ``blend.kernels.sparse_query_attention`` (same contract).

    With keys in position order and queries sorted (the blend path's layout),
    query block b only needs the key prefix up to its last query's position,
    and every query of the block sees the prefix up to its *first* query's::

        keys     |=================================|..span..|     T
        block b  |  seen by every query: no mask   | masked |     the rest of the keys: skipped

    so a block is two fused CPU flash calls merged by their log-sum-exp (as
    :func:`causal_suffix_attention_parts` merges a prefix and a causal square):
    the long shared prefix without a mask, and only the block's own span of
    keys with one (a shared prefix under :data:`SPLIT_MIN_PREFIX` keys is not
    worth the second call: one masked call then). Under GQA the query heads of
    a KV head are that head's query rows, so K/V are read in place. When the queries are every row of a
    contiguous suffix of the keys (a check layer before selection, where all
    rows are active), it is chunked prefill: :func:`causal_suffix_attention`.
    Anything else (unsorted positions, few queries) goes to the reference.
    With many keys on CPUs where it measured faster, the plan runs the same
    blocks as oneDNN GEMMs instead of the flash op (``onednn_attention``).

    Args:
        q, q_pos, k, v, k_pos, scale: as for the reference.
        blocks: query blocks (default: :func:`default_blocks`; fewer, larger blocks run
            larger tiles, more of them mask more of their spans). Ignored with ``plan``.
        plan: from :func:`plan_query_blocks` for these positions (None: made here). A caller that
            attends at the same positions layer after layer makes it once.

    Returns:
        (Hq, S, D) in q's dtype; a query that sees no key gets zeros.

    Raises:
        ValueError: bad arguments, or a plan made for other positions or head counts.
    """
    shp = check_attention(q, q_pos, k, v, k_pos, scale)
    if plan is None:
        plan = plan_query_blocks(q_pos, k_pos, shp.q_heads, shp.kv_heads, blocks, q.dtype)
    elif not plan.fits(q_pos, k_pos, shp):
        raise ValueError(f"attention plan made for other positions or heads ({plan.q_pos.numel()} queries x "
                         f"{plan.k_pos.numel()} keys, {plan.q_heads}/{plan.kv_heads} heads) than the call's {shp}")
    if plan.route is AttentionRoute.REFERENCE:
        return sparse_query_attention_ref(q, q_pos, k, v, k_pos, scale)
    if plan.route is AttentionRoute.SUFFIX:  # chunked prefill: the prefill's own program, in q's dtype
        return causal_suffix_attention(q, k, v, scale)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)  # (Hq, S, D)
    if plan.onednn:  # the same blocks, each one masked GEMM over its keys [0, tb) per KV head (float32)
        blocks_onednn(q.float(), k.float(), v.float(), scale, plan, out)
    else:  # the flash op in the inputs' dtype, as a prefill runs it (softmax and accumulation in float32
        _blocks_flash(q, k, v, scale, plan, out)  # inside; a bf16 engine's K/V are not copied to float32)
    if plan.blind:
        out[:, :plan.blind] = 0.0
    return out.to(q.dtype)
