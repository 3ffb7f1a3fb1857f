"""The first-token sweep's cached reference (evals/sweep.py)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict

import torch

from blend.evals import sweep
from blend.evals.sweep import SweepRow, first_of_budget, main, read_rows, reference_logits, split_of, summarise
from blend.policy import ReusePolicy
from tests.conftest import make_docs


def test_the_reference_is_computed_once_and_a_corrupt_file_is_recomputed(tiny_engine, tmp_path):
    prompt = tiny_engine.build_prompt("Which one?", make_docs(3))
    first = reference_logits(tiny_engine, prompt, tmp_path)
    files = list(tmp_path.glob("*.pt"))
    assert len(files) == 1
    want, _, _ = tiny_engine.prefill(prompt, ReusePolicy.one_pass())
    assert torch.equal(first, want)
    assert torch.equal(reference_logits(tiny_engine, prompt, tmp_path), first)  # read back
    files[0].write_bytes(b"not a tensor")
    assert torch.equal(reference_logits(tiny_engine, prompt, tmp_path), first)  # recomputed, rewritten
    other = tiny_engine.build_prompt("Which two?", make_docs(3))
    reference_logits(tiny_engine, other, tmp_path)
    assert len(list(tmp_path.glob("*.pt"))) == 2  # another prompt, another key


def _saved(t) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def test_a_cached_reference_of_another_shape_dtype_or_non_finite_is_recomputed(tiny_engine, tmp_path):
    """Any tensor of one dimension was taken: a file of 5 logits (or NaN ones) under the key made every KL of
    the item wrong (or NaN); a FIFO there was waited on for ever."""
    import os

    prompt = tiny_engine.build_prompt("Which one?", make_docs(3))
    first = reference_logits(tiny_engine, prompt, tmp_path)
    [path] = tmp_path.glob("*.pt")
    nan = first.clone()
    nan[3] = float("nan")
    for bad in (_saved(torch.zeros(5)), _saved(torch.zeros(first.shape, dtype=torch.int64)), _saved(nan),
                _saved({"logits": first}), b"\x00" * (first.numel() * 8 + (1 << 17))):
        path.write_bytes(bad)
        assert torch.equal(reference_logits(tiny_engine, prompt, tmp_path), first)
        assert torch.equal(torch.load(path, weights_only=True)["logits"], first)  # rewritten
    path.unlink()
    os.mkfifo(path)
    assert torch.equal(reference_logits(tiny_engine, prompt, tmp_path), first)  # not waited on; replaced
    assert path.is_file()


def test_the_summary_splits_items_and_counts_wins():
    a, b = "blend@0.15:probe", "blend@0.15:v"
    rows = [SweepRow(i, m, kl, 1.0, 10.0, 0.15, 100) for i in (0, 1, 30)
            for m, kl in ((a, 0.2), (b, 0.1 if i else 0.3))]
    text = summarise(rows, [a, b])
    assert split_of(0) == "tuning" and split_of(30) == "validation" and split_of(120) == "other"
    assert "### tuning: 2 items (0-1)" in text and "### validation: 1 items (30-30)" in text
    tuning = text.split("### validation")[0]
    assert f"| {b} | 0.2000 |" in tuning and "| 1/2 |" in tuning


def test_each_method_is_compared_with_the_first_of_its_own_budget(tmp_path):
    kls = {"blend@0.05:probe": 0.5, "blend@0.05:v": 0.4, "blend@0.3:probe": 0.1, "blend@0.3:v": 0.2}
    rows = [SweepRow(i, m, kl, 1.0, 10.0, 0.1, 100) for i in (30, 31) for m, kl in kls.items()]
    methods = list(kls)
    assert first_of_budget("blend@0.3:v", methods) == "blend@0.3:probe"
    text = summarise(rows, methods)
    assert "| blend@0.05:v | 0.4000 |" in text
    line = {ln.split(" | ")[0][2:]: ln for ln in text.splitlines() if ln.startswith("| blend@")}
    assert line["blend@0.05:v"].endswith("| 2/2 |")  # beats p at 0.05
    assert line["blend@0.3:v"].endswith("| 0/2 |")  # not p at 0.3 (never 0.05's p)
    # rows written by two runs (e.g. one item range per core) summarise as one
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(asdict(r)) for r in rows[:4]) + "\n")
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(asdict(r)) for r in rows[4:]) + "\n")
    merged = read_rows([tmp_path / "a.jsonl", tmp_path / "b.jsonl"])
    assert merged == rows
    assert main(["--methods", ",".join(methods), "--from-rows", f"{tmp_path / 'a.jsonl'},{tmp_path / 'b.jsonl'}",
                 "--out", str(tmp_path / "s"), "--plot"]) == 0
    assert "### validation: 2 items (30-31)" in (tmp_path / "s" / "summary.md").read_text()
    assert (tmp_path / "s" / "budget.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert first_of_budget("reuse", ["blend@0.3:probe", "reuse"]) == "reuse"  # another kind, its own group


def test_the_summary_gives_ttft_ratios_when_full_prefill_was_timed():
    rows = [SweepRow(i, "blend@0.15:probe", 0.1, 1.0, ms, 0.15, 100, full_ms=1000.0) for i, ms in ((0, 200.0), (1, 300.0), (2, 1300.0))]
    text = summarise(rows, ["blend@0.15:probe"])
    assert "TTFT ratio median | mean | p90 |" in text
    assert "| 0.300 | 0.600 | 1.100 |" in text  # median, mean, p90 (linear, as the KL p90) of 0.2, 0.3, 1.3
    assert "TTFT ratio" not in summarise([SweepRow(0, "blend@0.15:probe", 0.1, 1.0, 5.0, 0.15, 100)], ["blend@0.15:probe"])


def test_a_blend_the_gate_refuses_stops_the_sweep_unless_forced(tiny_engine_factory, tmp_path, monkeypatch, capsys):
    """A refused blend is computed in full: scoring it would report full prefill's KL (0) as the blend's."""
    forced = []
    base = tiny_engine_factory()

    def load(*a, **kw):
        eng = base.with_store(kw["store"])
        real = eng.prefill

        def prefill(prompt, policy, *args, **kwargs):
            logits, cache, report = real(prompt, policy, *args, **kwargs)
            forced.append(policy.force)
            if policy.mode.value == "blend" and not policy.force:  # as a failed gate reports it
                report = dataclasses.replace(report, gate="quality gate failed (fidelity-kl 0.29 > 0.25)")
            return logits, cache, report

        eng.prefill = prefill
        return eng

    monkeypatch.setattr(sweep.Engine, "load", staticmethod(load))
    args = ["--data", "synthetic:single", "--items", "0-0", "--passages", "2", "--methods", "blend@0.3:v",
            "--ref-cache", str(tmp_path / "ref"), "--model", "tiny-llama"]
    assert main(args + ["--out", str(tmp_path / "a")]) == 2
    assert "did not blend" in capsys.readouterr().err
    assert main(args + ["--out", str(tmp_path / "b"), "--force"]) == 0
    assert forced[-1] is True
    row = json.loads((tmp_path / "b" / "rows.jsonl").read_text().splitlines()[0])
    assert row["method"] == "blend@0.3:v" and row["kl"] > 0


def test_the_summary_counts_what_a_guarded_item_spent_over_both_passes():
    rows = [SweepRow(30, "blend@0.15:probe", 0.1, 1.0, 5.0, 0.3, 100, guarded=True, spent=0.45),
            SweepRow(31, "blend@0.15:probe", 0.1, 1.0, 5.0, 0.15, 100, spent=0.15),
            SweepRow(32, "blend@0.15:probe", 0.1, 1.0, 5.0, 0.15, 100)]  # an older row: spent = share
    line = next(ln for ln in summarise(rows, ["blend@0.15:probe"]).splitlines() if ln.startswith("| blend@"))
    assert "| 0.200 | 0.250 |" in line  # share (0.3 + 0.15 + 0.15) / 3, spent (0.45 + 0.15 + 0.15) / 3


def test_a_timed_sweep_plots_every_item_with_its_guard(tmp_path):
    rows = [SweepRow(30, "blend@0.15:probe", 0.01, 1.0, 300.0, 0.3, 100, guarded=True, full_ms=1000.0, spent=0.45),
            SweepRow(31, "blend@0.15:probe", 0.02, 1.0, 250.0, 0.15, 100, full_ms=1000.0, spent=0.15),
            SweepRow(30, "blend@0.15:probe:guard=off", 0.03, 0.0, 240.0, 0.15, 100, full_ms=1000.0, spent=0.15)]
    (tmp_path / "r.jsonl").write_text("\n".join(json.dumps(asdict(r)) for r in rows) + "\n")
    args = ["--methods", "blend@0.15:probe,blend@0.15:probe:guard=off", "--from-rows", str(tmp_path / "r.jsonl"),
            "--plot"]
    assert main([*args, "--out", str(tmp_path / "s")]) == 0
    assert (tmp_path / "s" / "items.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    untimed = [dataclasses.replace(r, full_ms=None) for r in rows]
    (tmp_path / "u.jsonl").write_text("\n".join(json.dumps(asdict(r)) for r in untimed) + "\n")
    assert main([args[0], args[1], "--from-rows", str(tmp_path / "u.jsonl"), "--plot", "--out", str(tmp_path / "t")]) == 0
    assert (tmp_path / "t" / "budget.png").exists() and not (tmp_path / "t" / "items.png").exists()


def test_a_timed_sweep_takes_each_requests_own_ttft_after_an_untimed_warm_up(tiny_engine_factory, tmp_path,
                                                                              monkeypatch):
    """The first blend runs the quality gate (and builds the probe's weight copy) and the first full
    prefill is cold: one untimed request per method (and one full prefill) on the first item takes
    those, and each sample is the request's own TTFT from its report (the gate's run excluded)."""
    from blend.gate import GateVerdict

    base = tiny_engine_factory()
    calls = []  # (policy mode, ttft_ms reported) in call order
    gate_runs = []  # the call the gate ran in

    class SlowFirstGate:  # as QualityGate: a run on the first blend, the recorded verdict after it
        def verdict(self, engine):
            if not gate_runs:
                gate_runs.append(len(calls))
                return GateVerdict("", 5.0)
            return GateVerdict("", 0.0)

    def load(*a, **kw):
        eng = base.with_store(kw["store"], SlowFirstGate())
        real = eng.prefill

        def prefill(prompt, policy, *args, **kwargs):
            logits, cache, report = real(prompt, policy, *args, **kwargs)
            ms = 100.0 + len(calls)  # what the report timed: distinct per request
            report = dataclasses.replace(report, timings=dataclasses.replace(report.timings, ttft_s=ms / 1e3))
            calls.append((policy.mode.value, ms))
            return logits, cache, report

        eng.prefill = prefill
        return eng

    monkeypatch.setattr(sweep.Engine, "load", staticmethod(load))
    methods = "blend@0.3:v,blend@0.15:probe"
    assert main(["--data", "synthetic:single", "--items", "0-1", "--passages", "2", "--methods", methods,
                 "--ref-cache", str(tmp_path / "ref"), "--model", "tiny-llama", "--time-full",
                 "--out", str(tmp_path / "o")]) == 0
    rows = [json.loads(ln) for ln in (tmp_path / "o" / "rows.jsonl").read_text().splitlines()]
    modes = [m for m, _ in calls]
    # item 0: reference, warm-up (full, both blends), timed (full, both blends); item 1: no warm-up
    assert modes == ["exact", "exact", "blend", "blend", "exact", "blend", "blend",  # the full prefill is one pass:
                     "exact", "exact", "blend", "blend"]  # an exact policy with nothing to look up
    assert gate_runs == [2]  # the gate ran in the first warm-up blend, before anything was timed
    timed = {0: calls[4:7], 1: calls[8:11]}
    for r in rows:
        (_, full_ms), *blends = timed[r["item"]]
        assert r["full_ms"] == full_ms
        assert r["ms"] == dict(zip(methods.split(","), (ms for _, ms in blends)))[r["method"]]
    assert "TTFT ratio" in (tmp_path / "o" / "summary.md").read_text()


def test_the_ttft_ratio_p90_is_the_same_percentile_as_the_kl_p90():
    """One p90 in one table: the TTFT ratio's, like the KL's beside it, interpolates linearly (a nearest rank
    with Python's round-half-even gave 0.5 here, the 5th of 6)."""
    from blend.evals.metrics import percentile

    ratios = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]
    rows = [SweepRow(i, "blend@0.15:probe", r, 1.0, r * 1000.0, 0.15, 100, full_ms=1000.0)
            for i, r in enumerate(ratios)]
    text = summarise(rows, ["blend@0.15:probe"])
    assert percentile(ratios, 90) == 0.55
    line = next(ln for ln in text.splitlines() if ln.startswith("| blend@0.15:probe"))
    assert line.startswith("| blend@0.15:probe | 0.3500 | 0.3500 | 0.5500 | 0.6000 |")  # KL cells
    assert line.endswith("| 0.350 | 0.350 | 0.550 |")  # TTFT ratio median, mean, p90


