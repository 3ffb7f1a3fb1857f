"""--items A-B (the tuning / validation split) and the KL tail in results.json / results.md."""

import argparse
import json

import pytest

from blend.evals.aggregate import aggregate_method
from blend.evals.cli import configure_parser, run_eval
from blend.evals.data import load_items
from blend.evals.splits import ItemRangeError, parse_item_range
from blend.evals.methods import parse_method
from blend.evals.report import markdown, worst_items
from blend.evals.results_schema import SchemaError, validate_results
from blend.evals.rows import ItemRow
from _eval_rows import item_row, method_row
from test_evals_harness import FakeEngine, _strip_timings

METHODS = "full,reuse,blend@0.5:v,blend@0.2:k"


def _args(tmp_path, *extra, out="out", data="synthetic:single"):
    argv = ["--data", data, "--passages", "3", "--methods", METHODS, "--out", str(tmp_path / out),
            "--max-new-tokens", "4", "--no-progress", "--bootstrap", "100", "--repeats", "1", *extra]
    return configure_parser(argparse.ArgumentParser()).parse_args(argv)


def _factory(engines, n=8):
    def make(config):
        items = load_items(config.data, n, config.passages, config.seed)
        e = FakeEngine({it.question: it.answers[0] for it in items})
        engines.append(e)
        return e
    return make


@pytest.mark.parametrize("text,expected", [("30-99", (30, 99)), ("7", (7, 7)), (" 0 - 29 ", (0, 29))])
def test_parse_item_range(text, expected):
    assert parse_item_range(text) == expected


@pytest.mark.parametrize("text", ["", "a-b", "5-3", "-3", "1-2-3", "1.5"])
def test_parse_item_range_rejects(text):
    with pytest.raises(ItemRangeError):
        parse_item_range(text)


def test_items_range_runs_those_items_with_their_data_indices(tmp_path):
    engines = []
    assert run_eval(_args(tmp_path, "--items", "2-4", out="range"), _factory(engines), policy_of=lambda m: m) == 0
    res = json.loads((tmp_path / "range" / "results.json").read_text())
    validate_results(res)
    data = load_items("synthetic:single", 5, 3)
    assert [r["index"] for r in res["items"]] == [2, 3, 4]
    assert [r["id"] for r in res["items"]] == [it.id for it in data[2:5]]
    assert {c[1] for c in engines[0].calls} == {it.question for it in data[2:5]}
    assert res["config"]["items"] == "2-4"
    # the same items' rows as in a run over the first five (rotation follows the data index)
    assert run_eval(_args(tmp_path, "--limit", "5", out="all"), _factory([]), policy_of=lambda m: m) == 0
    whole = json.loads((tmp_path / "all" / "results.json").read_text())
    assert _strip_timings(res["items"]) == _strip_timings(whole["items"][2:5])


def test_items_range_resume_skips_items_done(tmp_path):
    assert run_eval(_args(tmp_path, "--items", "1-2"), _factory([]), policy_of=lambda m: m) == 0
    engines = []
    assert run_eval(_args(tmp_path, "--items", "1-2", "--resume"), _factory(engines), policy_of=lambda m: m) == 0
    assert not [c for c in engines[0].calls if c[0] == "generate"]  # nothing left to do
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["index"] for r in res["items"]] == [1, 2]


def test_items_range_past_the_data_is_a_clear_error(tmp_path, capsys):
    data = tmp_path / "d.json"
    recs = [{"question": f"q{i}?", "answers": ["a"], "ctxs": [{"title": "t", "text": "x y z"}]} for i in range(3)]
    data.write_text(json.dumps(recs))
    assert run_eval(_args(tmp_path, "--items", "2-5", data=str(data)), _factory([]), policy_of=lambda m: m) == 2
    assert "only 3 items" in capsys.readouterr().err


def _rows(kls, top1s=None):
    top1s = top1s or [1.0] * len(kls)
    return [item_row(i, {"m": method_row(kl=k, top1=t, tf_agreement=0.5, f1=0.0)})
            for i, (k, t) in enumerate(zip(kls, top1s))]


def test_aggregate_reports_the_kl_tail():
    kls = [0.01 * i for i in range(1, 11)]  # 0.01 .. 0.10
    agg = aggregate_method("m", _rows(kls, [1.0] * 9 + [0.0]), parse_method("blend@0.1:v"), n_boot=200, seed=0)
    assert agg["kl"] == pytest.approx(0.055)
    assert agg["kl_median"] == pytest.approx(0.055)
    assert agg["kl_p90"] == pytest.approx(0.091)  # linear interpolation between 0.09 and 0.10
    assert agg["kl_max"] == pytest.approx(0.10)
    lo, hi = agg["kl_ci"]
    assert 0.01 <= lo < 0.055 < hi <= 0.10
    assert agg["top1"] == pytest.approx(0.9) and agg["top1_ci"][0] < 0.9 <= agg["top1_ci"][1]


