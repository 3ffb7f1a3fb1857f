"""The research tools' rows files (evals/sweep.py's rows.jsonl, research_summary's research JSONL and
results.json) read as the eval rows do: a damaged line raises RowError naming the file and the line (it was a
raw ValueError, TypeError or KeyError), and a line splits at "\\n" only (str.splitlines also split a row at a
U+2028, U+2029 or U+0085 inside one of its strings)."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from _eval_rows import item_json
from blend.evals import guard_curve as G
from blend.evals import research_summary as R
from blend.evals.rows import RowError, jsonl_lines
from blend.evals.sweep import SweepRow, main as sweep_main, read_rows

SEPARATORS = ["\u2028", "\u2029", "\u0085"]  # str.splitlines ends a line at each; json.dumps(ensure_ascii=False)
# writes them raw (it escapes "\x1c", "\v", "\f", where splitlines ends a line too)
HUGE = 10 ** 400  # a JSON integer no float holds


def _sweep_json(**change) -> dict:
    return {**asdict(SweepRow(30, "blend@0.15:probe", 0.1, 1.0, 10.0, 0.15, 100, setup="5 passages")), **change}


def _research_json(**change) -> dict:
    return {"index": 30, "id": "30", "kl": {"v@0.15": 0.1}, "top1": {"v@0.15": 1.0}, "share": {"v@0.15": 0.15},
            **change}


def _lines(path, rows: list) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n" for r in rows),
                    encoding="utf-8")


def test_jsonl_lines_split_at_newline_only() -> None:
    seps = "".join(SEPARATORS) + "\x1c\x1d\x1e\x0b\x0c"
    assert list(jsonl_lines(f"a\r\n\n  \nb{seps}c\n")) == [(1, "a\r"), (4, f"b{seps}c")]


@pytest.mark.parametrize("sep", SEPARATORS)
def test_sweep_rows_holding_a_line_separator_in_a_string_read_whole(tmp_path, sep) -> None:
    path = tmp_path / "rows.jsonl"
    _lines(path, [_sweep_json(item=30), _sweep_json(item=31, setup=f"5 passages{sep}x")])
    assert [r.setup for r in read_rows([path])] == ["5 passages", f"5 passages{sep}x"]


DAMAGED_SWEEP = {
    "not JSON": "{oops",
    "not an object": "[1, 2]",
    "a field missing": json.dumps({k: v for k, v in _sweep_json().items() if k != "kl"}),
    "an unknown field": json.dumps(_sweep_json(mystery=1)),
    "a string for a number": json.dumps(_sweep_json(kl="0.1")),
    "a bool for a number": json.dumps(_sweep_json(ms=True)),
    "an integer no float holds": json.dumps(_sweep_json(top1=HUGE)),
    "a negative item": json.dumps(_sweep_json(item=-1)),
    "nested too deeply": "[" * 100_000 + "]" * 100_000,
}


@pytest.mark.parametrize("damage", list(DAMAGED_SWEEP))
def test_a_damaged_sweep_row_names_its_file_and_line(tmp_path, capsys, damage) -> None:
    path = tmp_path / "rows.jsonl"
    _lines(path, [_sweep_json(), "", DAMAGED_SWEEP[damage]])
    with pytest.raises(RowError, match=f"{path}:3"):
        read_rows([path])
    assert sweep_main(["--methods", "blend@0.15:probe", "--from-rows", str(path), "--out", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err
    assert f"{path}:3" in err and "Traceback" not in err


def test_sweep_rows_of_older_runs_still_read(tmp_path) -> None:
    """Rows from before ``margin``... (fields with defaults) and with the first guard's retired ``probe_margin``."""
    path = tmp_path / "rows.jsonl"
    old = {k: v for k, v in _sweep_json().items() if k in ("item", "method", "kl", "top1", "ms", "share",
                                                             "prompt_tokens")}
    _lines(path, [old, {**old, "item": 31, "probe_margin": None, "ref_margin": 0.5, "margin": 0.3}])
    a, b = read_rows([path])
    assert a == SweepRow(30, "blend@0.15:probe", 0.1, 1.0, 10.0, 0.15, 100) and (b.ref_margin, b.margin) == (0.5, 0.3)


