"""Whether this CPU computes a reduced-precision dtype natively (a hint, never a gate).

Without native bf16 / fp16 arithmetic (AVX-512 BF16 or AMX for bf16, AVX-512 FP16 or AMX-FP16
for fp16), PyTorch's CPU GEMMs emulate them through fp32 conversions: on an AVX2-only EPYC a
SmolLM2 bf16 full prefill measured 4.7x *slower* than fp32 (BENCHMARKS.md). The engine warns
when asked for such a dtype on such a CPU; it still runs it.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import torch

CPUINFO = Path("/proc/cpuinfo")
# /proc/cpuinfo flags that give native arithmetic for a dtype
NATIVE_FLAGS: dict[torch.dtype, frozenset[str]] = {
    torch.bfloat16: frozenset({"avx512_bf16", "amx_bf16"}),
    torch.float16: frozenset({"avx512_fp16", "amx_fp16"}),
}


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
    """
    return cpuinfo_field("vendor_id", cpuinfo) or ""


@functools.lru_cache(maxsize=1)
def this_cpu_flags() -> frozenset[str] | None:
    """This machine's CPU flags, read once per process (per-request decisions read them)."""
    return cpu_flags()


def native_on_cpu(dtype: torch.dtype, flags: frozenset[str] | None) -> bool | None:
    """Whether ``dtype`` arithmetic is native on a CPU with these flags.

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