def test_results_md_shows_the_tail_and_the_worst_items(tmp_path):
    assert run_eval(_args(tmp_path, "--items", "0-6"), _factory([]), policy_of=lambda m: m) == 0
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    worst = worst_items(res["methods"], [ItemRow.from_json(r) for r in res["items"]], 5)
    assert len(worst) == 5

    def mean_blend_kl(row):
        return (row["methods"]["blend@0.5:v"]["kl"] + row["methods"]["blend@0.2:k"]["kl"]) / 2

    ranked = sorted(res["items"], key=lambda r: -mean_blend_kl(r))
    assert [r.index for r in worst] == [r["index"] for r in ranked[:5]]
    md = markdown(res)
    assert "## Tail of KL" in md and "## The 5 worst items" in md
    tail = md.split("## Tail of KL")[1].split("## The 5")[0]
    agg = res["methods"]["blend@0.2:k"]
    line = next(ln for ln in tail.splitlines() if ln.startswith("| `blend@0.2:k`"))
    assert f"{agg['kl_max']:.4f}" in line and f"{agg['kl_p90']:.4f}" in line
    worst_block = md.split("## The 5 worst items")[1]
    first = next(ln for ln in worst_block.splitlines() if ln.startswith(f"| {worst[0].index} |"))
    assert f"{worst[0].methods['reuse'].kl:.4f}" in first


def test_validator_rejects_a_bad_tail_field(tmp_path):
    assert run_eval(_args(tmp_path, "--items", "0-1"), _factory([]), policy_of=lambda m: m) == 0
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    res["methods"]["reuse"]["kl_ci"] = [0.3, 0.1]
    with pytest.raises(SchemaError, match="kl_ci"):
        validate_results(res)


def test_results_md_lists_first_token_flips_with_the_references_own_gap(tmp_path):
    assert run_eval(_args(tmp_path, "--items", "0-6"), _factory([]), policy_of=lambda m: m) == 0
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert all(isinstance(r["ref_margin"], float) and r["ref_margin"] >= 0 for r in res["items"])
    validate_results(res)
    # make two flips of one method, one of them a near tie
    res["items"][1]["methods"]["blend@0.5:v"]["top1"] = 0.0
    res["items"][4]["methods"]["blend@0.5:v"]["top1"] = 0.0
    res["items"][1]["ref_margin"], res["items"][4]["ref_margin"] = 0.04, 1.5
    for r in res["items"]:
        for name in ("reuse", "blend@0.2:k"):
            r["methods"][name]["top1"] = 1.0
    for i in (0, 2, 3, 5, 6):
        res["items"][i]["methods"]["blend@0.5:v"]["top1"] = 1.0
    md = markdown(res)
    block = md.split("## First-token flips")[1].split("\n## ")[0]  # up to the next section
    line = next(ln for ln in block.splitlines() if ln.startswith("| `blend@0.5:v`"))
    assert line == f"| `blend@0.5:v` | 2 | 1 | {res['items'][1]['index']} (0.04), {res['items'][4]['index']} (1.50) |"
    assert "`reuse`" not in block  # no flips, no row
    res["items"][0]["ref_margin"] = "wide"
    with pytest.raises(SchemaError, match="ref_margin"):
        validate_results(res)


def test_load_item_range_is_the_range_of_the_whole_set(tmp_path):
    """A range of a file's items, and of a synthetic set beyond its default 30 (built from the index)."""
    from blend.evals.data import load_item_range

    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"question": f"q{i}?", "ctxs": [{"title": "", "text": f"t{i} {j}"} for j in range(3)],
                                 "answers": ["a"]} for i in range(6)]))
    got = load_item_range(str(path), range(2, 5), passages=2)
    assert [it.question for it in got] == ["q2?", "q3?", "q4?"] and all(len(it.documents) == 2 for it in got)
    assert [it.question for it in load_item_range(str(path), range(4, 9), None)] == ["q4?", "q5?"]  # file ends
    assert load_item_range(str(path), range(3, 3), None) == []
    whole = load_items("synthetic:two-hop", 40, 5)
    assert load_item_range("synthetic:two-hop", range(33, 36), 5) == whole[33:36]
    with pytest.raises(ValueError, match="step 1"):
        load_item_range(str(path), range(0, 6, 2), None)


def _budget_args(out, *extra):
    argv = ["--data", "synthetic:single", "--passages", "3", "--methods", "full,reuse", "--out", str(out),
            "--max-new-tokens", "4", "--no-progress", "--bootstrap", "50", "--repeats", "1", *extra]
    return configure_parser(argparse.ArgumentParser()).parse_args(argv)


def test_an_items_run_can_be_extended_by_resume_as_a_limit_run_can(tmp_path):
    # --limit 2 then --resume --limit 4 works; --items 2-3 then --resume --items 2-5 is refused
    # ("written with different settings (items)") although every kept row lies in the new range
    assert run_eval(_budget_args(tmp_path / "o", "--items", "2-3"), _factory([]), policy_of=lambda m: m) == 0
    assert run_eval(_budget_args(tmp_path / "o", "--items", "2-5", "--resume"), _factory([]), policy_of=lambda m: m) == 0
    res = json.loads((tmp_path / "o" / "results.json").read_text())
    assert [r["index"] for r in res["items"]] == [2, 3, 4, 5]


def test_survival_does_not_claim_tokens_past_the_decoding_budget(tmp_path):
    # --max-new-tokens 4: every answer is cut at 4 tokens, so nothing is known about tokens 5..32, yet
    # results.md reports "first 8 | first 16 | first 32" shares (1.000 where the 4 tokens match)
    assert run_eval(_budget_args(tmp_path / "o", "--limit", "3"), _factory([]), policy_of=lambda m: m) == 0
    md = (tmp_path / "o" / "results.md").read_text()
    header = next(ln for ln in md.splitlines() if ln.startswith("| method | n | first 1"))
    assert "first 8" not in header and "first 32" not in header, header
