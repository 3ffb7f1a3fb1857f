"""Small launch helpers shared by the Triton launchers. Imports no Triton at import time."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Sequence

import torch

INTERPRET_ENV = "TRITON_INTERPRET"
INT32_MAX = 2**31 - 1  # the largest offset a kernel's 32-bit in-tile arithmetic holds


def interpreted(kernel: object) -> bool:
    """Whether ``kernel`` (a ``@triton.jit`` function) runs under Triton's CPU interpreter.

    Triton decides this when the kernel's module is imported, from its own reading of
    ``TRITON_INTERPRET`` (``1``/``true``/``on``/``yes``; ``0``/``false``/``off``/``no`` mean compiled), so the
    kernel object is asked, not the variable: a launcher that read the variable itself took
    ``TRITON_INTERPRET=false`` for the interpreter and handed CPU tensors to a compiled kernel.

    Args:
        kernel: the jitted kernel.

    Returns:
        True for an interpreted kernel.
    """
    interpreter = sys.modules.get("triton.runtime.interpreter")  # imported by Triton for its first interpreted kernel
    return interpreter is not None and isinstance(kernel, interpreter.InterpretedFunction)


def _interpret_now() -> bool | None:
    """Triton's reading of ``TRITON_INTERPRET`` at this moment (None: a Triton without ``knobs``)."""
    try:
        from triton import knobs
    except ImportError:
        return None
    return bool(knobs.runtime.interpret)


def require_runnable(kernel: object, t: torch.Tensor, what: str) -> bool:
    """Refuse, with a clear error, a launch the kernel cannot run: CPU tensors need an interpreted
    kernel, CUDA tensors run either way, other devices never; and the interpreter (which reads the
    variable again at launch) needs it still on.

    Args:
        kernel: the jitted kernel; t: its main tensor argument; what: the kernel's name, for the message.

    Returns:
        Whether ``kernel`` is interpreted (the launchers pick block sizes and the dot's precision by it).

    Raises:
        ValueError: CPU tensors with a compiled kernel, a device other than CPU/CUDA, or
            ``TRITON_INTERPRET`` switched after the kernel was defined.
    """
    interp = interpreted(kernel)
    now = _interpret_now()
    if now is not None and now != interp:
        raise ValueError(
            f"{INTERPRET_ENV}={os.environ.get(INTERPRET_ENV)!r} now, but the Triton {what} kernel was defined "
            f"{'under' if interp else 'without'} the interpreter: set {INTERPRET_ENV} before the kernels' first use"
        )
    if t.is_cuda or (t.device.type == "cpu" and interp):
        return interp
    raise ValueError(
        f"the Triton {what} kernel needs CUDA tensors (or {INTERPRET_ENV}=1 on CPU, set before the kernels' "
        f"first use), got {t.device}"
    )


def on_device(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """The context a launch for ``t`` runs in: Triton launches on the *current* CUDA device, not the
    tensors', so an engine on ``cuda:1`` while ``cuda:0`` is current would run its kernels on the wrong
    GPU (reading addresses that are not that GPU's); this makes ``t``'s device current for the launch, as
    vLLM's and SGLang's launchers do. CPU tensors (the interpreter): nothing.

    Args:
        t: the launch's main tensor (the checks have put every argument on its device).

    Returns:
        A context manager to launch under.
    """
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def next_pow2(n: int) -> int:
    """Smallest power of two >= max(n, 1).

    Args:
        n: a size (0 or less counts as 1).

    Returns:
        The power of two.
    """
    return 1 << max(n - 1, 0).bit_length()


def require_int32_tiles(what: str, name: str, t: torch.Tensor, tile: Sequence[int]) -> None:
    """Refuse a tensor whose strides make one tile's offsets overflow 32 bits.

    The kernels compute each tile's base offset (its head, its first row) in 64 bits and the offsets
    inside a tile in 32 bits; a tile's largest in-tile offset is ``sum((min(tile[i], size[i]) - 1) *
    stride[i])``. Only a row stride of tens of millions of elements breaks this (a tile of 64 rows at a
    stride over 2**25), so such views are refused rather than given 64-bit offsets everywhere.

    Args:
        what: the kernel's name, for the message; name: the argument's.
        t: the argument; tile: the extent of one tile along each of its dims (1 where the base moves).

    Raises:
        ValueError: the tile's offsets do not fit int32.
    """
    if t.numel() == 0:
        return
    span = sum((min(b, n) - 1) * s for b, n, s in zip(tile, t.shape, t.stride()))
    if span > INT32_MAX:
        raise ValueError(
            f"the Triton {what} kernel cannot address {name} of shape {tuple(t.shape)} and strides {t.stride()}: "
            f"one tile spans {span} elements, past its 32-bit in-tile offsets; pass a more compact view "
            f"(e.g. .contiguous())"
        )
