"""The eval's typed rows (evals/rows.py): JSON in, the same JSON out, old rows without the fields added
since, and one error type for anything that is not a row."""

from __future__ import annotations

import argparse
import copy
import json
import math
from pathlib import Path

import pytest

from _eval_rows import item_json, item_row, method_row
from blend.evals.cli import config_from_args, configure_parser, run_eval
from blend.evals.data import load_items
from blend.evals.harness import ResumeError, run_harness
from blend.evals.methods import parse_methods
from blend.evals.report import markdown
from blend.evals.results_schema import SchemaError, validate_results
from blend.evals.rows import ITEM_FIELDS_SINCE, METHOD_FIELDS_SINCE, ItemRow, MethodRow, RowError
from test_evals_harness import _fake_factory

ROOT = Path(__file__).resolve().parent.parent
ITEM_KEYS = ["index", "id", "question", "item_sha256", "answers", "prompt_tokens", "full_answer", "ref_margin",
             "methods"]
METHOD_KEYS = ["prediction", "answer_tokens", "f1", "em", "rouge_l", "contains", "agreement", "same_tokens", "kl",
               "top1", "tf_agreement", "tf_kl", "ttft_s", "ttft_samples", "ttft_ratio", "ttft_ref_s", "threads",
               "first_token_margin", "guarded", "applied", "recomputed_tokens", "reused_tokens", "prompt_tokens",
               "recomputed_frac", "computed_frac"]


def _args(tmp_path, *extra):
    argv = ["--data", "synthetic:single", "--limit", "3", "--passages", "3", "--methods", "full,reuse,blend@0.5:v",
            "--out", str(tmp_path / "out"), "--max-new-tokens", "4", "--repeats", "2", "--no-progress",
            "--bootstrap", "50", *extra]
    return configure_parser(argparse.ArgumentParser()).parse_args(argv)


def _run(tmp_path, *extra):
    return run_eval(_args(tmp_path, *extra), _fake_factory([]), policy_of=lambda m: m)


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def test_a_harness_row_goes_to_json_and_back_unchanged(tmp_path):
    assert _run(tmp_path) == 0
    for line in _lines(tmp_path / "out" / "rows.jsonl"):
        d = json.loads(line)
        assert list(d) == ITEM_KEYS and all(list(m) == METHOD_KEYS for m in d["methods"].values())
        row = ItemRow.from_json(d)
        assert row.absent == frozenset() and all(m.absent == frozenset() for m in row.methods.values())
        assert isinstance(row.answers, tuple) and isinstance(row.methods["full"].ttft_samples, tuple)
        assert len(row.methods["reuse"].ttft_samples) == 2 and row.methods["reuse"].guarded is False
        assert json.dumps(row.to_json()) == line  # the same bytes: keys, order, values
        assert ItemRow.from_json(json.loads(json.dumps(row.to_json()))) == row


def test_a_hand_built_row_round_trips_and_its_nulls_stay_nulls():
    row = item_row(7, {"full": method_row(first_token_margin=None, f1=None, ttft_ref_s=None, threads=None),
                       "b": method_row(first_token_margin=0.25, guarded=True)}, ref_margin=None)
    d = row.to_json()
    assert list(d) == ITEM_KEYS and d["ref_margin"] is None and d["answers"] == ["a"]
    full = d["methods"]["full"]
    assert list(full) == METHOD_KEYS and full["first_token_margin"] is None and full["f1"] is None
    assert full["ttft_ref_s"] is None and full["threads"] is None and full["ttft_samples"] == [0.1]
    back = ItemRow.from_json(json.loads(json.dumps(d)))
    assert back == row and back.to_json() == d


def test_rows_from_before_the_later_fields_load_and_are_written_back_without_them():
    newest = item_json(3, {"full": {}, "b": {"first_token_margin": 0.4}})
    first = copy.deepcopy(newest)  # the first runs' rows: none of the fields added since
    for f in ITEM_FIELDS_SINCE:
        del first[f]
    for m in first["methods"].values():
        for f in METHOD_FIELDS_SINCE:
            del m[f]
    row = ItemRow.from_json(first)
    assert row.item_sha256 is None and row.ref_margin is None and row.absent == {"ref_margin"}
    b = row.methods["b"]
    assert (b.same_tokens, b.guarded, b.first_token_margin, b.ttft_ref_s, b.threads) == (None,) * 5
    assert b.absent == {"first_token_margin", "ttft_ref_s", "threads"}  # null is a value of these: absent differs
    assert json.dumps(row.to_json()) == json.dumps(first)  # written back as it was: no nulls added
    # a field that may be null, null in the row, stays null (a method that does not blend has no margin)
    newest["methods"]["b"]["first_token_margin"] = None
    assert ItemRow.from_json(newest).to_json() == newest and "first_token_margin" in newest["methods"]["b"]


