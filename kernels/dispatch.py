"""The one place that decides which implementation runs.

Policy, from the environment variable ``KVBLEND_KERNELS`` (read on every call,
so tests and benchmarks may change it at run time):

  auto    (default) Triton for CUDA tensors when Triton is installed, torch otherwise
  torch   always the torch reference path
  triton  always the Triton kernels; on CPU tensors this needs the interpreter
          (``TRITON_INTERPRET=1``), which is for tests only
  vllm    sparse-query attention on CPU tensors always on vLLM's CPU attention kernel
          (an error where vLLM's ops are not loaded); the other kernels as under auto

Under auto, CPU sparse-query attention runs on vLLM's kernel wherever vLLM has
registered its compiled ops in this process (kvblend's connector inside vLLM's
worker) and they passed a one-time self-check (``vllm_cpu``); elsewhere, and for
every exact-path computation, nothing changes.

Triton is imported only when a Triton kernel is about to run; importing this
module (or ``blend.kernels``) never imports Triton and never queries a GPU.
"""

from __future__ import annotations

import enum
import importlib.util
from functools import lru_cache

import torch

from . import vllm_cpu
from .env import env_choice
from .query_blocks import BlockPlan, sparse_query_attention_blocked
from .reference import kv_deviation_ref, rope_mix_ref, rope_rows_ref, sparse_query_attention_ref

ENV_VAR = "KVBLEND_KERNELS"


class KernelBackend(enum.Enum):
    """Which implementation a kernel call runs."""

    TORCH = "torch"
    TRITON = "triton"
    VLLM_CPU = "vllm-cpu"  # vLLM's compiled CPU attention (sparse-query attention only)


class BackendPolicy(enum.Enum):
    """Values of ``KVBLEND_KERNELS``."""

    AUTO = "auto"
    TORCH = "torch"
    TRITON = "triton"
    VLLM = "vllm"


@lru_cache(maxsize=1)
def triton_available() -> bool:
    """Whether Triton can be imported (checked without importing it).

    Returns:
        Whether a ``triton`` package is installed (cached for the process).
    """
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


def backend_policy() -> BackendPolicy:
    """The policy currently set by ``KVBLEND_KERNELS`` (default ``auto``).

    Returns:
        The :class:`BackendPolicy` (read at every call).

    Raises:
        ValueError: the variable holds something other than auto|torch|triton|vllm.
    """
    return env_choice(ENV_VAR, BackendPolicy, BackendPolicy.AUTO)


def kernel_backend(tensor: torch.Tensor) -> KernelBackend:
    """Pick the implementation for a call whose main input is ``tensor``.

    Args:
        tensor: the kernel's first tensor argument; only its device is looked at.

    Returns:
        ``KernelBackend.TRITON`` for CUDA tensors (policy auto, Triton installed)
        or when the policy forces it; ``KernelBackend.TORCH`` otherwise.

    Raises:
        ValueError: bad ``KVBLEND_KERNELS`` value.
        RuntimeError: policy ``triton`` but Triton is not installed.
    """
    policy = backend_policy()
    if policy is BackendPolicy.TORCH:
        return KernelBackend.TORCH
    if policy is BackendPolicy.TRITON:
        if not triton_available():
            raise RuntimeError(f"{ENV_VAR}=triton but Triton is not installed")
        return KernelBackend.TRITON
    if tensor.is_cuda and triton_available():
        return KernelBackend.TRITON
    return KernelBackend.TORCH


