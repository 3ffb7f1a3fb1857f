"""serve_plot: bench_serve runs become series (speed-up over one client) and a PNG."""

import json

import pytest

from blend.evals.serve_plot import load_series, main


def write_run(d, rows):
    d.mkdir()
    (d / "bench_serve.json").write_text(json.dumps({"rows": rows}))


def row(mode, clients, tok, ttft):
    return {"mode": mode, "clients": clients, "out_tok_per_s": tok, "ttft_p50_ms": ttft}


def test_series_by_mode_with_speedup_over_one_client(tmp_path):
    write_run(tmp_path / "a", [row("exact", 16, 50.0, 300), row("exact", 1, 10.0, 200), row("blend@0.15", 4, 9.0, 900)])
    by = {s.mode: s for s in load_series("on", tmp_path / "a")}
    assert by["exact"].clients == [1, 16] and by["exact"].speedup == [1.0, 5.0]
    assert by["blend@0.15"].speedup == []  # no single-client row to compare with


def test_main_writes_a_png_and_rejects_a_bad_run_spec(tmp_path):
    write_run(tmp_path / "a", [row("exact", 1, 10.0, 200), row("exact", 16, 45.0, 400)])
    write_run(tmp_path / "b", [row("exact", 1, 11.0, 210), row("exact", 16, 40.0, 380)])
    out = tmp_path / "serve.png"
    assert main(["--run", f"on={tmp_path / 'a'}", "--run", f"off={tmp_path / 'b'}", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit):
        main(["--run", str(tmp_path / "a"), "--out", str(out)])
