"""Fuzz: results.json files (another run's ``kvblend eval --out``) through the commands that read them.

Property: ``validate_results`` refuses a results object with ``SchemaError``, or every reader of a valid one
runs: compare's run loading, mismatch check, table, plot series and lines and title, and research_summary's rows;
``compare`` and ``research_summary`` exit 0 or 2, never with a traceback. Mutations start from a valid results
object (structural rewrites of any node: wrong types, huge or non-finite numbers, dropped and renamed fields).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from blend.evals import research_summary
from blend.evals.compare import comparison_table, load_run, main as compare_main, mismatches
from blend.evals.plot import draw_methods, run_title, series
from blend.evals.results_schema import SchemaError, validate_results
from blend.evals.rows import RowError
from _fuzz_util import bounded, fuzz_budget, mutate_json
from test_evals_report import make_results


class _Axes:
    """Takes whatever matplotlib's axes would be drawn with (draw_methods reads the methods, draws nothing)."""

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kw: None


def _read_as_compare_and_research_do(path: Path) -> None:
    """Every reader of a results.json, short of rendering a PNG; raises what the readers raise."""
    run = load_run(path)
    mismatches([run, run])
    comparison_table([run])
    methods = run.results["methods"]
    for label in series(methods):
        for field in ("kl", "tf_agreement"):
            draw_methods(_Axes(), methods, field, labels={label})
    run_title(run.results)
    research_summary.rows_from_results(path)  # a valid results object is one research_summary reads


# each escaped its command as a traceback (compare: TypeError, ValueError, AttributeError) before the
# validator checked what compare and research_summary read past the numbers: method specs, model, data
FOUND = {
    "a selector that is a list": lambda r: r["methods"]["blend@0.1:v"]["spec"].update(selector=["v"]),
    "a ratio that is a list": lambda r: r["methods"]["blend@0.1:v"]["spec"].update(ratio=[0.1]),
    "a ratio that is a string": lambda r: r["methods"]["blend@0.3:k"]["spec"].update(ratio=""),
    "a spec that is true": lambda r: r["methods"]["blend@0.1:v"].update(spec=True),
    "a model name that is a list": lambda r: r["model"].update(name=["m"]),
    "data that is a list": lambda r: r["config"].update(data=["synthetic:single"]),
}


@pytest.mark.parametrize("damage", sorted(FOUND))
def test_a_results_json_with_a_field_of_the_wrong_type_is_refused_by_every_reader(tmp_path, capsys, damage):
    results = make_results()
    FOUND[damage](results)
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    with pytest.raises(SchemaError):
        validate_results(results)
    assert compare_main([str(tmp_path), "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("compare: error: ") and "results.json" in err and "Traceback" not in err
    assert not (tmp_path / "x.png").exists()


def test_the_valid_results_are_read_by_every_reader(tmp_path):
    path = tmp_path / "results.json"
    path.write_text(json.dumps(make_results()))
    _read_as_compare_and_research_do(path)
    assert research_summary.rows_from_results(path)  # the blend rows of v and k, and reuse


BASE = make_results()


def _mutated(data: st.DataObject) -> Any:
    """BASE after 1-3 rewrites, each of the whole object or within one top-level field (a node drawn from the
    whole tree is mostly in the items: their fields outnumber the methods', model's and config's)."""
    results: Any = copy.deepcopy(BASE)
    for _ in range(data.draw(st.integers(1, 3), label="rewrites")):
        top = data.draw(st.sampled_from([None, *sorted(BASE)]), label="within")
        if top is None or not isinstance(results, dict) or top not in results:
            results = mutate_json(results, data)
        else:
            results = {**results, top: mutate_json(results[top], data)}
    return results


@fuzz_budget(100)
@given(data=st.data())
def test_a_mutated_results_json_is_refused_or_read_by_every_reader(tmp_path_factory, data):
    results = _mutated(data)
    path = tmp_path_factory.mktemp("run") / "results.json"
    path.write_text(json.dumps(results))
    with bounded():
        try:
            validate_results(results)
        except SchemaError:
            with pytest.raises(SchemaError):
                load_run(path)
            return
        _read_as_compare_and_research_do(path)


def _research_rows_or_row_error(path: Path) -> None:
    try:
        research_summary.rows_from_results(path)
    except RowError as e:
        assert str(path) in str(e)


@fuzz_budget(100)
@given(data=st.data())
def test_research_summary_reads_a_mutated_results_json_or_refuses_it_with_row_error(tmp_path_factory, data):
    """research_summary reads only the items and the method specs: it needs no valid results object, only
    never to raise anything but its own error."""
    results = _mutated(data)
    path = tmp_path_factory.mktemp("run") / "results.json"
    path.write_text(json.dumps(results))
    with bounded():
        _research_rows_or_row_error(path)
