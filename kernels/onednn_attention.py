"""Attention as oneDNN GEMMs around an in-place softmax (CPU, float32): the blend's query blocks and
chunked prefill.

Why: torch's CPU flash attention does its Q K^T and P V products with MKL's sgemm. On AMD CPUs MKL
runs an AVX2 code path: float32 GEMMs at ~220 GFLOP/s on the development machine (2-core AVX-512
EPYC), where oneDNN's GEMM, which the engine's linear layers already use, runs ~470-520. The flash
op itself reached ~150-190 GFLOP/s there, near that AVX2 ceiling. So a block of queries (the query
heads of a KV head as its rows) runs here as, per KV head::

    S = (q * scale) K[:tb]^T        oneDNN GEMM            (g Sb, tb)
    S[:, lo:tb] += mask              only the keys some query of the block cannot see
    P = softmax(S) in place          one pass per row, in cache
    O = P V[:tb]                     oneDNN GEMM over a contiguous V^T copy    (g Sb, D)

- :func:`blocks_onednn`: the blend's blocks (``query_blocks.sparse_query_attention_blocked``'s plan), from
  :data:`ONEDNN_MIN_KEYS` keys.
- :func:`suffix_onednn`: chunked prefill (a segment after cached rows: the full prefill's later segments,
  the exact path, the blend's check layer), from :data:`SUFFIX_MIN_KEYS` keys and
  :data:`SUFFIX_MIN_QUERIES` queries. This changes the exact path's last bits, so the route is part of
  an engine's provenance (:func:`attention_label`).

Measured (``docs/results/attention_onednn/``): 0.68-0.82 of the flash route's time on the blend's blocks
at ~2.5k-6k keys, 0.75-0.80 on 600-row segments; below the thresholds the flash op is as fast or faster
(each GEMM's fixed cost weighs more). ``auto`` takes the route on AMD CPUs only
(:func:`onednn_route_default`; on an AMX Xeon it measured 1.5-2.4x slower than the flash op). The
numbers are the same attention in another summation order: within float32 rounding of the flash op
(tested), not bit-identical.

oneDNN builds a kernel per GEMM shape and caches it, so a request's shapes (the same at every layer)
are built once per request. A weight that is not contiguous takes a path ~1000x slower, so every
weight here is a contiguous (rows, D) or (D, rows) tensor.
"""

from __future__ import annotations

import enum
from functools import lru_cache
from typing import TYPE_CHECKING

import torch

from blend.cpu_features import cpu_vendor
from blend.gemm import onednn_available

from .env import env_choice

if TYPE_CHECKING:
    from .query_blocks import BlockPlan

ENV_VAR = "KVBLEND_ATTENTION_GEMM"
ONEDNN_MIN_KEYS = 2048  # keys from which a blend's blocked call runs on oneDNN's GEMMs (kernel-level: 1.03-1.13x
# the flash route's time at ~0.7-1.2k keys, 0.74-1.03x at 2k, 0.68-0.87x at 2.5k-6k; docs/results/attention_onednn/)
SUFFIX_MIN_KEYS = 1024  # a chunked prefill (a segment after cached rows) runs on oneDNN from this many keys
SUFFIX_MIN_QUERIES = 128  # and this many queries (measured: 0.72-0.85x at 600 queries after 600-5.4k keys;
# an 80-row question after 2.4k-6k keys 1.05-1.07x in development, 0.86-0.88x in a later run: it keeps the flash op)
SUFFIX_BLOCK_ROWS = 64  # queries per block of a chunked prefill's attention on oneDNN


class AttentionGemm(enum.Enum):
    """Which GEMMs the blend's blocks and chunked prefills run on (where their sizes reach the thresholds)."""

    AUTO = "auto"  # oneDNN where measured faster (AMD x86 CPUs with oneDNN), else the flash op
    FLASH = "flash"  # torch's CPU flash op (MKL's GEMMs inside) everywhere
    ONEDNN = "onednn"  # oneDNN's GEMMs wherever this torch build has them


