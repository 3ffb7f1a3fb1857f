"""The Triton kernels compile for a real GPU (sm_90, H100/H200) down to cubin, without a GPU.

The interpreter runs the kernels' semantics but not Triton's compiler, so a
kernel can pass every interpreted test and still fail to compile (an
unsupported construct, a dtype mix in tl.dot, a shape rule). This compiles
each kernel ahead of time for CUDA targets, in a subprocess without
TRITON_INTERPRET, with the constexpr configurations the launchers use, and with integer
arguments specialised as launches specialise them (unit strides constexpr, strides past 2**31 i64).
"""

import os
import subprocess
import sys

import pytest

_SCRIPT = r'''
import sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from blend.kernels import attention_kernel as A, deviation_kernel as D, rope_mix_kernel as R

arch = int(sys.argv[1])
target = GPUTarget("cuda", arch, 32)
failures = []

def compile_one(name, fn, sig, consts, warps=4):
    try:
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=target,
                           options={"num_warps": warps})
        assert "cubin" in k.asm, "no cubin"
        print("OK", name)
    except Exception as e:  # report every failure, not only the first
        failures.append(name)
        print("FAIL", name, type(e).__name__, str(e)[:2000])

def signature(fn, ptrs, floats=(), consts=(), wide=()):
    return {n: ptrs.get(n, "i32") if n.endswith("_ptr") else "fp32" if n in floats
            else "constexpr" if n in consts else "i64" if n in wide else "i32" for n in fn.arg_names}

# attention in every dtype (fp32 takes the ieee-dot branch), padded head dim once; one dtype each for the others
for dt, block_d in (("fp32", 64), ("fp16", 64), ("bf16", 128)):
    ptrs = dict(q_ptr="*" + dt, k_ptr="*" + dt, v_ptr="*" + dt, o_ptr="*" + dt, qpos_ptr="*i64", kpos_ptr="*i64")
    consts = dict(BLOCK_M=64, BLOCK_N=64 if block_d == 64 else 32, BLOCK_D=block_d, DOT_FP32=dt == "fp32",
                  POS_PAD=2**62)
    compile_one(f"attention/{dt}/D{block_d}", A._sparse_attn_kernel,
                signature(A._sparse_attn_kernel, ptrs, floats=("qk_scale",), consts=consts), consts)
# as launched, integer arguments are specialised: a stride of 1 arrives as constexpr 1, one past 2**31 as
# i64; the kernels' 64-bit base offsets (program ids and loop counters cast to int64) must mix with both
ptrs = dict(q_ptr="*fp16", k_ptr="*fp16", v_ptr="*fp16", o_ptr="*fp16", qpos_ptr="*i64", kpos_ptr="*i64")
consts = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_D=64, DOT_FP32=False, POS_PAD=2**62, s_q_d=1, s_k_t=1, s_v_d=1)
compile_one("attention/fp16/unit and i64 strides", A._sparse_attn_kernel,
            signature(A._sparse_attn_kernel, ptrs, floats=("qk_scale",), consts=consts,
                      wide=("s_k_h", "s_k_d", "s_v_h", "s_v_t", "s_q_s")), consts)
ptrs = {n: "*fp16" for n in R._rope_mix_kernel.arg_names if n.endswith("_ptr")}
ptrs.update(cos_ptr="*fp32", sin_ptr="*fp32", src_ptr="*i64")
consts = dict(BLOCK_T=16, BLOCK_HALF=64, BLOCK_PASS=1, BLOCK_D=128, HAS_PASS=False, s_ck_d=1, s_cv_d=1, s_fk_d=1,
              s_fv_d=1, s_cos_r=1, s_sin_r=1)
compile_one("rope_mix/fp16/unit and i64 strides", R._rope_mix_kernel,
            signature(R._rope_mix_kernel, ptrs, consts=consts, wide=("s_ck_t", "s_cv_t", "s_o_t", "s_o_h")), consts)
ptrs = dict(f_ptr="*fp16", c_ptr="*fp16", out_ptr="*fp32")
consts = dict(BLOCK_S=32, BLOCK_D=128, s_f_d=1, s_c_d=1)
compile_one("kv_deviation/fp16/unit and i64 strides", D._kv_deviation_kernel,
            signature(D._kv_deviation_kernel, ptrs, consts=consts, wide=("s_f_h", "s_c_s")), consts)

ptrs = {n: "*bf16" for n in R._rope_mix_kernel.arg_names if n.endswith("_ptr")}
ptrs.update(cos_ptr="*fp32", sin_ptr="*fp32", src_ptr="*i64")
consts = dict(BLOCK_T=16, BLOCK_HALF=16, BLOCK_PASS=64, BLOCK_D=128, HAS_PASS=True)
compile_one("rope_mix/bf16", R._rope_mix_kernel, signature(R._rope_mix_kernel, ptrs, consts=consts), consts)
ptrs = dict(f_ptr="*bf16", c_ptr="*fp16", out_ptr="*fp32")
consts = dict(BLOCK_S=32, BLOCK_D=64)
compile_one("kv_deviation/bf16-fp16", D._kv_deviation_kernel,
            signature(D._kv_deviation_kernel, ptrs, consts=consts), consts)
sys.exit(1 if failures else 0)
'''


def _nvidia_backend_present() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.skipif(not _nvidia_backend_present(), reason="Triton's NVIDIA backend is not installed")
def test_kernels_compile_for_cuda_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # really compile, never reuse a cached binary
    res = subprocess.run([sys.executable, "-c", _SCRIPT, "90"], capture_output=True, text=True,
                         env=env, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("OK ") == 8, res.stdout
