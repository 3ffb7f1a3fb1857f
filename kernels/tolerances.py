"""One tolerance table for every kernel test (and, later, the engine tests).

``TOL[dtype]`` bounds ``|actual - expected| <= atol + rtol * |expected|`` when a
kernel's output is compared with its torch reference. The low-precision rows
are set by the storage format, not by the kernels: both sides compute in fp32,
but a Triton store of fp32 into bf16 truncates while torch rounds to nearest,
so two correct bf16 results may differ by one bf16 ulp (2**-7 relative);
fp16 has a 2**-10 ulp.

The same rows carry the engine-level bounds of the blend quality gate
(``kvblend check``): ``logits`` bounds ``max |logits - reference logits|`` of a
whole forward, ``rope`` bounds ``max |re-positioned K - K of a full prefill|``,
each plus ``gate_rtol`` times the magnitude the value carries (the largest logit;
the largest K of the head's row: ``blend.gate.beyond``). In fp32 the gate's bounds
are absolute (``gate_rtol`` 0); a bf16 or fp16 value is only known to an ulp of
its magnitude (bf16 K of magnitude 8-16 has 0.0625 between neighbours, logits of
16-32 have 0.125), so there the relative part is two ulps: with absolute bounds
the gate refused bf16 SmolLM2 on one- to four-ulp differences.
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
    gate_rtol: float = 0.0  # the gate's bounds grow by this times the value's magnitude (two ulps; 0 in fp32)


TOL: dict[torch.dtype, Tol] = {
    torch.float32: Tol(atol=2e-5, rtol=1e-4, logits=1e-3, rope=1e-5),
    torch.float16: Tol(atol=2e-3, rtol=2e-3, logits=0.05, rope=2e-3, gate_rtol=2 * 2**-10),
    torch.bfloat16: Tol(atol=1.6e-2, rtol=1.6e-2, logits=0.3, rope=2e-2, gate_rtol=2 * 2**-7),
}