def attention_backend(q: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> KernelBackend:
    """Pick the implementation of one sparse-query attention call.

    Args:
        q: (Hq, S, D) queries; q_pos, k_pos: (S,), (T,) positions (vLLM's kernel takes sorted ones).

    Returns:
        ``KernelBackend.VLLM_CPU`` for CPU calls the vLLM kernel covers when policy ``vllm`` asks
        for it, or under ``auto`` when vLLM's ops are registered and passed their self-check;
        otherwise what :func:`kernel_backend` picks.

    Raises:
        ValueError: bad ``KVBLEND_KERNELS`` value.
        RuntimeError: policy ``vllm`` without vLLM's ops, or ``triton`` without Triton.
    """
    policy = backend_policy()
    if policy is BackendPolicy.VLLM:
        if not vllm_cpu.ops_registered():
            raise RuntimeError(f"{ENV_VAR}=vllm but vLLM's CPU attention ops are not loaded in this process")
        if vllm_cpu.covers(q, q_pos, k_pos):
            return KernelBackend.VLLM_CPU
    elif policy is BackendPolicy.AUTO and vllm_cpu.usable(q.dtype) and vllm_cpu.covers(q, q_pos, k_pos):
        return KernelBackend.VLLM_CPU
    return kernel_backend(q)


def rope_mix(
    cached_k: torch.Tensor,
    cached_v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    fresh_idx: torch.Tensor,
    fresh_k: torch.Tensor,
    fresh_v: torch.Tensor,
    trusted_indices: bool = False,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Build one layer's K/V for the blended sequence in one pass.

    Rows listed in ``fresh_idx`` take their K/V from ``fresh_k``/``fresh_v``,
    every other row from ``cached_k``/``cached_v``; then K's first R dims are
    rotated (HF convention, ``x*cos + rotate_half(x)*sin``) at each row's new
    position, in fp32, and stored in K's dtype. ``fresh_idx`` may be in any
    order (row i of ``fresh_k`` lands at row ``fresh_idx[i]``); duplicates are
    rejected.

    Args:
        cached_k: (Hkv, T, D) keys before RoPE (rows that get a fresh value may hold anything).
        cached_v: (Hkv, T, D) values, same dtype as ``cached_k``.
        cos: (T, R) rotary table at each row's new absolute position; R even, R <= D.
        sin: (T, R) likewise. Any float dtype; the tables include any attention scaling.
        fresh_idx: (S,) int64 distinct row indices in [0, T), any order; S may be 0 or T.
        fresh_k: (Hkv, S, D) recomputed keys before RoPE.
        fresh_v: (Hkv, S, D) recomputed values.
        trusted_indices: the caller guarantees ``fresh_idx`` is in range and
            duplicate-free; skips that check and its device-to-host sync.
        out: ``(k_out, v_out)``, (Hkv, T, D) each in the inputs' dtypes, contiguous
            along D, sharing strides (e.g. rows of a KV cache): written instead of
            allocating; must not overlap the inputs.

    Returns:
        ``(k_rot, v)``: (Hkv, T, D) keys after RoPE and (Hkv, T, D) values, new
        contiguous tensors in the input dtype (or ``out``); the inputs are not modified.

    Raises:
        ValueError: shape, dtype or device mismatch, indices out of range or duplicated.
    """
    if kernel_backend(cached_k) is KernelBackend.TRITON:
        from .rope_mix_kernel import rope_mix_triton

        return rope_mix_triton(cached_k, cached_v, cos, sin, fresh_idx, fresh_k, fresh_v, trusted_indices, out)
    return rope_mix_ref(cached_k, cached_v, cos, sin, fresh_idx, fresh_k, fresh_v, trusted_indices, out)


def rope_rows(k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rope_mix` with no fresh rows (every row's K rotated at its table row, V beside it), for
    callers that built every argument themselves (the engine, dozens of times per request): the
    same numbers, without the argument checks.

    Args:
        k, v: (H, T, D) keys before RoPE and values (H may be layers x heads, flattened).
        cos, sin: (T, R) rotary tables.
        out: as :func:`rope_mix`'s ``out`` (e.g. rows of a KV cache), or None.

    Returns:
        ``(k_rot, v)``: K after RoPE (new, or ``out[0]``) and V (``v`` itself, or ``out[1]`` holding a copy).
    """
    if kernel_backend(k) is KernelBackend.TRITON:
        none = torch.empty(0, dtype=torch.long, device=k.device)
        return rope_mix(k, v, cos, sin, none, k[:, :0], v[:, :0], trusted_indices=True, out=out)
    return rope_rows_ref(k, v, cos, sin, out)


def kv_deviation(fresh: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
    """Per-token L2 deviation between fresh and cached K (or V), ready for top-k.

    Args:
        fresh: (H, S, D) any float dtype.
        cached: (H, S, D) any float dtype.

    Returns:
        (S,) float32: ``sqrt(sum over h, d of (fresh - cached)**2)``, computed in fp32.

    Raises:
        ValueError: shape or device mismatch, non-float input.
    """
    if kernel_backend(fresh) is KernelBackend.TRITON:
        from .deviation_kernel import kv_deviation_triton

        return kv_deviation_triton(fresh, cached)
    return kv_deviation_ref(fresh, cached)


def sparse_query_attention(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float,
    plan: BlockPlan | None = None,
) -> torch.Tensor:
    """Attention of a subset of queries over the whole K/V, causal by absolute position.

    Key j is visible to query i iff ``k_pos[j] <= q_pos[i]``; query head h reads
    KV head ``h // (Hq // Hkv)`` (GQA). Softmax statistics and accumulation are fp32.

    Args:
        q: (Hq, S, D) queries after RoPE.
        q_pos: (S,) int64 absolute positions of the queries.
        k: (Hkv, T, D) keys after RoPE, same dtype as ``q``; Hq % Hkv == 0.
        v: (Hkv, T, D) values, same dtype as ``q``.
        k_pos: (T,) int64 absolute positions of the keys.
        scale: softmax scale (usually ``D ** -0.5``).
        plan: the CPU path's :class:`~blend.kernels.query_blocks.BlockPlan` for these positions, made once
            by a caller that attends at the same positions layer after layer (other backends ignore it).

    Returns:
        (Hq, S, D) in q's dtype; a query that sees no key gets zeros.

    Raises:
        ValueError: shape, dtype or device mismatch, or a plan made for other positions or head counts.
    """
    backend = attention_backend(q, q_pos, k_pos)
    if backend is KernelBackend.TRITON:
        from .attention_kernel import sparse_query_attention_triton

        return sparse_query_attention_triton(q, q_pos, k, v, k_pos, scale)
    if backend is KernelBackend.VLLM_CPU:
        return vllm_cpu.sparse_query_attention_vllm(q, q_pos, k, v, k_pos, scale)
    return sparse_query_attention_blocked(q, q_pos, k, v, k_pos, scale, plan=plan)