def test_every_committed_eval_row_reads_back_and_writes_the_same_bytes():
    """docs/results holds rows of every age (from before ref_margin to today's): each line of a harness
    rows.jsonl comes back byte for byte, each item of a results.json key for key."""
    results = ROOT / "docs" / "results"
    if not results.is_dir():
        pytest.skip("no docs/results in this checkout")
    n = 0
    for path in sorted(results.rglob("rows.jsonl")):
        lines = [ln for ln in _lines(path) if ln.strip()]
        if not lines or "methods" not in json.loads(lines[0]):  # the sweep's rows: another format
            continue
        for line in lines:
            assert json.dumps(ItemRow.from_json(json.loads(line)).to_json()) == line, path
            n += 1
    for path in sorted(results.rglob("results.json")):
        for item in json.loads(path.read_text())["items"]:
            back = ItemRow.from_json(item).to_json()
            assert back == item and json.dumps(back) == json.dumps(item), path
            n += 1
    assert n > 0


@pytest.mark.parametrize("mutate,needle", [
    (lambda d: [d], "row: not an object (list)"),
    (lambda d: (d.pop("full_answer"), d)[1], "row.full_answer: missing"),
    (lambda d: d.update(extra=1) or d, "row: unknown field(s) 'extra'"),
    (lambda d: d.update(index="3") or d, "row.index: not a non-negative integer"),
    (lambda d: d.update(index=True) or d, "row.index: not a non-negative integer"),
    (lambda d: d.update(index=3.0) or d, "row.index: not a non-negative integer"),
    (lambda d: d.update(item_sha256=None) or d, "row.item_sha256: not a string"),
    (lambda d: d.update(answers=["a", 1]) or d, "row.answers: not a list of strings"),
    (lambda d: d.update(ref_margin=float("nan")) or d, "row.ref_margin: not a finite number or null"),
    (lambda d: d.update(methods=[]) or d, "row.methods: not an object"),
    (lambda d: d["methods"].update(full=None) or d, "row.methods['full']: not an object"),
    (lambda d: (d["methods"]["full"].pop("kl"), d)[1], "row.methods['full'].kl: missing"),
    (lambda d: d["methods"]["full"].update(kl="0.1") or d, "row.methods['full'].kl: not a finite number"),
    (lambda d: d["methods"]["full"].update(kl=float("inf")) or d, "row.methods['full'].kl: not a finite number"),
    (lambda d: d["methods"]["full"].update(kl=True) or d, "row.methods['full'].kl: not a finite number"),
    (lambda d: d["methods"]["full"].update(same_tokens=None) or d, "same_tokens: not a non-negative int"),
    (lambda d: d["methods"]["full"].update(answer_tokens=1.5) or d, "answer_tokens: not a non-negative"),
    (lambda d: d["methods"]["full"].update(answer_tokens=-1) or d, "answer_tokens: not a non-negative integer"),
    (lambda d: d.update(index=-2) or d, "row.index: not a non-negative integer"),
    (lambda d: d["methods"]["full"].update(threads=0) or d, "threads: not a positive integer or null"),
    (lambda d: d["methods"]["full"].update(guarded=1) or d, "row.methods['full'].guarded: not a boolean"),
    (lambda d: d["methods"]["full"].update(threads="4") or d, "threads: not a positive integer or null"),
    (lambda d: d["methods"]["full"].update(ttft_samples=[0.1, "x"]) or d, "ttft_samples: not a list of numbers"),
    (lambda d: d["methods"]["full"].update(ttft_samples=0.1) or d, "ttft_samples: not a list of numbers"),
    (lambda d: d["methods"]["full"].update(mystery=0) or d, "row.methods['full']: unknown field(s) 'mystery'"),
])
def test_anything_that_is_not_a_row_is_one_row_error_naming_the_field(mutate, needle):
    d = mutate(item_json(0, {"full": {}}))
    with pytest.raises(RowError) as e:
        ItemRow.from_json(d)
    assert needle in str(e.value)
    assert isinstance(e.value, ValueError)


