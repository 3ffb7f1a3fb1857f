"""Comparing evaluation runs: loading, the per-budget table, the plot, the command's errors."""

import copy
import json

import pytest

from blend.evals.compare import Run, comparison_table, load_run, main, write_comparison
from blend.evals.results_schema import SchemaError
from test_evals_report import make_results


def _two_runs(tmp_path):
    five = make_results()
    ten = copy.deepcopy(five)
    ten["config"]["passages"] = 10
    ten["methods"]["blend@0.3:k"]["kl"] = 0.2  # at 10 passages k falls behind v at 0.3
    for name, res in (("five", five), ("ten", ten)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(res))
    return tmp_path / "five", tmp_path / "ten"


def test_table_names_the_lowest_kl_selector_per_run_and_budget(tmp_path):
    five, ten = _two_runs(tmp_path)
    runs = [load_run(five), load_run(ten / "results.json", "long")]
    assert [r.label for r in runs] == ["3 passages", "long"]
    table = comparison_table(runs).splitlines()
    assert table[2:] == [
        "| 3 passages | 0.3 | 2 | `blend@0.3:k` | 0.05 | 0.500 |",  # tie on KL: first name
        "| long | 0.3 | 2 | `blend@0.3:v` | 0.05 | 0.550 |",
    ]


def test_plot_and_command(tmp_path, capsys):
    five, ten = _two_runs(tmp_path)
    out = tmp_path / "cmp.png"
    assert main([str(five), str(ten), "--out", str(out), "--labels", "5p,10p", "--selectors", "v",
                 "--xmax", "0.6"]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
    printed = capsys.readouterr().out
    assert "| 5p | 0.3 |" in printed and "| 10p | 0.3 |" in printed and str(out) in printed


def test_the_plot_names_each_runs_items_and_split_and_its_aggregates(tmp_path, monkeypatch):
    """The title named the runs by label only: two runs over different splits read as one comparison."""
    from blend import safeio

    tuning, validation = make_results(), make_results()
    for res, first in ((tuning, 0), (validation, 30)):
        res["config"]["data"] = "../shared/data/musique_dev.json"
        res["items"] = [dict(res["items"][0], index=first + i, id=str(first + i)) for i in range(2)]
    figures = []
    monkeypatch.setattr(safeio, "save_figure", lambda fig, path, **kw: figures.append(fig))
    write_comparison([Run("a", tuning), Run("b", validation)], tmp_path / "c.png", fields=("kl",))
    title = figures[0].get_suptitle()
    assert "a (items 0-1 (2 items), tuning split)" in title and "b (items 30-31 (2 items), validation split)" in title
    ax = figures[0].axes[0]
    assert ax.get_title() == "mean KL(full || method), first token (nats)" and "median over items" in ax.get_xlabel()


def test_errors_are_clear(tmp_path, capsys):
    five, _ = _two_runs(tmp_path)
    assert main([str(five), "--out", str(tmp_path / "x.png"), "--labels", "a,b"]) == 2
    assert "2 labels for 1 runs" in capsys.readouterr().err
    assert main([str(five), "--out", str(tmp_path / "x.png"), "--fields", "speed"]) == 2
    assert "unknown field" in capsys.readouterr().err
    assert main([str(tmp_path / "nowhere"), "--out", str(tmp_path / "x.png")]) == 2
    assert "nowhere" in capsys.readouterr().err
    broken = json.loads((five / "results.json").read_text())
    del broken["items"]
    (five / "results.json").write_text(json.dumps(broken))
    with pytest.raises(SchemaError, match="five/results.json"):
        load_run(five)
    with pytest.raises(ValueError, match="at most 4 runs"):
        write_comparison([Run("r", broken)] * 5, tmp_path / "y.png")


def test_compare_flags_runs_over_other_items(tmp_path):
    import argparse

    from blend.evals.cli import configure_parser, run_eval
    from blend.evals.compare import mismatches
    from test_evals_items import _factory

    for out, items in (("a", "0-1"), ("b", "5-7")):
        argv = ["--data", "synthetic:single", "--passages", "3", "--methods", "full,blend@0.5:v,blend@0.5:k",
                "--out", str(tmp_path / out), "--max-new-tokens", "4", "--no-progress", "--bootstrap", "50",
                "--repeats", "1", "--items", items]
        assert run_eval(configure_parser(argparse.ArgumentParser()).parse_args(argv), _factory([]),
                        policy_of=lambda m: m) == 0
    assert mismatches([load_run(tmp_path / "a"), load_run(tmp_path / "b")])  # absent before: silently compared
