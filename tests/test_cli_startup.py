"""What a command that never touches a model imports: `kvblend --help`, an argument error, a sub-command's
help, `kvblend store ls/stats`. Each ran ~2-4 s on this machine importing torch (the eval harness's metrics,
the store's KV entry type and codec tables), transformers, faiss, redis-py or FastAPI before argparse
printed anything; each now runs in a fresh interpreter without any of them (no timings here: they flake
on a shared machine; the modules loaded are what decides the time)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _store_util import NS, key_for, make_prov, rand_entry

from blend.store.disk import DiskStore

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "transformers", "faiss", "redis", "numpy", "fastapi", "uvicorn", "triton", "matplotlib",
         "blend.engine")
RUN = ("import json, sys, blend.cli\n"
       "try:\n"
       "    rc = blend.cli.main(sys.argv[1:])\n"
       "except SystemExit as e:\n"
       "    rc = e.code\n"
       f"print(json.dumps([rc, sorted(m for m in {HEAVY!r} if m in sys.modules)]), file=sys.stderr)\n")


def run_fresh(argv: list[str], home: Path) -> tuple[int, list[str], str]:
    """``kvblend ARGV`` in a fresh interpreter.

    Returns:
        Its exit status, the heavy modules it had imported by then, and its standard output.
    """
    env = {**os.environ, "KVBLEND_HOME": str(home)}
    env.pop("KVBLEND_STORE", None)
    out = subprocess.run([sys.executable, "-c", RUN, *argv], capture_output=True, text=True, cwd=ROOT, env=env,
                         stdin=subprocess.DEVNULL, timeout=300)
    rc, loaded = json.loads(out.stderr.strip().splitlines()[-1])
    return rc, loaded, out.stdout


@pytest.mark.parametrize("argv, status", [
    (["--help"], 0),
    (["nosuch"], 2),  # an unknown command registers every area's parser to say so
    (["ask"], 2),  # the question is missing
    (["ask", "q", "--doc", "x", "--ratio", "abc"], 2),
    (["chat", "--help"], 0),
    (["eval", "--help"], 0),
    (["ingest", "--help"], 0),
    (["demo", "--top-k"], 2),
    (["store", "ls", "--bogus"], 2),
    (["serve", "--help"], 0),
    (["serve", "--port", "x"], 2),
])
def test_help_and_argument_errors_import_no_model_stack(argv, status, tmp_path):
    rc, loaded, _ = run_fresh(argv, tmp_path)
    assert rc == status
    assert loaded == []


def test_a_bad_sampling_setting_is_refused_without_the_model_stack(tmp_path):
    """The sampling settings check themselves (blend.generation_config) before anything loads."""
    doc = tmp_path / "doc.txt"
    doc.write_text("The bakery opens at six.")
    for argv in (["ask", "q", "--doc", str(doc), "--temperature", "9"], ["chat", "--doc", str(doc), "--top-p", "3"]):
        rc, loaded, _ = run_fresh(argv, tmp_path)
        assert (rc, loaded) == (2, [])


def test_store_ls_and_stats_read_headers_without_torch(tmp_path):
    prov = make_prov()
    DiskStore(tmp_path / "store").put(NS, key_for(prov, 0), rand_entry(prov, T=5))  # written here, with torch
    rc, loaded, out = run_fresh(["store", "ls", "--store", f"disk:{tmp_path / 'store'}"], tmp_path)
    assert (rc, loaded) == (0, [])
    assert "L=2 Hkv=3 T=5 D=8 float32" in out and out.rstrip().endswith("1 entries")
    rc, loaded, out = run_fresh(["store", "stats", "--json", "--store", f"disk:{tmp_path / 'store'}"], tmp_path)
    assert (rc, loaded) == (0, [])
    assert json.loads(out)["disk"]["entries"] == 1
