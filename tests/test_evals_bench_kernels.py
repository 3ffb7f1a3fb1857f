"""bench_kernels labels each dispatched row with the implementation that ran, and reports a fallback."""

from __future__ import annotations

import torch

from blend.evals import bench_kernels as B
from blend.kernels.dispatch import KernelBackend


def _dispatched(rows: list[B.Timing]) -> dict[str, str]:
    return {r.kernel: r.impl for r in rows if r.impl.startswith("dispatch")}


def test_a_dispatched_row_says_which_implementation_it_timed(monkeypatch):
    """The label was fixed by device alone ("dispatch(torch)" on CPU, "triton" on CUDA), whatever the
    dispatcher ran: under KVBLEND_KERNELS=triton the CPU rows timed the interpreted Triton kernels and
    called them torch; on a GPU machine without Triton torch would have been called Triton."""
    cpu = torch.device("cpu")
    monkeypatch.delenv("KVBLEND_KERNELS", raising=False)
    plain = _dispatched(B.timing_rows(32, 0.15, torch.float32, cpu, 1, full_prefill=False))
    assert plain == {k: "dispatch: torch" for k in ("rope_mix", "kv_deviation", "sparse_query_attention")}
    monkeypatch.setenv("KVBLEND_KERNELS", "triton")  # (the interpreter: conftest sets TRITON_INTERPRET=1)
    forced = _dispatched(B.timing_rows(32, 0.15, torch.float32, cpu, 1, full_prefill=False))
    assert forced == {k: "dispatch: triton" for k in ("rope_mix", "kv_deviation", "sparse_query_attention")}


def test_a_kernel_that_does_not_run_the_claimed_implementation_is_a_fallback(monkeypatch):
    monkeypatch.delenv("KVBLEND_KERNELS", raising=False)
    p = B.make_problem(32, 0.15, torch.float32, torch.device("cpu"))
    ran = B.dispatched_backends(p)
    assert B.fallbacks(ran, torch.device("cpu"), vllm=False) == []
    # --vllm without vLLM's ops registered: the attention rows time torch's blocked path
    assert B.fallbacks(ran, torch.device("cpu"), vllm=True) == [
        "sparse_query_attention: dispatched to torch, not vllm-cpu"]
    # a GPU run whose dispatcher picked torch (no Triton installed, or KVBLEND_KERNELS=torch)
    on_gpu = {k: KernelBackend.TORCH for k in ran}
    assert len(B.fallbacks(on_gpu, torch.device("cuda"), vllm=False)) == 3
    assert B.fallbacks({k: KernelBackend.TRITON for k in ran}, torch.device("cuda"), vllm=False) == []
