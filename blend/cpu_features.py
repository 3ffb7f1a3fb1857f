"""Whether this CPU computes a reduced-precision dtype natively (a hint, never a gate).

Without native bf16 / fp16 arithmetic (AVX-512 BF16 or AMX for bf16, AVX-512 FP16 or AMX-FP16
for fp16), PyTorch's CPU GEMMs emulate them through fp32 conversions: on an AVX2-only EPYC a
SmolLM2 bf16 full prefill measured 4.7x *slower* than fp32 (BENCHMARKS.md). The engine warns
when asked for such a dtype on such a CPU; it still runs it.
"""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path

import torch

CPUINFO = Path("/proc/cpuinfo")
# /proc/cpuinfo flags that give native arithmetic for a dtype
NATIVE_FLAGS: dict[torch.dtype, frozenset[str]] = {
    torch.bfloat16: frozenset({"avx512_bf16", "amx_bf16"}),
    torch.float16: frozenset({"avx512_fp16", "amx_fp16"}),
}


# /proc/cpuinfo flags that select other GEMM kernels in oneDNN / MKL (other last bits): the vector width and
# the native reduced-precision units; and the variables that cap either library's ISA below the CPU's
KERNEL_FLAGS = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16"})
ISA_CAP_VARS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR",
                # float32 GEMMs in bf16 (oneDNN's implicit down-conversion): other numbers, so part of the key
                "ONEDNN_DEFAULT_FPMATH_MODE", "DNNL_DEFAULT_FPMATH_MODE")


class EmulatedDtypeWarning(UserWarning):
    """A reduced-precision dtype on a CPU that emulates it (slower than float32 there)."""


def cpuinfo_field(name: str, cpuinfo: str | None = None) -> str | None:
    """The value of the first ``name`` line of /proc/cpuinfo text (read from the system when None).

    Args:
        name: the field, e.g. ``flags`` or ``vendor_id``.
        cpuinfo: the file's text, or None to read it.

    Returns:
        The value, stripped; None where there is no such file or line.
    """
    if cpuinfo is None:
        try:
            cpuinfo = CPUINFO.read_text(errors="replace")
        except OSError:
            return None
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == name:
            return value.strip()
    return None


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str] | None:
    """The CPU's feature flags from /proc/cpuinfo text (read from the system when None).

    Args:
        cpuinfo: the file's text, or None to read it.

    Returns:
        The flags of the first ``flags`` line, or None where there is no such file or line.
    """
    flags = cpuinfo_field("flags", cpuinfo)
    return None if flags is None else frozenset(flags.split())


def cpu_vendor(cpuinfo: str | None = None) -> str:
    """The CPU's vendor id (``AuthenticAMD``, ``GenuineIntel``, ...; "" where unknown).

    Args:
        cpuinfo: /proc/cpuinfo's text, or None to read it (other systems give "").

    Returns:
        The first ``vendor_id`` field, or "" where there is none.
    """
    return cpuinfo_field("vendor_id", cpuinfo) or ""


@functools.lru_cache(maxsize=1)
def this_cpu_flags() -> frozenset[str] | None:
    """This machine's CPU flags, read once per process (per-request decisions read them).

    Returns:
        The flags of :func:`cpu_flags`, or None where /proc/cpuinfo does not list them.
    """
    return cpu_flags()


def native_on_cpu(dtype: torch.dtype, flags: frozenset[str] | None) -> bool | None:
    """Whether ``dtype`` arithmetic is native on a CPU with these flags.

    Args:
        dtype: the arithmetic's dtype.
        flags: the CPU's flags (:func:`this_cpu_flags`), or None where unknown.

    Returns:
        True for float32/float64 or a flag that gives it; False where none does; None if the
        flags are unknown.
    """
    need = NATIVE_FLAGS.get(dtype)
    if need is None:
        return True
    if flags is None:
        return None
    return bool(need & flags)


def warn_if_emulated(dtype: torch.dtype, device: torch.device, flags: frozenset[str] | None = None) -> bool:
    """Warn (:class:`EmulatedDtypeWarning`) when ``dtype`` runs emulated on this CPU.

    Args:
        dtype: the engine's compute dtype.
        device: its device; only CPUs are checked.
        flags: CPU flags (default: this machine's).

    Returns:
        Whether it warned.
    """
    if device.type != "cpu" or dtype not in NATIVE_FLAGS:
        return False
    if native_on_cpu(dtype, this_cpu_flags() if flags is None else flags) is not False:
        return False
    names = " or ".join(sorted(NATIVE_FLAGS[dtype]))
    warnings.warn(f"{str(dtype).removeprefix('torch.')} on this CPU is emulated (no {names}): expect it slower "
                  f"than float32 (bf16 measured 4.7x slower on an AVX2 CPU); use --dtype float32 here",
                  EmulatedDtypeWarning, stacklevel=3)
    return True


def cpu_kernel_class(flags: frozenset[str] | None = None) -> str:
    """This CPU as a KV provenance names its device (as a CUDA device's capability does): ATen's kernels
    (norms, softmax, attention) and oneDNN's / MKL's GEMMs dispatch on the vector ISA, and an AVX2 CPU's
    KV differs from an AVX-512 one's in the last bits.

    Args:
        flags: CPU flags (default: this machine's).

    Returns:
        e.g. ``cpu/avx512/amx_bf16+avx2+avx512_bf16+avx512f``: ATen's capability, the kernel-selecting
        flags, and any ISA cap set in the environment.
    """
    flags = this_cpu_flags() if flags is None else flags
    parts = ["cpu", torch.backends.cpu.get_cpu_capability().lower()]
    parts.append("+".join(sorted(KERNEL_FLAGS & flags)) if flags is not None else "flags-unknown")
    parts += [f"{var}={os.environ[var]}" for var in ISA_CAP_VARS if os.environ.get(var)]
    return "/".join(parts)
