"""The prepared device check stays runnable: its engine half passes on the CPU (where the device
engine and the reference engine are the same path) and its shell script parses."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from blend.evals.check_device import main

ROOT = Path(__file__).resolve().parents[1]


def test_the_device_check_passes_on_the_cpu(tmp_path):
    out = tmp_path / "check.json"
    assert main(["--device", "cpu", "--prompts", "1", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["backend"] == "torch" and len(res["checks"]) == 3 and all(c["ok"] for c in res["checks"])


def test_the_device_script_parses():
    subprocess.run(["bash", "-n", str(ROOT / "scripts" / "device_check.sh")], check=True)