def test_other_data_is_not_labelled_with_musique_dev_splits(tmp_path):
    """Items 0-29 are the tuning split of musique_dev only; another file's items are just items."""
    rows = [SweepRow(i, "blend@0.15:probe", 0.1, 1.0, 10.0, 0.15, 100) for i in (0, 1, 30)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(asdict(r)) + "\n" for r in rows))
    for data, split in (("../shared/data/musique_dev.json", "### tuning: 2 items (0-1)"),
                        ("my_questions.jsonl", "### other: 3 items (0-30)"),
                        ("synthetic:two-hop", "### other: 3 items (0-30)")):
        out = tmp_path / data.replace("/", "_").replace(":", "_")
        args = ["--methods", "blend@0.15:probe", "--from-rows", str(path), "--data", data, "--out", str(out)]
        assert main(args) == 0
        text = (out / "summary.md").read_text()
        assert split in text, (data, text)


def test_rows_merged_from_runs_count_each_item_once(tmp_path):
    """A rerun's rows.jsonl beside the first run's: the later row of an item and method supersedes the earlier
    one (as a resumed ``kvblend eval`` and the research summary do), so the header's item count is the count
    behind the mean."""
    m = "blend@0.15:probe"
    first = [SweepRow(i, m, kl, 1.0, 10.0, 0.15, 100) for i, kl in ((30, 0.1), (31, 0.2))]
    rerun = [SweepRow(31, m, 0.4, 1.0, 10.0, 0.15, 100)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(asdict(r)) + "\n" for r in first))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(asdict(r)) + "\n" for r in rerun))
    merged = read_rows([tmp_path / "a.jsonl", tmp_path / "b.jsonl"])
    assert sorted((r.item, r.kl) for r in merged) == [(30, 0.1), (31, 0.4)]
    text = summarise(merged, [m])
    assert "### validation: 2 items (30-31)" in text and f"| {m} | 0.2500 |" in text and "| 0/2 |" in text


