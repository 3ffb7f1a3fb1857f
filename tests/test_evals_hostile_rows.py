"""Hostile and old inputs to the eval rows' parsers: each raises its own error type (found by a review of the
typed rows), and the documented answer-survival summary still runs over typed rows."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from _eval_rows import item_json
from blend.evals import guard_curve as G
from blend.evals.compare import main as compare_main
from blend.evals.results_schema import SchemaError, validate_results
from blend.evals.rows import ItemRow, RowError
from test_evals_guard_curve import GUARDED, OFF, ROWS_JSON
from test_evals_report import make_results

ROOT = Path(__file__).resolve().parent.parent
HUGE = 10 ** 400  # a JSON integer no float holds: math.isfinite(HUGE) raises OverflowError


# a JSON integer no float holds: math.isfinite raised OverflowError, not RowError, in every number field
@pytest.mark.parametrize("where", ["item.ref_margin", "kl", "first_token_margin", "ttft_samples"])
def test_from_json_refuses_a_huge_integer_number_with_row_error(where):
    d = item_json(0, {"full": {}})
    if where == "item.ref_margin":
        d["ref_margin"] = HUGE
    else:
        d["methods"]["full"][where] = [HUGE] if where == "ttft_samples" else HUGE
    with pytest.raises(RowError):
        ItemRow.from_json(d)


# ... which escaped the commands that read such files: a traceback, not exit 2
def test_guard_curve_command_refuses_a_huge_integer_cleanly(tmp_path, capsys):
    rows = copy.deepcopy(ROWS_JSON)
    rows[0]["methods"][OFF]["first_token_margin"] = HUGE
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(G.CurveError):
        G.read_rows(tmp_path)
    assert G.main(["--run", str(tmp_path), "--guarded", GUARDED, "--off", OFF]) == 2


@pytest.mark.parametrize("field", ["first_token_margin", "kl"])
def test_validate_results_refuses_a_huge_integer_with_schema_error(field):
    res = make_results()
    res["items"][0]["methods"]["reuse"][field] = HUGE
    with pytest.raises(SchemaError):
        validate_results(res)


def test_compare_exits_2_on_a_results_json_with_a_huge_integer(tmp_path, capsys):
    res = make_results()
    res["items"][0]["methods"]["reuse"]["first_token_margin"] = HUGE
    (tmp_path / "results.json").write_text(json.dumps(res))
    assert compare_main([str(tmp_path), "--out", str(tmp_path / "x.png")]) == 2


@pytest.mark.parametrize("damage", ["nested too deeply", "a FIFO", "not UTF-8"])
def test_compare_exits_2_on_a_results_json_it_cannot_read(tmp_path, capsys, damage):
    """Deep nesting raised RecursionError as a traceback; a FIFO was waited on for ever (read_text)."""
    import os

    path = tmp_path / "results.json"
    if damage == "a FIFO":
        os.mkfifo(path)
    else:
        path.write_bytes(b"[" * 100_000 if damage == "nested too deeply" else b'{"items": "\xff"}')
    import threading

    codes: list[int] = []
    t = threading.Thread(target=lambda: codes.append(compare_main([str(tmp_path), "--out", str(tmp_path / "x.png")])),
                         daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():  # waiting on the FIFO: a writer that opens and closes it ends the wait
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        t.join(5)
        pytest.fail("compare waited on a FIFO")
    assert codes == [2]
    err = capsys.readouterr().err
    assert err.startswith("compare: error: ") and "results.json" in err and "Traceback" not in err


# a method row that is not an object was r.get() on a list: AttributeError
def test_validate_results_refuses_a_method_row_that_is_not_an_object():
    res = make_results()
    res["items"][0]["methods"]["reuse"] = [1, 2]
    with pytest.raises(SchemaError):
        validate_results(res)


# a deeply nested line is RecursionError from json.loads
def test_guard_curve_read_rows_refuses_a_deeply_nested_line(tmp_path):
    (tmp_path / "rows.jsonl").write_text("[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(G.CurveError):
        G.read_rows(tmp_path)


# the summary BENCHMARKS.md documents ("How long the answer stays full prefill's") reads typed rows
def test_the_documented_answer_survival_summary_still_runs(tmp_path):
    here = ROOT / "docs/results/issue14/answer_survival"
    if not (here / "validation_30-99" / "rows.jsonl").is_file():
        pytest.skip("no docs/results in this checkout")
    done = subprocess.run([sys.executable, str(here / "summarize.py"), str(here / "validation_30-99"),
                           str(here / "bf16_floor_30-99.jsonl"), str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-400:]


def test_a_row_error_names_unknown_fields_briefly():
    """Unknown keys and method names come from the file: the message stays short whatever they hold."""
    d = item_json(0, {"full": {}})
    d.update({f"x{i}" * 50: 0 for i in range(10_000)})
    with pytest.raises(RowError) as err:
        ItemRow.from_json(d)
    assert len(str(err.value)) < 400 and "and 9995 more" in str(err.value)
    d = item_json(0, {"full": {}})
    d["methods"]["m" * 10_000] = {"kl": 0}
    with pytest.raises(RowError) as err:
        ItemRow.from_json(d)
    assert len(str(err.value)) < 400


def test_results_json_validation_names_methods_briefly(tmp_path):
    """The validator names methods itself before it parses the items: a crafted file's long or many method
    names make a short message, here and through `compare`."""
    res = make_results()
    res["methods"]["m" * 10_000] = res["methods"]["reuse"]
    with pytest.raises(SchemaError) as err:
        validate_results(res)
    assert len(str(err.value)) < 400
    res = make_results()
    for i in range(1000):
        res["items"][0]["methods"][f"extra-{i}"] = res["items"][0]["methods"]["reuse"]
    with pytest.raises(SchemaError) as err:
        validate_results(res)
    assert len(str(err.value)) < 400 and "and 995 more" in str(err.value)
    (tmp_path / "results.json").write_text(json.dumps(res))
    assert compare_main([str(tmp_path), "--out", str(tmp_path / "x.png")]) == 2
