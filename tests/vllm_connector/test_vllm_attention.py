"""vLLM's CPU attention kernel as the blend's sparse-query attention (kernels/vllm_cpu.py).

Runs where vLLM is installed (``bash scripts/kvb test-vllm``); loading vLLM's
ops is all it needs (no model, no engine).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")
import vllm._custom_ops  # noqa: E402,F401  registers vLLM's compiled ops with torch

from blend.kernels import TOL, sparse_query_attention, sparse_query_attention_ref  # noqa: E402
from blend.kernels import vllm_cpu  # noqa: E402
from blend.kernels.dispatch import KernelBackend, attention_backend  # noqa: E402


def _case(seed: int, dtype: torch.dtype, hkv: int, group: int, t: int, s: int, d: int = 64,
          offset: int = 0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(hkv, t, d, generator=g).to(dtype)  # (Hkv, T, D)
    v = torch.randn(hkv, t, d, generator=g).to(dtype)  # (Hkv, T, D)
    k_pos = torch.arange(offset, offset + t)  # (T,)
    # runs of 1-5 consecutive rows and isolated rows, like a blend's selection, plus a query before
    # every key (sees nothing) and the last row
    picks = torch.randperm(t, generator=g)[: s // 2]
    spans = [torch.arange(p, min(t, p + int(torch.randint(1, 6, (1,), generator=g)))) for p in picks]
    q_rows = torch.unique(torch.cat([*spans, torch.tensor([t - 1])]))[:s]
    q_pos = torch.cat([torch.tensor([offset - 1] if offset > 0 else [], dtype=torch.long), k_pos[q_rows]])  # (S,)
    q = torch.randn(hkv * group, q_pos.shape[0], d, generator=g).to(dtype)  # (Hq, S, D)
    return q, q_pos, k, v, k_pos, d ** -0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 3, 700, 120), (1, 1, 130, 40), (2, 4, 1000, 300), (5, 3, 257, 257)])
def test_matches_the_reference(dtype, shape):
    hkv, group, t, s = shape
    for offset in (0, 9):
        q, q_pos, k, v, k_pos, scale = _case(t + s, dtype, hkv, group, t, s, offset=offset)
        got = vllm_cpu.sparse_query_attention_vllm(q, q_pos, k, v, k_pos, scale)
        want = sparse_query_attention_ref(q, q_pos, k, v, k_pos, scale)
        assert got.shape == want.shape and got.dtype == dtype
        tol = TOL[dtype]
        torch.testing.assert_close(got.float(), want.float(), atol=tol.atol, rtol=tol.rtol)
        if offset:  # the query placed before every key sees nothing: zeros, never NaN
            assert torch.equal(got[:, 0], torch.zeros_like(got[:, 0]))


def test_every_row_active_is_causal_prefill():
    """All rows as queries (a blend at ratio 1.0): one causal request, the reference's answer."""
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(3, 500, 64, generator=g), torch.randn(3, 500, 64, generator=g)  # (Hkv, T, D)
    q = torch.randn(9, 500, 64, generator=g)  # (Hq, T, D)
    pos = torch.arange(500)
    got = vllm_cpu.sparse_query_attention_vllm(q, pos, k, v, pos, 0.125)
    torch.testing.assert_close(got, sparse_query_attention_ref(q, pos, k, v, pos, 0.125),
                               atol=TOL[torch.float32].atol, rtol=TOL[torch.float32].rtol)


def test_auto_picks_vllm_where_its_ops_are_loaded(monkeypatch):
    q, q_pos, k, v, k_pos, scale = _case(1, torch.float32, 3, 3, 400, 60)
    monkeypatch.delenv("KVBLEND_KERNELS", raising=False)
    assert vllm_cpu.ops_registered() and vllm_cpu.usable(torch.float32)
    assert attention_backend(q, q_pos, k_pos) is KernelBackend.VLLM_CPU
    want = vllm_cpu.sparse_query_attention_vllm(q, q_pos, k, v, k_pos, scale)
    assert torch.equal(sparse_query_attention(q, q_pos, k, v, k_pos, scale), want)
    monkeypatch.setenv("KVBLEND_KERNELS", "torch")  # the switch back to torch's kernels
    assert attention_backend(q, q_pos, k_pos) is KernelBackend.TORCH
    monkeypatch.setenv("KVBLEND_KERNELS", "vllm")
    assert attention_backend(q, q_pos, k_pos) is KernelBackend.VLLM_CPU


def test_layouts_it_does_not_cover_go_to_torch(monkeypatch):
    monkeypatch.setenv("KVBLEND_KERNELS", "vllm")
    q, q_pos, k, v, k_pos, scale = _case(2, torch.float32, 3, 3, 300, 40)
    shuffled = q_pos.flip(0)  # unsorted queries: not the blend's layout
    assert attention_backend(q, shuffled, k_pos) is KernelBackend.TORCH
    half = q.to(torch.float16)
    assert attention_backend(half, q_pos, k_pos) is KernelBackend.TORCH
    got = vllm_cpu.sparse_query_attention_vllm(q, shuffled, k, v, k_pos, scale)  # falls back, same contract
    torch.testing.assert_close(got, sparse_query_attention_ref(q, shuffled, k, v, k_pos, scale),
                               atol=TOL[torch.float32].atol, rtol=TOL[torch.float32].rtol)
