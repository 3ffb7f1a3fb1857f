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
    GemmBackend.ONEDNN   torch.ops.mkldnn._linear_pointwise over a packed weight (CPU, float32)
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
    """Whether this torch build has oneDNN's packed linear (x86 and Arm CPU builds do)."""
    ops = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "_linear_pointwise")
            and hasattr(ops, "_reorder_linear_weight"))


def pick_gemm_backend(choice: str, device: torch.device, dtype: torch.dtype) -> GemmBackend:
    """The backend an engine uses.

    Args:
        choice: ``auto`` (oneDNN for a float32 engine on a CPU with oneDNN, else torch), ``torch`` or
            ``onednn`` (refused where it cannot run).
        device: the engine's device.
        dtype: its compute dtype.

    Returns:
        The backend.

    Raises:
        ValueError: an unknown choice, or ``onednn`` off a CPU, for a dtype other than float32, or
            without oneDNN in this torch build.
    """
    if choice not in GEMM_CHOICES:
        raise ValueError(f"unknown gemm backend {choice!r}; use one of {', '.join(GEMM_CHOICES)}")
    usable = device.type == "cpu" and dtype == torch.float32 and onednn_available()
    if choice == "torch" or (choice == "auto" and not usable):
        return GemmBackend.TORCH
    if not usable:
        raise ValueError("gemm backend 'onednn' needs a float32 engine on a CPU and a torch build with oneDNN")
    return GemmBackend.ONEDNN


def packs_natively(dtype: torch.dtype) -> bool:
    """Whether a weight copy in ``dtype`` (besides float32) is packed too: bf16 on a CPU with native bf16
    arithmetic, where ``F.linear`` already runs oneDNN's bf16 kernel (packing gives the same bits,
    tested, and skips a weight reorder per call); elsewhere such copies stay plain."""
    from blend.cpu_features import native_on_cpu, this_cpu_flags

    return dtype == torch.bfloat16 and onednn_available() and native_on_cpu(dtype, this_cpu_flags()) is True


def pack(w: torch.Tensor, backend: GemmBackend) -> torch.Tensor:
    """A (N, K) weight in the backend's layout (the tensor itself for torch)."""
    if backend is GemmBackend.TORCH:
        return w
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), PACK_BATCH_HINT)  # (N, K), oneDNN layout


def dense(w: torch.Tensor) -> torch.Tensor:
    """The plain (N, K) weight of a packed one (the tensor itself if it is plain): the same values."""
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