def test_a_method_row_alone_parses_and_fails_the_same_way():
    d = method_row(kl=0.5).to_json()
    assert MethodRow.from_json(d) == method_row(kl=0.5)
    with pytest.raises(RowError, match=r"method row\.kl: missing"):
        MethodRow.from_json({k: v for k, v in d.items() if k != "kl"})


def test_non_finite_numbers_become_none_as_json_holds_them():
    row = item_row(0, {"b": method_row(kl=math.inf, tf_kl=math.nan, ttft_samples=(0.1, math.inf), f1=None)},
                   ref_margin=math.nan).finite()
    b = row.methods["b"]
    assert (b.kl, b.tf_kl, b.ttft_samples, b.f1, row.ref_margin) == (None, None, (0.1, None), None, None)
    assert b.top1 == 1.0 and b.prompt_tokens == 10 and b.guarded is False  # the rest untouched
    assert ItemRow.from_json(json.loads(json.dumps(row.to_json()))) == row


def test_absent_names_only_none_fields_that_may_be_null():
    method_row(first_token_margin=None, absent=frozenset({"first_token_margin"}))
    with pytest.raises(ValueError, match="absent"):
        method_row(first_token_margin=0.3, absent=frozenset({"first_token_margin"}))
    with pytest.raises(ValueError, match="absent"):
        method_row(kl=None, absent=frozenset({"kl"}))  # not a field written since
    with pytest.raises(ValueError, match="absent"):
        method_row(same_tokens=None, absent=frozenset({"same_tokens"}))  # never null: None alone says it


def test_resume_over_rows_from_before_the_later_fields_keeps_them_as_they_were(tmp_path):
    """A run whose rows predate item_sha256, ref_margin, same_tokens, first_token_margin, guarded, ttft_ref_s
    and threads resumes: its rows are rewritten byte for byte, the data is not checked against a digest it
    lacks, and results.json validates (same_tokens as null would not)."""
    assert _run(tmp_path) == 0
    rows_path = tmp_path / "out" / "rows.jsonl"
    old = []
    for line in _lines(rows_path):
        d = json.loads(line)
        for f in ITEM_FIELDS_SINCE:
            del d[f]
        for m in d["methods"].values():
            for f in METHOD_FIELDS_SINCE:
                del m[f]
        old.append(json.dumps(d))
    rows_path.write_text("\n".join(old) + "\n")
    assert _run(tmp_path, "--resume") == 0
    assert _lines(rows_path) == old
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    validate_results(res)
    assert "same_tokens" not in res["items"][0]["methods"]["full"]
    assert "How long the answer stays" not in markdown(res)
    assert res["methods"]["reuse"]["threads"] == []  # unrecorded


def test_resume_refuses_a_line_that_is_json_but_not_a_row_naming_it(tmp_path, capsys):
    assert _run(tmp_path) == 0
    rows_path = tmp_path / "out" / "rows.jsonl"
    lines = _lines(rows_path)
    bad = json.loads(lines[1])
    bad["methods"]["reuse"]["kl"] = "high"
    for damaged in ([lines[0], json.dumps(bad), lines[2]], [lines[0], lines[1], json.dumps(bad)]):
        text = "\n".join(damaged) + "\n"  # in the middle, or last and complete (not a torn write): kept, refused
        rows_path.write_text(text)
        assert _run(tmp_path, "--resume") == 2
        err = capsys.readouterr().err
        assert "is not a row" in err and "kl: not a finite number" in err and rows_path.read_text() == text
    cfg = config_from_args(_args(tmp_path))  # the harness itself raises its own error, never RowError
    with pytest.raises(ResumeError, match="line 3"):
        run_harness(None, load_items("synthetic:single", 3, 3), parse_methods(",".join(cfg.methods)), cfg,
                    tmp_path / "out", resume=True)


def test_the_validator_refuses_an_item_its_readers_could_not_parse():
    from test_evals_report import make_results

    res = make_results()
    validate_results(res)
    res["items"][1]["methods"]["reuse"]["verdict"] = "fine"
    with pytest.raises(SchemaError, match=r"results.items\[1\]: row.methods\['reuse'\]: unknown field\(s\) 'verdict'"):
        validate_results(res)
    res = make_results()
    del res["items"][0]["full_answer"]
    with pytest.raises(SchemaError, match="full_answer: missing"):
        validate_results(res)
