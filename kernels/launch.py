"""Small launch helpers shared by the Triton launchers. Imports no Triton at import time."""

from __future__ import annotations

import os
import sys

import torch

INTERPRET_ENV = "TRITON_INTERPRET"


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


def next_pow2(n: int) -> int:
    """Smallest power of two >= max(n, 1)."""
    return 1 << max(n - 1, 0).bit_length()
