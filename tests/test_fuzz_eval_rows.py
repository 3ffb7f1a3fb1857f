"""Fuzz: the row files of earlier runs (``kvblend eval``'s rows.jsonl, sweep and research rows) through the
commands that summarise them.

Property: each reader returns rows or raises its own error (``CurveError``, ``RowError``) naming the file; each
command (guard_curve, sweep --from-rows, research_summary) exits 0 or 2 and writes only what a UTF-8 terminal
and file take, never a traceback. Mutations start from valid rows: structural rewrites, JSON texts json.dumps
never writes (too many digits, nesting past the decoder's limit, NaN, lone surrogate escapes, duplicated keys),
and bit flips.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from blend.evals import guard_curve as G
from blend.evals import research_summary as R
from blend.evals import sweep as S
from blend.evals.rows import RowError
from _fuzz_util import bounded, dumps_mutated, fuzz_budget, mutate_bytes, mutate_json
from test_evals_guard_curve import GUARDED, OFF, ROWS_JSON
from test_evals_row_files import _research_json, _sweep_json

SWEEP_ROWS = [_sweep_json(item=i, method=m) for i in (30, 31) for m in ("blend@0.15:probe", "blend@0.15:v")]
RESEARCH_ROWS = [_research_json(index=i, id=str(i)) for i in (30, 31, 32)]
DIGITS = "1" + "0" * 5000  # more digits than int() converts: a ValueError that is not a JSONDecodeError


def _lines(rows: list[Any], data: st.DataObject) -> bytes:
    """The rows as JSON Lines, one of them damaged (rewritten, written as a hostile text, or bit-flipped)."""
    i = data.draw(st.integers(0, len(rows) - 1), label="row")
    how = data.draw(st.sampled_from(["json", "text", "bytes"]), label="how")
    out = [json.dumps(r).encode() for r in rows]
    if how == "json":
        out[i] = json.dumps(mutate_json(rows[i], data)).encode()
    elif how == "text":
        out[i] = dumps_mutated(rows[i], data)
    else:
        out[i] = mutate_bytes(out[i], data)
    return b"\n".join(out) + b"\n"


def _guard_curve(run: Path) -> int:
    return G.main(["--run", str(run), "--guarded", GUARDED, "--off", OFF])


def _sweep(rows: Path) -> int:
    return S.main(["--methods", "blend@0.15:probe,blend@0.15:v", "--from-rows", str(rows), "--out", str(rows.parent / "s")])


def _research(rows: Path) -> int:
    return R.main([str(rows), "--items", "30-99"])


def _no_traceback(capsys: pytest.CaptureFixture) -> None:
    """capsys holds what the command wrote (its streams are UTF-8 with errors=strict: a lone surrogate raised)."""
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err


# ---- found by this fuzz (each a traceback before) -------------------------------------------------------

def test_a_row_holding_an_integer_of_too_many_digits_is_a_curve_error(tmp_path, capsys):
    (tmp_path / "rows.jsonl").write_text(json.dumps(ROWS_JSON[0]) + "\n" + f'{{"index": {DIGITS}}}\n')
    with pytest.raises(G.CurveError, match="rows.jsonl:2: not JSON"):  # was ValueError out of read_rows
        G.read_rows(tmp_path)
    assert _guard_curve(tmp_path) == 2
    _no_traceback(capsys)


def test_a_sweep_row_whose_setup_holds_a_lone_surrogate_is_refused(tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_bytes(json.dumps(_sweep_json(setup="5 passages \ud800")).encode() + b"\n")
    with pytest.raises(RowError, match="setup: not valid Unicode"):
        S.read_rows([rows])
    assert _sweep(rows) == 2  # summary.md was written through UnicodeEncodeError: a traceback, no summary
    _no_traceback(capsys)
    assert not (tmp_path / "s" / "summary.md").exists()


@pytest.mark.parametrize("where", ["variant", "id"])
def test_a_research_row_holding_a_lone_surrogate_is_refused(tmp_path, capsys, where):
    row = (_research_json(kl={"v\ud800": 0.1}, top1={"v\ud800": 1.0}, share={"v\ud800": 0.15}) if where == "variant"
           else _research_json())
    rows = tmp_path / "rows.jsonl"
    rows.write_bytes(json.dumps(row).encode() + b"\n")
    if where == "variant":  # printed in the summary table: UnicodeEncodeError on a UTF-8 terminal
        with pytest.raises(RowError, match="not an object of finite numbers"):
            R.load_rows([rows])
        assert _research(rows) == 2
    else:
        assert _research(rows) == 0
    _no_traceback(capsys)


def test_an_item_row_holding_a_lone_surrogate_is_refused(tmp_path, capsys):
    row = json.loads(json.dumps(ROWS_JSON[1]))
    row["methods"][OFF]["prediction"] = "Paris \ud800"
    (tmp_path / "rows.jsonl").write_bytes(json.dumps(row).encode() + b"\n")
    with pytest.raises(G.CurveError, match=r"prediction: not valid Unicode \(a lone surrogate\)"):
        G.read_rows(tmp_path)
    assert _guard_curve(tmp_path) == 2
    _no_traceback(capsys)


# ---- fuzz ---------------------------------------------------------------------------------------------

@fuzz_budget(100)
@given(data=st.data())
def test_an_eval_runs_rows_are_read_or_refused_with_a_curve_error(tmp_path_factory, data):
    run = tmp_path_factory.mktemp("run")
    (run / "rows.jsonl").write_bytes(_lines(ROWS_JSON, data))
    with bounded():  # what guard_curve's main runs before it draws (a PNG per example would take ~0.1 s)
        try:
            rows = G.read_rows(run)
        except G.CurveError as e:
            assert "rows.jsonl" in str(e)
            return
        try:
            G.curve(rows, GUARDED, OFF, G.default_margins(G.guard_margin_of(GUARDED)))
        except G.CurveError:  # rows without the two methods
            pass


@fuzz_budget(100)
@given(data=st.data())
def test_sweep_rows_are_read_or_refused_with_a_row_error(tmp_path_factory, capsys, data):
    rows = tmp_path_factory.mktemp("sweep") / "rows.jsonl"
    rows.write_bytes(_lines(SWEEP_ROWS, data))
    with bounded():
        try:
            S.read_rows([rows])
        except RowError as e:
            assert str(rows) in str(e)
        assert _sweep(rows) in (0, 2)
    _no_traceback(capsys)


@fuzz_budget(100)
@given(data=st.data())
def test_research_rows_are_read_or_refused_with_a_row_error(tmp_path_factory, capsys, data):
    rows = tmp_path_factory.mktemp("research") / "rows.jsonl"
    rows.write_bytes(_lines(RESEARCH_ROWS, data))
    with bounded():
        try:
            R.load_rows([rows])
        except RowError as e:
            assert str(rows) in str(e)
        assert _research(rows) in (0, 2)
    _no_traceback(capsys)
