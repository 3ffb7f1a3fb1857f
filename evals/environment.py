"""What the results record about the model and the machine they came from."""

from __future__ import annotations

import dataclasses
import os
import platform
import sys
from importlib import metadata
from typing import Any

_PACKAGES = ("kvblend", "torch", "transformers", "numpy", "triton", "safetensors")


def provenance_dict(prov: Any) -> dict[str, Any]:
    """The engine's provenance as a JSON object (a dataclass, a mapping, or its repr)."""
    if dataclasses.is_dataclass(prov) and not isinstance(prov, type):
        return dataclasses.asdict(prov)
    if isinstance(prov, dict):
        return dict(prov)
    return {"repr": repr(prov)}


def package_versions() -> dict[str, str | None]:
    """Installed versions of the packages that shape the results (None: absent)."""
    out: dict[str, str | None] = {"python": sys.version.split()[0]}
    for name in _PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def load_average() -> list[float] | None:
    """The machine's 1, 5 and 15-minute load averages (None where the OS does not report them)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def machine_info() -> dict[str, Any]:
    """Platform, CPU count, threads, load average and accelerator (queried now, at run time, never at import)."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu_count": os.cpu_count(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "accelerator": None,
        # what else ran: the 1, 5 and 15-minute load averages when the results were written (None: unknown)
        "load_average": load_average(),
    }
    try:
        import torch

        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["accelerator"] = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - a broken CUDA setup must not stop the report
        pass
    return info


def describe_environment(engine_device: Any = None) -> dict[str, Any]:
    """``{"versions": ..., "machine": ...}`` for results.json.

    Args:
        engine_device: the device the engine computes on (recorded as text), if it says.
    """
    machine = machine_info()
    machine["engine_device"] = None if engine_device is None else str(engine_device)
    return {"versions": package_versions(), "machine": machine}
