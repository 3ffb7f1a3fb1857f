"""The Triton kernels on a KV buffer past 2**31 elements (the prepared device check's large-offset case).

    python -m blend.evals.check_offsets --device cuda --json OUT.json

One token-major, multi-layer K/V buffer (T, L, 2, Hkv, D), by default a 128k-token Llama-3-8B cache
(131,072 x 32 x 2 x 8 x 128 fp16: 8.6e9 elements, 17 GB). A layer's K and V viewed as (Hkv, T, D)
have a token stride of L*2*Hkv*D = 65,536 elements, so their rows from 32,768 on lie 2**31 elements
or more past the views' start, where 32-bit offset arithmetic wraps. Each kernel runs on such views
and is compared with its torch reference on contiguous copies of the same values:

- sparse_query_attention: the last rows' queries (GQA 4:1) over every key of layer ``l``;
- rope_mix: layer ``l``'s rows with every seventh row fresh, written into layer ``l + 1``'s rows (``out=``);
- kv_deviation: fresh keys against layer ``l``'s K.

Prints one line per kernel and exits non-zero if one differs from its reference beyond ``TOL[dtype]``.
On the CPU (CI keeps it runnable, at small shapes) the buffer is a sparse mapping and the kernels are
whatever ``KVBLEND_KERNELS`` dispatches to (Triton only under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from blend import safeio
from blend.kernels import kernel_backend, kv_deviation, rope_mix, sparse_query_attention
from blend.kernels.reference import kv_deviation_ref, rope_mix_ref, sparse_query_attention_ref
from blend.kernels.testing import INT32_LIMIT, rotary_tables, sparse_buffer
from blend.kernels.tolerances import TOL


@dataclass(frozen=True)
class CacheShape:
    """A token-major KV buffer (T, L, 2, Hkv, D): every layer's K and V of a token side by side."""

    tokens: int
    layers: int
    kv_heads: int
    head_dim: int

    @property
    def token_stride(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim

    @property
    def numel(self) -> int:
        return self.tokens * self.token_stride

    @property
    def first_far(self) -> int:
        """The first token whose row starts 2**31 elements or more into a layer's view."""
        return -(-INT32_LIMIT // self.token_stride)

    def layer(self, buf: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V in ``buf`` (numel elements), each viewed (Hkv, T, D)."""
        hd = self.kv_heads * self.head_dim
        shape, strides = (self.kv_heads, self.tokens, self.head_dim), (self.head_dim, self.token_stride, 1)
        return (buf.as_strided(shape, strides, layer * 2 * hd),  # (Hkv, T, D)
                buf.as_strided(shape, strides, layer * 2 * hd + hd))  # (Hkv, T, D)


@dataclass(frozen=True)
class OffsetCheck:
    kernel: str
    ok: bool
    max_abs_err: float
    detail: str


def _compare(kernel: str, actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype,
             detail: str) -> OffsetCheck:
    tol = TOL[dtype]
    err = float((actual.float() - expected.float()).abs().max()) if actual.numel() else 0.0
    ok = actual.shape == expected.shape and bool(torch.isclose(actual.float(), expected.float(),
                                                               atol=tol.atol, rtol=tol.rtol).all())
    return OffsetCheck(kernel, ok, err, detail)


def run_checks(shape: CacheShape, queries: int, group: int, dtype: torch.dtype, device: str,
               layer: int = 1, seed: int = 0) -> list[OffsetCheck]:
    """The three kernels on layer ``layer`` of one :class:`CacheShape` buffer.

    Args:
        shape: the buffer; queries: query rows (the last ones); group: query heads per KV head.
        dtype, device: the buffer's; layer: the layer read (``layer + 1`` is written).
        seed: of the random values.

    Returns:
        One :class:`OffsetCheck` per kernel call.

    Raises:
        MemoryError, OSError: the buffer cannot be allocated.
    """
    if not 0 <= layer < shape.layers - 1:
        raise ValueError(f"layer {layer} must leave a layer after it (of {shape.layers})")
    gen = torch.Generator(device=device).manual_seed(seed)
    hkv, t, d = shape.kv_heads, shape.tokens, shape.head_dim

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, device=device, dtype=torch.float32).to(dtype)

    buf = sparse_buffer(shape.numel, dtype, device)  # (T L 2 Hkv D,)
    k, v = shape.layer(buf, layer)  # (Hkv, T, D) x2, rows first_far.. past 2**31
    k.copy_(randn(hkv, t, d))
    v.copy_(randn(hkv, t, d))
    k_c, v_c = k.contiguous(), v.contiguous()  # (Hkv, T, D) the same values, for the references
    far = f"T={t}, token stride {shape.token_stride}: rows {shape.first_far}.. past 2**31"
    out: list[OffsetCheck] = []

    pos = torch.arange(t, device=device)  # (T,)
    q = randn(hkv * group, queries, d)  # (Hq, S, D)
    q_pos = pos[t - queries:]  # (S,) the last rows: every key visible
    args = (q_pos, k, v, pos, d ** -0.5)
    got = sparse_query_attention(q, *args)
    out.append(_compare("sparse_query_attention", got,
                        sparse_query_attention_ref(q, q_pos, k_c, v_c, pos, d ** -0.5), dtype, far))

    fresh_idx = torch.arange(t - 1, -1, -7, device=device)  # (F,) every seventh row, descending, near and far
    cos, sin = (x.to(device) for x in rotary_tables(pos.cpu() + 100, d))  # (T, D) x2
    fresh_k, fresh_v = randn(hkv, fresh_idx.numel(), d), randn(hkv, fresh_idx.numel(), d)  # (Hkv, F, D) x2
    k_out, v_out = shape.layer(buf, layer + 1)  # (Hkv, T, D) x2: the next layer's rows
    rope_mix(k, v, cos, sin, fresh_idx, fresh_k, fresh_v, out=(k_out, v_out))
    k_ref, v_ref = rope_mix_ref(k_c, v_c, cos, sin, fresh_idx, fresh_k, fresh_v)
    out.append(_compare("rope_mix K (out= rows of the next layer)", k_out, k_ref, dtype, far))
    out.append(_compare("rope_mix V (out= rows of the next layer)", v_out, v_ref, dtype, far))
    unchanged = torch.equal(k, k_c) and torch.equal(v, v_c)
    out.append(OffsetCheck("rope_mix leaves its inputs", unchanged, 0.0 if unchanged else 1.0, far))

    fresh = randn(hkv, t, d)  # (Hkv, T, D)
    out.append(_compare("kv_deviation", kv_deviation(fresh, k), kv_deviation_ref(fresh, k_c), torch.float32, far))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m blend.evals.check_offsets", description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float16")
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--group", type=int, default=4, help="query heads per KV head")
    ap.add_argument("--queries", type=int, default=64)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    shape = CacheShape(args.tokens, args.layers, args.kv_heads, args.head_dim)
    dtype = getattr(torch, args.dtype)
    backend = kernel_backend(torch.empty(0, device=args.device)).value
    checks = run_checks(shape, args.queries, args.group, dtype, args.device)
    for c in checks:
        print(f"{'ok  ' if c.ok else 'FAIL'} {c.kernel}: max |err| {c.max_abs_err:.3g} ({c.detail})")
    print(f"kernel backend on {args.device}: {backend}; buffer {shape.numel} elements ({args.dtype})")
    if args.json:
        safeio.atomic_write_text(args.json, json.dumps({"device": args.device, "backend": backend,
                                                        "shape": asdict(shape), "dtype": args.dtype,
                                                        "checks": [asdict(c) for c in checks]}, indent=1))
    return 0 if all(c.ok for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
