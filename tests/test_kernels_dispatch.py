"""Dispatch policy (KVBLEND_KERNELS), lazy Triton import, and the TOL table."""

import dataclasses
import os
import subprocess
import sys
import types

import pytest
import torch

import blend.kernels as K
from blend.kernels import ENV_VAR, TOL, KernelBackend, kernel_backend

_CPU = torch.zeros(1)
_FAKE_CUDA = types.SimpleNamespace(is_cuda=True)  # kernel_backend only looks at the device


def _run(code: str, **env) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **env}
    full_env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=120)


def test_import_does_not_import_triton():
    code = (
        "import sys, torch\n"
        "import blend.kernels as K\n"
        "assert 'triton' not in sys.modules, 'import'\n"
        "x = torch.randn(2, 5, 8)\n"
        "K.kv_deviation(x, x)\n"
        "K.sparse_query_attention(x, torch.arange(5), x, x, torch.arange(5), 0.3)\n"
        "K.rope_mix(x, x, torch.ones(5, 8), torch.zeros(5, 8), torch.tensor([1]), x[:, :1], x[:, :1])\n"
        "assert 'triton' not in sys.modules, 'cpu calls'\n"
        "print('ok')\n"
    )
    res = _run(code, **{ENV_VAR: "auto"})
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"


def test_package_works_without_triton_installed():
    code = (
        "import sys, torch\n"
        "sys.modules['triton'] = None  # import triton now raises ImportError\n"
        "import blend.kernels as K\n"
        "x = torch.randn(2, 5, 8)\n"
        "out = K.sparse_query_attention(x, torch.arange(5), x, x, torch.arange(5), 0.3)\n"
        "assert out.shape == (2, 5, 8)\n"
        "assert K.kernel_backend(x) is K.KernelBackend.TORCH\n"
        "print('ok')\n"
    )
    res = _run(code, **{ENV_VAR: "auto"})
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"
    forced = _run(code.replace("print('ok')", "import os; os.environ['KVBLEND_KERNELS'] = 'triton'\nK.kernel_backend(x)"))
    assert forced.returncode != 0 and "Triton is not installed" in forced.stderr


