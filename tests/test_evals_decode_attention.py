"""The decode-attention benchmark compares formulations of the same attention."""

from __future__ import annotations

import torch

from blend.evals.bench_decode_attention import Shape, run, variants


def test_every_variant_computes_the_decode_rows_attention() -> None:
    shape = Shape(batch=2, tokens=37, layers=2)
    res = run(shape, repeats=1)
    assert set(res) == {"sdpa_mask", "sdpa", "sdpa_packed", "bmm", "pooled_sdpa", "pooled_bmm"}
    for r in res.values():
        assert r["max_abs_diff"] < 1e-5 and r["step_ms"] > 0 and r["gb_per_s"] > 0


def test_packed_heads_map_to_their_kv_head() -> None:
    """Query head h reads KV head h // group in every variant (as SDPA's enable_gqa does)."""
    shape = Shape(batch=1, tokens=5, layers=1)
    q = torch.randn(shape.q_heads, 1, shape.head_dim)
    k = torch.zeros(shape.kv_heads, shape.tokens, shape.head_dim)
    v = torch.arange(shape.kv_heads, dtype=torch.float32)[:, None, None].expand(-1, shape.tokens, shape.head_dim)
    want = (torch.arange(shape.q_heads) // (shape.q_heads // shape.kv_heads)).float()  # (Hq,)
    for fn in variants(shape).values():
        out = fn(q, k, v.contiguous())  # (Hq, 1, D): uniform attention returns the KV head's value
        assert torch.allclose(out[:, 0, 0], want)


def test_a_variants_first_call_is_not_a_timed_step(monkeypatch) -> None:
    """Each variant's first step (kernel selection, first-touch of its buffers) was repeat 0's sample: with
    --repeats 1 the only one."""
    import time

    from blend.evals import bench_decode_attention as B

    real = B.variants
    slow_s = 0.3

    def with_a_slow_first_call(shape):
        fns, first = real(shape), [True]

        def slow(q, k, v):
            if first[0]:
                first[0] = False
                time.sleep(slow_s)
            return fns["sdpa"](q, k, v)

        return {"sdpa_mask": fns["sdpa_mask"], "slow_first": slow}

    monkeypatch.setattr(B, "variants", with_a_slow_first_call)
    res = B.run(Shape(batch=2, tokens=16, layers=2), repeats=1)
    assert res["slow_first"]["step_ms"] < slow_s * 1e3 / 2
