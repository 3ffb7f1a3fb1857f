"""vLLM's CPU attention kernel as the blend path's sparse-query attention, where vLLM is loaded.

Inside vLLM's worker (kvblend's connector, issue 17) vLLM's compiled CPU ops are
registered with torch (``torch.ops._C``). Its paged attention kernel runs a batch
of requests, each a few queries at the end of its own key prefix; measured on a
2-core AVX-512 EPYC in fp32 it is ~2.3x faster than torch's fused CPU attention on
a causal prefill and 1.4-2x faster than :func:`sparse_query_attention_blocked`
(as it was before its shared prefixes went unmasked, 2026-12-05) on a blend's
selected rows (``evals/bench_kernels.py --vllm``; BENCHMARKS.md). A blend's sparse
queries map onto it exactly: sorted queries split into *runs* whose visible key
prefix grows by one key per query; each run is one causal request whose sequence
length is its last query's visible prefix::

    keys (sorted)   |==========================================|  T
    run 0           |=======|q q q|                               request: q_len 3, seq_len e
    run 1           |==================|q|                        request: q_len 1
    run 2           |==================================|q q|      ...

All requests share one block table over a paged copy of K/V (one copy per call,
included in the timings above). Nothing here imports vLLM: the ops are looked up in
``torch.ops._C`` and used only when vLLM itself has registered them, and only
after a one-time self-check against the torch reference on this machine passed
(an op whose schema or semantics changed between vLLM versions is never used).
Layouts the kernel does not cover (unsorted positions, head sizes that are not a
multiple of 16, fp16) go to the torch path.
"""

from __future__ import annotations

import logging
from functools import lru_cache

import torch

from .checks import check_attention, nondecreasing
from .query_blocks import sparse_query_attention_blocked
from .reference import sparse_query_attention_ref
from .tolerances import TOL

log = logging.getLogger(__name__)

OPS = ("get_scheduler_metadata", "cpu_attn_reshape_and_cache", "cpu_attention_with_kv_cache")
BLOCK_SIZE = 128  # rows per paged block: 32-256 measured within noise; 128 is vLLM's CPU default
DTYPES = (torch.float32, torch.bfloat16)


def ops_registered() -> bool:
    """Whether vLLM's CPU attention ops are registered in this process (vLLM has loaded its ``_C``).

    Returns:
        Whether ``torch.ops._C`` has every op of :data:`OPS`.
    """
    ns = torch.ops._C
    return all(hasattr(ns, op) for op in OPS)


def _isa(head_dim: int) -> str | None:
    """vLLM's ISA name for its vectorised (non-AMX) kernel at this head size, or None."""
    if head_dim % 32 == 0:
        return "vec"
    if head_dim % 16 == 0:
        return "vec16"
    return None


