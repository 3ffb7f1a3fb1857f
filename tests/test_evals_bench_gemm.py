"""bench_gemm compares F.linear against oneDNN's packed linear, and says so only when it ran oneDNN."""

from __future__ import annotations

import json

import pytest
import torch

from blend.evals import bench_gemm
from blend.gemm import onednn_available


@pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN linear")
def test_bench_gemm_records_its_setting_and_refuses_a_weight_that_is_not_packed(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_gemm, "ROWS", (1, 16))
    out = tmp_path / "gemm.json"
    threads = torch.get_num_threads()
    try:
        assert bench_gemm.main(["--threads", "1", "--repeats", "1", "--json", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    res = json.loads(out.read_text())
    assert res["threads"] == 1 and res["dtype"] == "float32" and len(res["environment"]["machine"]["load_average"]) == 3
    # a pack that left the weight plain: the "oneDNN" column would have timed F.linear a second time
    monkeypatch.setattr(bench_gemm, "pack", lambda w, backend: w)
    assert bench_gemm.main(["--repeats", "1"]) == 1
