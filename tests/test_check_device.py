"""The prepared device check stays runnable: its engine half passes on the CPU (where the device
engine and the reference engine are the same path) and its shell script parses."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from blend.evals.check_device import main
from blend.kernels import ENV_VAR

ROOT = Path(__file__).resolve().parents[1]


def test_the_device_check_passes_on_the_cpu(tmp_path):
    out = tmp_path / "check.json"
    assert main(["--device", "cpu", "--prompts", "1", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["backend"] == "torch" and len(res["checks"]) == 3 and all(c["ok"] for c in res["checks"])


def test_the_device_script_parses():
    subprocess.run(["bash", "-n", str(ROOT / "scripts" / "device_check.sh")], check=True)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_offsets_check_passes_on_the_cpu(tmp_path, monkeypatch, backend):
    """The large-offset step at a small shape (the GPU runs 128k tokens x 32 layers): it compares each
    kernel on views of a token-major multi-layer buffer with the references, torch path or interpreted."""
    from blend.evals.check_offsets import main as check_offsets

    monkeypatch.setenv(ENV_VAR, backend)
    out = tmp_path / "offsets.json"
    assert check_offsets(["--device", "cpu", "--tokens", "40", "--layers", "3", "--kv-heads", "2",
                          "--head-dim", "16", "--queries", "5", "--group", "2", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["backend"] == backend and len(res["checks"]) == 5 and all(c["ok"] for c in res["checks"])
    assert res["shape"]["tokens"] == 40 and all(c["max_abs_err"] < 1e-2 for c in res["checks"])
