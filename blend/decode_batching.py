"""How a decode step batches its sequences' GEMMs (:class:`DecodeBatching`; the step itself is
:mod:`blend.batch_decode`). Kept apart so that the server's settings and ``kvblend serve``'s parser
name the modes without importing torch."""

from __future__ import annotations

from enum import Enum


class DecodeBatching(Enum):
    THROUGHPUT = "throughput"  # one GEMM over the batch; equal to one-at-a-time within float rounding
    INVARIANT = "invariant"  # fixed-size GEMM tiles; bit-identical to one-at-a-time