def test_sweep_rows_from_an_unreadable_file_raise_row_error(tmp_path) -> None:
    for path in (tmp_path / "absent.jsonl", tmp_path):  # absent; a folder
        with pytest.raises(RowError, match="cannot read"):
            read_rows([path])
    (tmp_path / "latin1.jsonl").write_bytes(b'{"method": "\xe9"}\n')
    with pytest.raises(RowError, match="UnicodeDecodeError"):
        read_rows([tmp_path / "latin1.jsonl"])


@pytest.mark.parametrize("sep", SEPARATORS)
def test_research_rows_holding_a_line_separator_in_a_string_read_whole(tmp_path, sep) -> None:
    path = tmp_path / "r.jsonl"
    _lines(path, [_research_json(), _research_json(index=31, id=f"31{sep}x")])
    assert [r["id"] for r in R.load_rows([path])] == ["30", f"31{sep}x"]


DAMAGED_RESEARCH = {
    "not JSON": "{oops",
    "not an object": "3",
    "no index": json.dumps({k: v for k, v in _research_json().items() if k != "index"}),
    "a string index": json.dumps(_research_json(index="30")),
    "kl not an object": json.dumps(_research_json(kl=[0.1])),
    "a null figure": json.dumps(_research_json(top1={"v@0.15": None})),
    "a variant without top1": json.dumps(_research_json(top1={})),
    "an integer no float holds": json.dumps(_research_json(kl={"v@0.15": HUGE})),
}


@pytest.mark.parametrize("damage", list(DAMAGED_RESEARCH))
def test_a_damaged_research_row_names_its_file_and_line(tmp_path, capsys, damage) -> None:
    path = tmp_path / "r.jsonl"
    _lines(path, [_research_json(), DAMAGED_RESEARCH[damage]])
    with pytest.raises(RowError, match=f"{path}:2"):
        R.load_rows([path])
    assert R.main([str(path), "--items", "30-99"]) == 2
    err = capsys.readouterr().err
    assert f"{path}:2" in err and "Traceback" not in err


@pytest.mark.parametrize("damage", ["not JSON", "no items", "an item that is not a row", "a method without its "
                                    "aggregate", "a spec that is not an object", "a blend spec without a ratio"])
def test_a_damaged_results_json_names_its_file(tmp_path, capsys, damage) -> None:
    from blend.evals.methods import parse_method

    names = ["full", "blend@0.15:v"]
    res = {"methods": {n: {"spec": parse_method(n).to_dict()} for n in names},
           "items": [item_json(30, {n: {"kl": 0.1, "top1": 1.0} for n in names})]}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(res))
    assert [r["kl"] for r in R.load_rows([path])] == [{"v@0.15": 0.1}]  # undamaged, it reads
    if damage == "no items":
        del res["items"]
    elif damage == "an item that is not a row":
        del res["items"][0]["question"]
    elif damage == "a method without its aggregate":
        del res["methods"]["full"]
    elif damage == "a spec that is not an object":
        res["methods"]["blend@0.15:v"]["spec"] = "blend"
    elif damage == "a blend spec without a ratio":
        res["methods"]["blend@0.15:v"]["spec"]["ratio"] = None
    path.write_text("{oops" if damage == "not JSON" else json.dumps(res))
    with pytest.raises(RowError, match=str(path)):
        R.load_rows([path])
    assert R.main([str(path), "--items", "30-99"]) == 2
    assert str(path) in capsys.readouterr().err


@pytest.mark.parametrize("sep", SEPARATORS)
def test_guard_curve_reads_a_row_holding_a_line_separator_whole(tmp_path, sep) -> None:
    from test_evals_guard_curve import ROWS_JSON

    rows = [dict(r, question=f"{r['question']}{sep}more") for r in ROWS_JSON]
    _lines(tmp_path / "rows.jsonl", rows)
    assert [r.question for r in G.read_rows(tmp_path)] == [r["question"] for r in sorted(rows, key=lambda r: r["index"])]
