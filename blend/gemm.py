"""The model's linear layers: torch's ``F.linear`` or oneDNN over weights packed once.

On a CPU, ``F.linear`` hands float32 GEMMs to MKL, which re-reads the weight in
its plain (N, K) layout at every call. oneDNN's linear over a weight reordered
once into its blocked layout (what vLLM's CPU backend and torch's inductor
freezing do) measured, SmolLM2 shapes, two threads, AVX-512 EPYC: 3.4x faster at
M = 1 row (a decode step), 2.1x at 16, 1.7x at 79 (a question), 1.3x at 470 (a
blend's selected rows), 1.13x at 3,000 (a full prefill). Both are float32 GEMMs;
they differ in reduction order (last bits), so the backend is part of the KV's
provenance (its ``value``) and every path of one engine uses the same one
(cold == warm stays bit for bit).

    GemmBackend.TORCH    F.linear over the plain weight (CUDA, or on request)
    GemmBackend.ONEDNN   torch.ops.mkldnn._linear_pointwise over a packed weight (CPU: float32, and
                         bfloat16 where the CPU has native bf16 arithmetic)

A bfloat16 engine's ``F.linear`` on a CPU with native bf16 (AVX-512 BF16, AMX) already runs
oneDNN's bf16 kernel, but reorders the weight at every call: over a packed weight the same
kernel measured 2.1-2.5x faster at one row (a decode step, the LM head), 1.5x at 23-114 rows (a
question, a blend's selected rows) and equal at 3,000 (AMX Xeon, two threads). Elsewhere bf16
would be emulated, and the engine keeps ``F.linear``.
"""

from __future__ import annotations

from enum import Enum

import torch
import torch.nn.functional as F

from blend.defaults import GEMM_CHOICES

PACK_BATCH_HINT = 32  # rows the packed layout is tuned for (within 2% of per-size packing at 1..3000 rows)


class GemmBackend(Enum):
    TORCH = "torch-linear"
    ONEDNN = "onednn-packed"


def onednn_available() -> bool:
    """Whether this torch build has oneDNN's packed linear (x86 and Arm CPU builds do).

    Returns:
        True where both ``torch.ops.mkldnn`` ops exist and mkldnn is available.
    """
    ops = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "_linear_pointwise")
            and hasattr(ops, "_reorder_linear_weight"))


def pick_gemm_backend(choice: str, device: torch.device, dtype: torch.dtype,
                      flags: frozenset[str] | None = None) -> GemmBackend:
    """The backend an engine uses.

    Args:
        choice: ``auto`` (oneDNN for a float32 engine on a CPU with oneDNN, and for a bfloat16 one
            where bf16 is native too; else torch), ``torch`` or ``onednn`` (refused where it cannot run).
        device: the engine's device.
        dtype: its compute dtype.
        flags: CPU flags (default: this machine's).

    Returns:
        The backend.

    Raises:
        ValueError: an unknown choice, or ``onednn`` off a CPU, for float16, for bfloat16 without
            native bf16, or without oneDNN in this torch build.
    """
    if choice not in GEMM_CHOICES:
        raise ValueError(f"unknown gemm backend {choice!r}; use one of {', '.join(GEMM_CHOICES)}")
    usable = device.type == "cpu" and onednn_available() and (dtype == torch.float32 or packs_natively(dtype, flags))
    if choice == "torch" or (choice == "auto" and not usable):
        return GemmBackend.TORCH
    if not usable:
        raise ValueError("gemm backend 'onednn' needs a CPU engine in float32, or in bfloat16 on a CPU with native "
                         "bf16 (AVX-512 BF16 or AMX), and a torch build with oneDNN")
    return GemmBackend.ONEDNN


def packs_natively(dtype: torch.dtype, flags: frozenset[str] | None = None) -> bool:
    """Whether GEMM matrices in ``dtype`` (besides float32) are packed: bf16 on a CPU with native bf16
    arithmetic, where ``F.linear`` already runs oneDNN's bf16 kernel and packing skips a weight reorder
    per call (a bf16 engine's layers, a float32 engine's bf16 probe copy); elsewhere they stay plain.

    Args:
        dtype: the matrices' dtype.
        flags: CPU flags (default: this machine's).

    Returns:
        True only for bfloat16 on a CPU with native bf16 arithmetic and oneDNN available.
    """
    from blend.cpu_features import native_on_cpu, this_cpu_flags

    if dtype != torch.bfloat16 or not onednn_available():
        return False
    return native_on_cpu(dtype, this_cpu_flags() if flags is None else flags) is True


def pack(w: torch.Tensor, backend: GemmBackend) -> torch.Tensor:
    """A (N, K) weight in the backend's layout (the tensor itself for torch).

    Args:
        w: the weight, (N, K).
        backend: the GEMM backend the weight is used with.

    Returns:
        ``w`` itself for :attr:`GemmBackend.TORCH`; for oneDNN a packed (N, K) copy in its opaque layout.
    """
    if backend is GemmBackend.TORCH:
        return w
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), PACK_BATCH_HINT)  # (N, K), oneDNN layout


def dense(w: torch.Tensor) -> torch.Tensor:
    """The plain (N, K) weight of a packed one (the tensor itself if it is plain): the same values.

    Args:
        w: a weight, (N, K), packed (mkldnn) or plain.

    Returns:
        A plain strided (N, K) tensor.
    """
    return w.to_dense() if w.is_mkldnn else w


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T + b over a plain or packed weight.

    Args:
        x: (S, K) rows.
        w: (N, K) weight, plain or from :func:`pack`.
        b: (N,) bias or None.

    Returns:
        (S, N) in x's dtype.
    """
    if w.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, b, "none", [], "")  # (S, N)
    return F.linear(x, w, b)  # (S, N)