@lru_cache(maxsize=1)
def attention_gemm_policy() -> AttentionGemm:
    """The policy from ``KVBLEND_ATTENTION_GEMM`` (auto, flash, onednn), read once per process: the exact
    path's numbers depend on it, so an engine's provenance names it (:func:`attention_label`) and it must
    not change under a loaded engine (tests change it with ``attention_gemm_policy.cache_clear()``).

    Returns:
        The :class:`AttentionGemm` (default AUTO).

    Raises:
        ValueError: another value.
    """
    return env_choice(ENV_VAR, AttentionGemm, AttentionGemm.AUTO)


@lru_cache(maxsize=1)
def onednn_route_default() -> bool:
    """Whether ``auto`` takes the oneDNN route: on AMD CPUs, where MKL's sgemm (inside torch's flash op)
    runs its AVX2 path and oneDNN's runs 2x faster. Intel CPUs keep the flash op: MKL has its AVX-512
    path there, and on a 2-core AMX Xeon the route measured 1.5-2.4x slower than the flash op
    (``docs/results/attention_onednn/micro_amx_xeon.txt``).

    Returns:
        True on an AMD CPU whose torch build has oneDNN's packed linear (cached for the process).
    """
    return onednn_available() and cpu_vendor() == "AuthenticAMD"


def onednn_route_on() -> bool:
    """Whether this process's policy takes the oneDNN route at all (where the sizes call for it).

    Returns:
        False under FLASH; under ONEDNN whether oneDNN is available; under AUTO :func:`onednn_route_default`.
    """
    policy = attention_gemm_policy()
    if policy is AttentionGemm.FLASH:
        return False
    if policy is AttentionGemm.ONEDNN:
        return onednn_available()
    return onednn_route_default()


def attention_label() -> str:
    """The exact path's attention as an engine's provenance names it (its ``backend`` field): which GEMMs
    a chunked prefill runs on and from which sizes, since that changes the stored KV's last bits.

    Returns:
        ``attn-flash``, or ``attn-onednn-<min keys>k<min queries>q<block rows>r``.
    """
    if not onednn_route_on():
        return "attn-flash"
    return f"attn-onednn-{SUFFIX_MIN_KEYS}k{SUFFIX_MIN_QUERIES}q{SUFFIX_BLOCK_ROWS}r"


def use_onednn(keys: int, device: torch.device, dtype: torch.dtype = torch.float32) -> bool:
    """Whether a blend's blocked attention call over ``keys`` keys on ``device`` runs on oneDNN's GEMMs
    (float32 GEMMs: a bf16 / fp16 engine keeps the flash op in its own dtype, as its prefill does).

    Args:
        keys: the call's key rows (T).
        device: the tensors' device (oneDNN's route is CPU only).
        dtype: the call's dtype (float32 only).

    Returns:
        Whether the call takes the route: CPU, float32, at least :data:`ONEDNN_MIN_KEYS` keys, and the policy on.
    """
    return device.type == "cpu" and dtype == torch.float32 and keys >= ONEDNN_MIN_KEYS and onednn_route_on()


def use_onednn_suffix(q: torch.Tensor, keys: int) -> bool:
    """Whether a chunked prefill of q's (Hq, S, D) queries after ``keys - S`` cached rows runs on oneDNN.

    Args:
        q: (Hq, S, D) the chunk's queries.
        keys: the keys they attend over (T, cached rows and the chunk's own).

    Returns:
        Whether the call takes the route: CPU, float32, at least :data:`SUFFIX_MIN_QUERIES` queries and
        :data:`SUFFIX_MIN_KEYS` keys, and the policy on.
    """
    return (q.device.type == "cpu" and q.dtype == torch.float32 and q.shape[1] >= SUFFIX_MIN_QUERIES
            and keys >= SUFFIX_MIN_KEYS and onednn_route_on())


