"""A bad ``--items`` is argparse's usage error (exit 2, the value named) in every bench that takes one: several
printed ItemRangeError's traceback (bench_cold and bench_phases after loading the model)."""

from __future__ import annotations

import importlib

import pytest

BENCHES = ["bench_bf16", "bench_cold", "bench_phases", "bench_prefill", "bench_vllm"]


@pytest.mark.parametrize("bench", BENCHES)
@pytest.mark.parametrize("bad", ["9-3", "x", "0-2,", "1-2-3"])
def test_a_bad_items_value_is_a_usage_error(bench, bad, capsys, monkeypatch):
    mod = importlib.import_module(f"blend.evals.{bench}")
    monkeypatch.setattr(mod, "Engine", None, raising=False)  # nothing may load before the arguments are checked
    with pytest.raises(SystemExit) as e:
        mod.main(["--items", bad])
    assert e.value.code == 2
    assert "argument --items" in capsys.readouterr().err
