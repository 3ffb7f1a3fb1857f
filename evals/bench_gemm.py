"""The linear layers' two CPU backends (blend/gemm.py) at SmolLM2-135M's shapes, row counts 1 to 3000.

    python -m blend.evals.bench_gemm [--threads N] [--repeats R] [--json OUT]

For each projection (qkv, o, gate/up, down) and row count M: the median time of
``F.linear`` over the plain weight and of oneDNN's linear over the weight packed
once, interleaved call by call, and the speed-up. M = 1..16 is a decode step's
batch, ~25-80 a question, ~470 a blend's selected rows at ~3k tokens, 3000 a
full prefill.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from blend.evals.environment import describe_environment
from blend.gemm import GemmBackend, linear, onednn_available, pack
from blend import safeio

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}  # (N, K)
ROWS = (1, 4, 16, 25, 79, 470, 3000)


def time_pair(x: torch.Tensor, w: torch.Tensor, packed: torch.Tensor, repeats: int) -> tuple[float, float]:
    """Median seconds of F.linear and of the packed linear over the same rows, interleaved."""
    a, b = [], []
    for _ in range(2):  # warm-up
        F.linear(x, w), linear(x, packed)
    for _ in range(repeats):
        t = time.perf_counter()
        F.linear(x, w)
        a.append(time.perf_counter() - t)
        t = time.perf_counter()
        linear(x, packed)
        b.append(time.perf_counter() - t)
    return statistics.median(a), statistics.median(b)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m blend.evals.bench_gemm", description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if not onednn_available():
        print("this torch build has no oneDNN linear: nothing to compare")
        return 1
    if args.threads:
        torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    rows = []
    print(f"{torch.get_num_threads()} threads; ms per call, median of {args.repeats}")
    print(f"{'proj':8s} {'M':>5s} {'F.linear':>9s} {'oneDNN':>9s} {'speed-up':>8s}")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, generator=g)
        packed = pack(w, GemmBackend.ONEDNN)
        if not packed.is_mkldnn:  # linear() would run F.linear over it: both columns the same GEMM
            print(f"the packed {name} weight is not in oneDNN's layout: its linear would be F.linear")
            return 1
        for m in ROWS:
            x = torch.randn(m, k, generator=g)
            a, b = time_pair(x, w, packed, args.repeats)
            rows.append({"proj": name, "rows": m, "linear_ms": a * 1e3, "onednn_ms": b * 1e3, "speedup": a / b})
            print(f"{name:8s} {m:5d} {a * 1e3:9.3f} {b * 1e3:9.3f} {a / b:7.2f}x")
    if args.json:
        safeio.atomic_write_text(args.json, json.dumps({"threads": torch.get_num_threads(), "dtype": "float32",
                                                        "environment": describe_environment(), "rows": rows},
                                                       indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
