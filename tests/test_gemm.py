"""The linear layers' backend (blend/gemm.py): oneDNN over packed weights by default on a float32 CPU
engine, torch's F.linear elsewhere; the same GEMM to float rounding, and part of the KV's provenance."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from blend.errors import InvalidRequestError
from blend.gemm import GemmBackend, dense, linear, onednn_available, pack, packs_natively, pick_gemm_backend
from blend.policy import ReusePolicy
from blend.report import ReuseClass
from blend.store.memory import MemoryStore
from conftest import make_docs, unguarded_blend

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN linear")


NO_BF16 = frozenset({"avx2", "avx512f"})  # CPU flags without native bf16
AMX = frozenset({"avx512f", "amx_bf16", "amx_tile"})


def test_auto_picks_onednn_for_float32_cpu_engines_and_bfloat16_where_bf16_is_native():
    want = GemmBackend.ONEDNN if onednn_available() else GemmBackend.TORCH
    assert pick_gemm_backend("auto", CPU, torch.float32) is want
    assert pick_gemm_backend("auto", CPU, torch.float32, NO_BF16) is want
    assert pick_gemm_backend("auto", CPU, torch.bfloat16, NO_BF16) is GemmBackend.TORCH
    assert pick_gemm_backend("auto", CPU, torch.bfloat16, AMX) is want
    assert pick_gemm_backend("auto", CPU, torch.float16, AMX | {"avx512_fp16"}) is GemmBackend.TORCH
    assert pick_gemm_backend("auto", torch.device("cuda"), torch.float32) is GemmBackend.TORCH
    assert pick_gemm_backend("auto", torch.device("cuda"), torch.bfloat16, AMX) is GemmBackend.TORCH
    assert pick_gemm_backend("torch", CPU, torch.float32) is GemmBackend.TORCH
    assert pick_gemm_backend("torch", CPU, torch.bfloat16, AMX) is GemmBackend.TORCH
    for dtype, flags in ((torch.bfloat16, NO_BF16), (torch.float16, AMX | {"avx512_fp16"})):
        with pytest.raises(ValueError, match="onednn"):
            pick_gemm_backend("onednn", CPU, dtype, flags)
    with pytest.raises(ValueError, match="unknown"):
        pick_gemm_backend("mkl", CPU, torch.float32)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 5, 16, 33, 470])
def test_a_packed_weight_gives_the_same_gemm_to_float_rounding(rows):
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    x = torch.randn(rows, 64, generator=g)
    p = pack(w, GemmBackend.ONEDNN)
    assert p.is_mkldnn and torch.equal(dense(p), w) and dense(w) is w
    ref = F.linear(x.double(), w.double(), b.double())
    for out in (linear(x, p, b), linear(x, w, b), linear(x.t().contiguous().t(), p, b)):  # plain, packed, strided
        assert out.shape == (rows, 96) and out.dtype == torch.float32
        torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-4)
    # each row's numbers do not depend on the rows beside it at a fixed row count (batch-invariant tiles)
    x2 = x.clone()
    x2[1:] = torch.randn(rows - 1, 64, generator=g) if rows > 1 else x2[1:]
    assert torch.equal(linear(x, p, b)[0], linear(x2, p, b)[0])


@needs_onednn
def test_the_backend_is_part_of_the_provenance_so_entries_never_cross(tiny_engine_factory):
    store = MemoryStore()
    a = tiny_engine_factory(store=store, gemm="torch")
    b = a.with_store(store)
    c = tiny_engine_factory(store=store, gemm="onednn")
    assert a.runner.gemm is GemmBackend.TORCH and c.runner.gemm is GemmBackend.ONEDNN
    assert a.provenance.backend != c.provenance.backend and "/torch-linear/" in a.provenance.backend
    prompt = a.build_prompt("Which?", make_docs(3))
    cold = a.generate(prompt, ReusePolicy.exact(), max_new_tokens=2)
    warm = b.generate(prompt, ReusePolicy.exact(), max_new_tokens=2)
    assert torch.equal(cold.first_logits, warm.first_logits)
    other = c.generate(prompt, ReusePolicy.exact(), max_new_tokens=2)  # the torch engine's entries: misses
    assert all(s.reuse_class is ReuseClass.COMPUTED for s in other.report.segments)
    again = c.generate(prompt, ReusePolicy.exact(), max_new_tokens=2)  # its own: cold == warm bit for bit
    assert torch.equal(again.first_logits, other.first_logits)
    assert (other.first_logits - cold.first_logits).abs().max() < 1e-3  # the same model to float rounding


def test_an_impossible_backend_is_a_clear_error(tiny_engine_factory):
    with pytest.raises(InvalidRequestError, match="onednn"):
        tiny_engine_factory(dtype="float16", gemm="onednn")


needs_native_bf16 = pytest.mark.skipif(not packs_natively(torch.bfloat16),
                                       reason="no native bf16 on this CPU: bf16 matrices stay plain")


@needs_native_bf16
def test_packed_bf16_matrices_run_oneDNNs_bf16_kernel_as_f_linear_does():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 64, generator=g).bfloat16()
    p = pack(w, GemmBackend.ONEDNN)
    for rows in (1, 25, 200):
        x = torch.randn(rows, 64, generator=g).bfloat16()
        out = linear(x, p)
        assert out.dtype == torch.bfloat16
        # the same kernel at these shapes; oneDNN may pick another at others, so the contract is bf16 rounding
        torch.testing.assert_close(out.float(), F.linear(x, w).float(), rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(out.float(), F.linear(x.float(), w.float()), rtol=2e-2, atol=2e-2)


@needs_native_bf16
def test_a_bf16_engine_packs_where_bf16_is_native_and_keeps_its_invariants(tiny_engine_factory):
    store = MemoryStore()
    eng = tiny_engine_factory(dtype="bfloat16", store=store)
    plain = tiny_engine_factory(dtype="bfloat16", store=store, gemm="torch")
    assert eng.runner.gemm is GemmBackend.ONEDNN and plain.runner.gemm is GemmBackend.TORCH
    assert all(w.w_qkv.is_mkldnn and w.w_down.is_mkldnn for w in eng.runner.layers) and eng.runner.lm_head.is_mkldnn
    assert eng.runner.layers_in(torch.bfloat16) is eng.runner.layers  # the probe runs on the engine's own
    prompt = eng.build_prompt("Which?", make_docs(3))
    full = eng.generate(prompt, ReusePolicy.none(), max_new_tokens=4)
    cold = eng.generate(prompt, ReusePolicy.exact(), max_new_tokens=4)
    warm = eng.with_store(store).generate(prompt, ReusePolicy.exact(), max_new_tokens=4)
    assert all(s.reuse_class is ReuseClass.EXACT for s in warm.report.segments[:-1])
    assert torch.equal(full.first_logits, cold.first_logits) and torch.equal(cold.first_logits, warm.first_logits)
    assert warm.token_ids == cold.token_ids == full.token_ids  # decode steps on the packed weights too
    shuffled = eng.build_prompt("Which?", make_docs(3)[::-1])
    eng.generate(shuffled, ReusePolicy.exact(), max_new_tokens=1)  # stores this order's chunks
    one = eng.generate(shuffled, unguarded_blend(ratio=1.0, take_exact=True), max_new_tokens=1)
    assert torch.equal(one.first_logits, eng.generate(shuffled, ReusePolicy.none(), max_new_tokens=1).first_logits)
    other = plain.generate(prompt, ReusePolicy.exact(), max_new_tokens=1)  # the packed engine's entries: misses
    assert all(s.reuse_class is ReuseClass.COMPUTED for s in other.report.segments)
    assert (other.first_logits - full.first_logits).abs().max() < 0.05  # the same model to bf16 rounding