def test_a_summary_from_rows_names_the_setup_the_rows_ran_with(tmp_path):
    """--from-rows labelled its summary with the command line's --passages/--model defaults, not what the
    rows were run with (two committed summaries said 5 passages for 10-passage rows)."""
    from dataclasses import asdict

    from blend.evals.sweep import SweepRow, main
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps(asdict(SweepRow(30, "blend@0.15", 0.01, 1.0, 5.0, 0.15, 6000,
                                               setup="10 passages, smollm2-135m float32"))) + "\n")
    out = tmp_path / "o"
    assert main(["--from-rows", str(rows), "--methods", "blend@0.15", "--out", str(out)]) in (0, None)
    head = (out / "summary.md").read_text().splitlines()[0]
    assert "10 passages, smollm2-135m float32" in head and "5 passages" not in head


def test_the_sweep_figures_name_the_split_of_their_items(tmp_path, monkeypatch):
    """budget.png's title, documented as "data, split, items", named the data and items but no split."""
    from blend import safeio

    rows = [SweepRow(i, m, 0.1, 1.0, 10.0, 0.1, 100) for i in (0, 1) for m in ("blend@0.15:probe", "blend@0.15:v")]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(asdict(r)) for r in rows) + "\n")
    figures = []
    monkeypatch.setattr(safeio, "save_figure", lambda fig, path, **kw: figures.append(fig))
    assert main(["--methods", "blend@0.15:probe,blend@0.15:v", "--from-rows", str(tmp_path / "a.jsonl"),
                 "--data", "../shared/data/musique_dev.json", "--out", str(tmp_path / "s"), "--plot"]) == 0
    assert "items 0-1 (2 items), tuning split" in figures[0].get_suptitle()