def _gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T on oneDNN; x (M, K), w (N, K) contiguous float32 -> (M, N)."""
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


_softmax_into = torch.ops.aten._softmax.out  # row softmax written over its input (aten's CPU kernel reads
# a row's max and sum before it writes the row)


def _per_head(x: torch.Tensor) -> list[torch.Tensor]:
    """(H, T, D) -> H contiguous (T, D) tensors (views where x is already laid out so)."""
    return [x[h].contiguous() for h in range(x.shape[0])]


def _block(q_rows: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, lo: int,
           mask: torch.Tensor | None) -> torch.Tensor:
    """One block's attention for one KV head: softmax(q_rows k_rows^T, masked on keys [lo:]) v_rows.

    Args:
        q_rows: (M, D) queries, already scaled; k_rows: (N, D) contiguous keys the block sees;
            v_rows: (N, D) their values.
        lo: keys [0, lo) are visible to every row (no mask there).
        mask: (M, N - lo) additive mask of the other keys, or None.

    Returns:
        (M, D) float32.
    """
    s = _gemm(q_rows, k_rows)  # (M, N)
    if mask is not None:
        s[:, lo:] += mask
    p = _softmax_into(s, -1, False, out=s)  # (M, N)
    return _gemm(p, v_rows.t().contiguous())  # (M, D)


def blocks_onednn(qf: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor, scale: float, plan: "BlockPlan",
                  out: torch.Tensor) -> None:
    """The query blocks of a BLOCKS plan on oneDNN's GEMMs, written into ``out`` (blind queries untouched).

    Args:
        qf: (Hq, S, D) float32 queries after RoPE; kf, vf: (Hkv, T, D) float32 keys (after RoPE) and values.
        scale: softmax scale.
        plan: the call's plan (route BLOCKS; its blocks' spans and masks).
        out: (Hq, S, D) float32, written for every query of every block.
    """
    hq, _, d = qf.shape
    hkv = kf.shape[0]
    g = hq // hkv
    qs = (qf * scale).reshape(hkv, g, -1, d)  # (Hkv, g, S, D): query head h reads KV head h // g
    keys = _per_head(kf)  # (T, D) each
    outv = out.view(hkv, g, -1, d)  # (Hkv, g, S, D)
    for blk in plan.blocks:
        a, b, lo, tb = blk.a, blk.b, blk.lo, blk.tb
        span = blk.mask[0, 0] if blk.mask is not None else None  # (g Sb, tb - lo)
        for h in range(hkv):
            o = _block(qs[h, :, a:b].reshape(g * (b - a), d), keys[h][:tb], vf[h, :tb], lo, span)  # (g Sb, D)
            outv[h, :, a:b] = o.view(g, b - a, d)


def suffix_onednn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Chunked-prefill attention on oneDNN's GEMMs: q are the last S rows of k/v, every earlier key visible.

    Query blocks of :data:`SUFFIX_BLOCK_ROWS`, per KV head one GEMM over the keys [0, P + b) the block's
    last query sees, the causal triangle masked over the block's own keys [P + a, P + b) only, an
    in-place softmax and one GEMM with V: no second call for the prefix and no merge.

    Args:
        q: (Hq, S, D) float32 queries after RoPE; k, v: (Hkv, T, D) float32, T >= S, keys after RoPE.
        scale: softmax scale.

    Returns:
        (Hq, S, D) float32.
    """
    hq, s, d = q.shape
    hkv, t = k.shape[0], k.shape[1]
    g, p, rows = hq // hkv, t - s, SUFFIX_BLOCK_ROWS
    qs = (q * scale).reshape(hkv, g, s, d)  # (Hkv, g, S, D): query head h reads KV head h // g
    keys = _per_head(k)  # (T, D) each
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)  # (Hq, S, D)
    outv = out.view(hkv, g, s, d)
    tri = torch.full((rows, rows), float("-inf"), device=q.device).triu_(1)  # (rows, rows) causal
    for a in range(0, s, rows):
        b = min(s, a + rows)
        square = (tri if b - a == rows else tri[:b - a, :b - a]).repeat(g, 1)  # (g Sb, Sb)
        for h in range(hkv):
            o = _block(qs[h, :, a:b].reshape(g * (b - a), d), keys[h][:p + b], v[h, :p + b], p + a, square)
            outv[h, :, a:b] = o.view(g, b - a, d)  # from (g Sb, D)
    return out