def covers(q: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> bool:
    """Whether this kernel takes the call (else the torch path does): CPU, fp32/bf16, a head size
    vLLM's vectorised kernel handles, sorted positions (the blend path's layout).

    Args:
        q: (Hq, S, D) queries.
        q_pos: (S,) query positions.
        k_pos: (T,) key positions.

    Returns:
        Whether all of that holds.
    """
    return (q.device.type == "cpu" and q.dtype in DTYPES and _isa(q.shape[-1]) is not None
            and nondecreasing(q_pos) and nondecreasing(k_pos))


def _runs(ends: torch.Tensor) -> torch.Tensor:
    """Query start offsets of the runs: a new run wherever the visible prefix does not grow by one.

    Args:
        ends: (S,) int64 visible keys per query, nondecreasing, all >= 1.

    Returns:
        (R + 1,) int32 query_start_loc: run r is queries [out[r], out[r + 1]).
    """
    s = ends.shape[0]
    breaks = torch.nonzero(ends[1:] - ends[:-1] != 1).flatten() + 1  # (R - 1,)
    edges = torch.empty(breaks.shape[0] + 2, dtype=torch.int32)  # (R + 1,)
    edges[0], edges[-1] = 0, s
    edges[1:-1] = breaks
    return edges


def sparse_query_attention_vllm(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``blend.kernels.sparse_query_attention`` (same contract) on vLLM's CPU attention kernel.

    Args:
        q: (Hq, S, D) queries after RoPE; q_pos: (S,) int64 positions.
        k, v: (Hkv, T, D), K after RoPE; k_pos: (T,) int64 positions.
        scale: softmax scale.

    Returns:
        (Hq, S, D) in q's dtype (a transposed view of an (S, Hq, D) buffer, which is the layout the
        output projection reads); a query that sees no key gets zeros.

    Raises:
        ValueError: shape, dtype or device mismatch.
        RuntimeError: vLLM's ops are not registered in this process.
    """
    shp = check_attention(q, q_pos, k, v, k_pos, scale)
    if not covers(q, q_pos, k_pos):
        return sparse_query_attention_blocked(q, q_pos, k, v, k_pos, scale)
    if not ops_registered():
        raise RuntimeError("vLLM's CPU attention ops are not registered in this process (import vllm first)")
    hq, s, d = q.shape
    hkv, t = shp.kv_heads, shp.keys
    out = torch.zeros(s, hq, d, dtype=q.dtype)  # (S, Hq, D)
    ends = torch.searchsorted(k_pos, q_pos, right=True)  # (S,) visible key prefix per query
    lo = int(torch.searchsorted(ends, 1))  # queries before lo see no key: zeros
    if lo == s or t == 0:
        return out.transpose(0, 1)
    isa = _isa(d)
    nb = -(-t // BLOCK_SIZE)
    paged = torch.empty(nb, hkv, 2 * BLOCK_SIZE, d, dtype=k.dtype)  # (blocks, Hkv, K rows | V rows, D)
    paged[-1].zero_()  # the last block's rows past T: the kernel reads whole tiles, and 0 * NaN is NaN
    k_cache, v_cache = paged.chunk(2, dim=2)  # (blocks, Hkv, BLOCK_SIZE, D) each
    slots = torch.arange(t, dtype=torch.int64)  # (T,) row t -> block t // B, offset t % B
    torch.ops._C.cpu_attn_reshape_and_cache(k.transpose(0, 1), v.transpose(0, 1), k_cache, v_cache, slots, isa,
                                            1.0, 1.0, "auto")
    e = ends[lo:]  # (S',)
    starts = _runs(e)  # (R + 1,)
    seq_lens = e[starts[1:].long() - 1].to(torch.int32)  # (R,) a run's last query sees its whole prefix
    n_req = seq_lens.shape[0]
    meta = torch.ops._C.get_scheduler_metadata(n_req, hq, hkv, d, seq_lens, q.dtype, starts, True, -1, isa,
                                               False, None, "auto")
    blocks = torch.arange(nb, dtype=torch.int32).expand(n_req, nb).contiguous()  # (R, blocks)
    qt = q[:, lo:].transpose(0, 1).contiguous()  # (S', Hq, D)
    torch.ops._C.cpu_attention_with_kv_cache(qt, k_cache, v_cache, out[lo:], starts, seq_lens, float(scale), True,
                                             None, -1, blocks, 0.0, meta, None, None, 1.0, 1.0, "auto")
    return out.transpose(0, 1)  # (Hq, S, D)


def usable(dtype: torch.dtype) -> bool:
    """vLLM's ops are registered and agree with the torch reference on this machine (checked once per
    dtype, on a small problem with runs, single queries and a query that sees nothing).

    A mismatch or an error (another vLLM's op schema) is logged once and the torch path is used.

    Args:
        dtype: the call's dtype.

    Returns:
        Whether the ops may serve calls in ``dtype``.
    """
    return ops_registered() and dtype in DTYPES and _self_check(dtype)


@lru_cache(maxsize=None)
def _self_check(dtype: torch.dtype) -> bool:
    g = torch.Generator().manual_seed(0)
    hkv, group, t, d = 2, 3, 300, 64
    k = torch.randn(hkv, t, d, generator=g).to(dtype)  # (Hkv, T, D)
    v = torch.randn(hkv, t, d, generator=g).to(dtype)  # (Hkv, T, D)
    k_pos = torch.arange(5, 5 + t)  # (T,)
    q_pos = torch.tensor([0, 7, 8, 9, 40, 41, 100, 150, 151, 152, 153, 290, 304])  # (S,)
    q = torch.randn(hkv * group, q_pos.shape[0], d, generator=g).to(dtype)  # (Hq, S, D)
    try:
        got = sparse_query_attention_vllm(q, q_pos, k, v, k_pos, d ** -0.5)
    except (RuntimeError, TypeError, ValueError) as e:
        log.warning("vLLM's CPU attention ops are registered but failed a self-check (%s); using torch", e)
        return False
    want = sparse_query_attention_ref(q, q_pos, k, v, k_pos, d ** -0.5)
    tol = TOL[dtype]
    ok = bool(torch.allclose(got.float(), want.float(), atol=tol.atol, rtol=tol.rtol))
    if not ok:
        log.warning("vLLM's CPU attention ops disagree with the torch reference (max |diff| %.3g); using torch",
                    float((got.float() - want.float()).abs().max()))
    return ok