def test_a_method_missing_items_says_so_and_counts_wins_over_the_items_it_shares():
    """Merged rows where one method lacks an item: its mean was over other items than its neighbours' with
    nothing in the table saying so, and an item the first method lacked counted as a loss."""
    a, b = "blend@0.15:probe", "blend@0.15:v"
    rows = [SweepRow(i, a, 0.2, 1.0, 10.0, 0.15, 100) for i in (30, 31)]
    rows += [SweepRow(i, b, 0.1, 1.0, 10.0, 0.15, 100) for i in (30, 31, 32)]
    line = {ln.split(" | ")[0][2:]: ln for ln in summarise(rows, [a, b]).splitlines() if ln.startswith("| blend@")}
    assert f"{a} (2 of 3 items)" in line and line[f"{a} (2 of 3 items)"].startswith(f"| {a} (2 of 3 items) | 0.2000 |")
    assert line[b].endswith("| 2/2 |")  # beats the first method on both items they share


def test_a_bad_item_range_is_a_clear_error(tmp_path, capsys):
    """``--items 9-3`` raised ItemRangeError's traceback."""
    assert main(["--items", "9-3", "--methods", "blend@0.15:v", "--out", str(tmp_path / "o"),
                 "--ref-cache", str(tmp_path / "ref")]) == 2
    assert "first item 9 is after the last 3" in capsys.readouterr().err
