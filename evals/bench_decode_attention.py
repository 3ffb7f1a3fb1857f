"""Decode-step attention at serving shapes: is the per-sequence loop the cost, or the bytes?

A batched decode step (``blend.batch_decode``) attends each sequence's one new query row over its
own cache, one SDPA call per sequence and layer. This times that loop against the formulations a
serving engine could switch to, on the same caches, interleaved, in one process:

- ``sdpa_mask``: what ``BatchDecodeRows.attend`` does (9 query heads, GQA, an additive mask row);
- ``sdpa``: the same without the mask (every cached row is visible to a decode row);
- ``sdpa_packed``: GQA packing (the 3 query heads of a KV head as 3 query rows; no repeat, no mask);
- ``bmm``: scores by ``bmm``, softmax, ``bmm`` (the GEMM library instead of the flash kernel);
- ``pooled_sdpa`` / ``pooled_bmm``: ONE call per layer for all sequences, as if every cache were a
  slot of one pooled tensor (B, Hkv, T, D) (equal lengths here, so no padding or mask).

If every variant takes the same time, the step is bound by reading the caches (bytes / time is
then the memory bandwidth one thread gets), and only fewer bytes (a lower-precision cache) or more
cores make it faster.

    python -m blend.evals.bench_decode_attention [--batch 16] [--tokens 780] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

Variant = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Shape:
    """One decode step's attention: ``batch`` sequences of ``tokens`` cached rows over ``layers``."""

    batch: int = 16
    tokens: int = 780
    layers: int = 30
    q_heads: int = 9
    kv_heads: int = 3
    head_dim: int = 64

    @property
    def cache_bytes(self) -> int:
        """fp32 K and V read by one step."""
        return self.batch * self.layers * 2 * self.kv_heads * self.tokens * self.head_dim * 4


def variants(shape: Shape) -> dict[str, Variant]:
    """name -> f(q (Hq, 1, D), k (Hkv, T, D), v (Hkv, T, D)) -> (Hq, 1, D)."""
    scale = shape.head_dim ** -0.5
    group = shape.q_heads // shape.kv_heads
    mask = torch.zeros(1, shape.tokens)  # (1, T): a decode row sees every cached row

    def sdpa_mask(q, k, v):
        return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scale,
                                              enable_gqa=True)[0]

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q[None], k[None], v[None], scale=scale, enable_gqa=True)[0]

    def sdpa_packed(q, k, v):
        qg = q.reshape(shape.kv_heads, group, shape.head_dim)  # (Hkv, G, D)
        return F.scaled_dot_product_attention(qg[None], k[None], v[None], scale=scale)[0].reshape(q.shape)

    def bmm(q, k, v):
        qg = q.reshape(shape.kv_heads, group, shape.head_dim)  # (Hkv, G, D)
        p = torch.softmax(torch.bmm(qg, k.transpose(1, 2)) * scale, dim=-1)  # (Hkv, G, T)
        return torch.bmm(p, v).reshape(q.shape)

    return {"sdpa_mask": sdpa_mask, "sdpa": sdpa, "sdpa_packed": sdpa_packed, "bmm": bmm}


def run(shape: Shape, repeats: int = 5, seed: int = 0) -> dict[str, dict[str, float]]:
    """Time every variant over one step's caches, interleaved, after one untimed step of each.

    Args:
        shape: the step.
        repeats: timed steps per variant.
        seed: for the random caches.

    Returns:
        name -> {"step_ms": median, "gb_per_s": cache bytes / median, "max_abs_diff": against sdpa_mask}.
    """
    g = torch.Generator().manual_seed(seed)
    kv = (shape.kv_heads, shape.tokens, shape.head_dim)
    caches = [[(torch.randn(kv, generator=g), torch.randn(kv, generator=g)) for _ in range(shape.layers)]
              for _ in range(shape.batch)]  # [seq][layer] -> (K, V), each (Hkv, T, D)
    qs = torch.randn(shape.batch, shape.q_heads, 1, shape.head_dim, generator=g)  # (B, Hq, 1, D)
    fns = variants(shape)
    ref = fns["sdpa_mask"](qs[0], *caches[0][0])  # (Hq, 1, D) sequence 0, layer 0

    def per_sequence(fn: Variant) -> tuple[Callable, Callable]:
        return (lambda q, layer: [fn(q[i], *caches[i][layer]) for i in range(shape.batch)], lambda rows: rows[0])

    steps = {**{name: per_sequence(fn) for name, fn in fns.items()}, **_pooled(shape, caches)}
    times: dict[str, list[float]] = {name: [] for name in steps}
    for layer_step, _ in steps.values():  # warm-up, untimed: each variant's first calls are no sample
        for layer in range(shape.layers):
            layer_step(qs, layer)
    for _ in range(repeats):
        for name, (layer_step, _) in steps.items():
            t0 = time.perf_counter()
            for layer in range(shape.layers):
                layer_step(qs, layer)
            times[name].append(time.perf_counter() - t0)
    out = {}
    for name, (layer_step, first) in steps.items():
        step = statistics.median(times[name])
        out[name] = {"step_ms": step * 1e3, "gb_per_s": shape.cache_bytes / step / 1e9,
                     "max_abs_diff": float((first(layer_step(qs, 0)) - ref).abs().max())}
    return out


def _pooled(shape: Shape, caches: list) -> dict[str, tuple[Callable, Callable]]:
    """name -> (f(q (B, Hq, 1, D), layer) -> all sequences' rows, g(rows) -> sequence 0's (Hq, 1, D)),
    with every cache a slot of one stacked (B, Hkv, T, D) tensor per layer."""
    b, hkv, g, d = shape.batch, shape.kv_heads, shape.q_heads // shape.kv_heads, shape.head_dim
    scale = d ** -0.5
    ks = [torch.stack([caches[i][layer][0] for i in range(b)]) for layer in range(shape.layers)]  # (B, Hkv, T, D)
    vs = [torch.stack([caches[i][layer][1] for i in range(b)]) for layer in range(shape.layers)]  # (B, Hkv, T, D)

    def pooled_sdpa(qs, layer):
        return F.scaled_dot_product_attention(qs.reshape(b, hkv, g, d), ks[layer], vs[layer], scale=scale)

    def pooled_bmm(qs, layer):
        k = ks[layer].reshape(b * hkv, shape.tokens, d)  # (B Hkv, T, D)
        p = torch.softmax(torch.bmm(qs.reshape(b * hkv, g, d), k.transpose(1, 2)) * scale, dim=-1)  # (B Hkv, G, T)
        return torch.bmm(p, vs[layer].reshape(b * hkv, shape.tokens, d))  # (B Hkv, G, D)

    def first_sdpa(rows):
        return rows[0].reshape(shape.q_heads, 1, d)

    def first_bmm(rows):
        return rows[:hkv].reshape(shape.q_heads, 1, d)

    return {"pooled_sdpa": (pooled_sdpa, first_sdpa), "pooled_bmm": (pooled_bmm, first_bmm)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=780, help="cached rows per sequence")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the decode loop has one)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    shape = Shape(batch=args.batch, tokens=args.tokens)
    res = run(shape, args.repeats)
    print(f"{shape.batch} sequences x {shape.layers} layers, {shape.tokens} cached rows each: "
          f"{shape.cache_bytes / 1e6:.0f} MB of fp32 K/V per step; {args.threads} thread(s)")
    print("| variant | step ms | GB/s | max abs diff |\n|---|---:|---:|---:|")
    for name, r in res.items():
        print(f"| {name} | {r['step_ms']:.1f} | {r['gb_per_s']:.1f} | {r['max_abs_diff']:.1e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