@pytest.mark.parametrize("value,cpu,cuda", [
    (None, KernelBackend.TORCH, KernelBackend.TRITON),
    ("auto", KernelBackend.TORCH, KernelBackend.TRITON),
    ("torch", KernelBackend.TORCH, KernelBackend.TORCH),
    ("TRITON", KernelBackend.TRITON, KernelBackend.TRITON),
    (" triton ", KernelBackend.TRITON, KernelBackend.TRITON),
])
def test_kernel_backend_policy(monkeypatch, value, cpu, cuda):
    if value is None:
        monkeypatch.delenv(ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(ENV_VAR, value)
    assert kernel_backend(_CPU) is cpu
    assert kernel_backend(_FAKE_CUDA) is cuda


def test_kernel_backend_rejects_unknown_value(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "cuda")
    with pytest.raises(ValueError, match="auto|torch|triton"):
        kernel_backend(_CPU)


def test_vllm_attention_only_where_vllm_is_loaded(monkeypatch):
    """Without vLLM's ops in the process, auto keeps torch's attention; policy vllm says why it cannot."""
    from blend.kernels import vllm_cpu
    from blend.kernels.dispatch import attention_backend

    q, pos = torch.randn(9, 8, 64), torch.arange(8)
    assert not vllm_cpu.ops_registered() and not vllm_cpu.usable(torch.float32)
    monkeypatch.setenv(ENV_VAR, "auto")
    assert attention_backend(q, pos, pos) is KernelBackend.TORCH
    monkeypatch.setenv(ENV_VAR, "vllm")
    with pytest.raises(RuntimeError, match="vLLM's CPU attention ops are not loaded"):
        attention_backend(q, pos, pos)
    assert not vllm_cpu.covers(q.half(), pos, pos) and not vllm_cpu.covers(q, pos.flip(0), pos)
    assert not vllm_cpu.covers(torch.randn(9, 8, 40), pos, pos)  # head size vLLM's vector kernel lacks


def _spy(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)

    def wrapped(*args):
        calls.append(name)
        return real(*args)

    monkeypatch.setattr(module, name, wrapped)
    return calls


@pytest.mark.parametrize("policy,expect_triton", [("triton", True), ("torch", False), ("auto", False)])
def test_public_functions_route_by_policy(monkeypatch, policy, expect_triton):
    from blend.kernels import attention_kernel, deviation_kernel, rope_mix_kernel

    calls = _spy(monkeypatch, attention_kernel, "sparse_query_attention_triton")
    dev_calls = _spy(monkeypatch, deviation_kernel, "kv_deviation_triton")
    mix_calls = _spy(monkeypatch, rope_mix_kernel, "rope_mix_triton")
    monkeypatch.setenv(ENV_VAR, policy)
    x = torch.randn(1, 17, 16)
    K.sparse_query_attention(x, torch.arange(17), x, x, torch.arange(17), 0.25)
    K.kv_deviation(x, x)
    K.rope_mix(x, x, torch.ones(17, 16), torch.zeros(17, 16), torch.tensor([3]), x[:, :1], x[:, :1])
    triton_calls = len(calls) + len(dev_calls) + len(mix_calls)
    assert triton_calls == (3 if expect_triton else 0)


@pytest.mark.parametrize("interpret", [None, "false"])
def test_triton_launchers_refuse_cpu_tensors_for_compiled_kernels(interpret):
    """Kernels compiled for a GPU (TRITON_INTERPRET unset, or a value Triton reads as off, which the
    launchers once read as on and handed CPU tensors to: "RuntimeError: 0 active drivers") refuse
    CPU tensors with an error that names the variable."""
    code = (
        "import torch\n"
        "import blend.kernels as K\n"
        "x = torch.randn(1, 4, 16)\n"
        "calls = [lambda: K.sparse_query_attention(x, torch.arange(4), x, x, torch.arange(4), 0.25),\n"
        "         lambda: K.kv_deviation(x, x),\n"
        "         lambda: K.rope_mix(x, x, torch.ones(4, 16), torch.zeros(4, 16), torch.tensor([1]), x[:, :1], x[:, :1])]\n"
        "for call in calls:\n"
        "    try:\n"
        "        call()\n"
        "    except ValueError as e:\n"
        "        assert 'TRITON_INTERPRET' in str(e) and 'cpu' in str(e), e\n"
        "    else:\n"
        "        raise AssertionError('ran a compiled kernel on CPU tensors')\n"
        "print('ok')\n"
    )
    env = {ENV_VAR: "triton"} if interpret is None else {ENV_VAR: "triton", "TRITON_INTERPRET": interpret}
    full_env = {**os.environ, **env}
    if interpret is None:
        full_env.pop("TRITON_INTERPRET", None)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == "ok"


def test_triton_launcher_refuses_cpu_without_interpreter(monkeypatch):
    from blend.kernels.attention_kernel import sparse_query_attention_triton

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = torch.randn(1, 4, 16)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        sparse_query_attention_triton(x, torch.arange(4), x, x, torch.arange(4), 0.25)


def test_tol_table_covers_kernel_dtypes_and_is_frozen():
    assert set(TOL) == {torch.float32, torch.float16, torch.bfloat16}
    assert TOL[torch.float32].atol < TOL[torch.float16].atol < TOL[torch.bfloat16].atol
    with pytest.raises(dataclasses.FrozenInstanceError):
        TOL[torch.float32].atol = 1.0


def test_a_bad_kernel_policy_names_the_variable_and_the_choices(monkeypatch):
    from blend.kernels.dispatch import BackendPolicy, backend_policy

    monkeypatch.setenv(ENV_VAR, " Torch ")
    assert backend_policy() is BackendPolicy.TORCH  # case and spaces ignored
    monkeypatch.setenv(ENV_VAR, "")
    assert backend_policy() is BackendPolicy.AUTO
    monkeypatch.setenv(ENV_VAR, "cuda")
    with pytest.raises(ValueError, match=r"KVBLEND_KERNELS='cuda' is not one of auto\|torch\|triton\|vllm"):
        backend_policy()


def test_a_launch_runs_on_its_tensors_gpu_not_the_current_one():
    """Triton launches on the current CUDA device: a launch for tensors on cuda:1 must make cuda:1
    current (an engine on a second GPU otherwise runs its kernels on the first); CPU launches change
    nothing."""
    import contextlib

    from blend.kernels.launch import on_device

    assert isinstance(on_device(_CPU), contextlib.nullcontext)
    ctx = on_device(types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 1)))
    assert isinstance(ctx, torch.cuda.device) and ctx.idx == 1
