"""Small launch helpers shared by the Triton launchers. Imports no Triton."""

from __future__ import annotations

import os

INTERPRET_ENV = "TRITON_INTERPRET"


def interpreting() -> bool:
    """True when Triton kernels run under the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get(INTERPRET_ENV, "0") not in ("", "0")


def next_pow2(n: int) -> int:
    """Smallest power of two >= max(n, 1)."""
    return 1 << max(n - 1, 0).bit_length()
