"""One tolerance table for every kernel test (and, later, the engine tests).

``TOL[dtype]`` bounds ``|actual - expected| <= atol + rtol * |expected|`` when a
kernel's output is compared with its torch reference. The low-precision rows
are set by the storage format, not by the kernels: both sides compute in fp32,
but a Triton store of fp32 into bf16 truncates while torch rounds to nearest,
so two correct bf16 results may differ by one bf16 ulp (2**-7 relative);
fp16 has a 2**-10 ulp.

The same rows carry the engine-level bounds of the blend quality gate
(``kvblend check``): ``logits`` bounds ``max |logits - reference logits|`` of a
whole forward, ``rope`` bounds ``max |re-positioned K - K of a full prefill|``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tol:
    """Absolute and relative tolerance, in the form ``torch.testing.assert_close`` takes,
    plus the engine-level bounds of the quality gate."""

    atol: float
    rtol: float
    logits: float  # max |logits - reference| of a whole forward
    rope: float  # max |re-positioned layer-0 K - K of a full prefill|


TOL: dict[torch.dtype, Tol] = {
    torch.float32: Tol(atol=2e-5, rtol=1e-4, logits=1e-3, rope=1e-5),
    torch.float16: Tol(atol=2e-3, rtol=2e-3, logits=0.05, rope=2e-3),
    torch.bfloat16: Tol(atol=1.6e-2, rtol=1.6e-2, logits=0.3, rope=2e-2),
}
