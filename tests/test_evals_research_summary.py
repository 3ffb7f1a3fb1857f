"""The research summary (evals/research_summary.py) never pools the tuning and validation splits unasked."""

from __future__ import annotations

import json

import pytest

from _eval_rows import item_json
from blend.evals import research_summary


def _rows(path, indices):
    path.write_text("".join(json.dumps({"index": i, "kl": {"v@0.15": 0.1 * (1 + i % 3)}, "top1": {"v@0.15": 1.0},
                                        "share": {"v@0.15": 0.15}}) + "\n" for i in indices))
    return path


def test_items_is_required_and_the_header_names_the_split(tmp_path, capsys):
    rows = _rows(tmp_path / "r.jsonl", range(0, 100))
    with pytest.raises(SystemExit):
        research_summary.main([str(rows)])
    assert "--items" in capsys.readouterr().err
    assert research_summary.main([str(rows), "--items", "30-99"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("70 items of 30-99, validation split") and "`v@0.15` | 70 |" in out
    assert research_summary.main([str(rows), "--items", "0-29"]) == 0
    assert capsys.readouterr().out.startswith("30 items of 0-29, tuning split")
    assert research_summary.main([str(rows), "--items", "0-99"]) == 0  # pooled only when asked, and said so
    assert capsys.readouterr().out.startswith("100 items of 0-99, mixed split")


def test_harness_methods_that_differ_beyond_selector_and_ratio_keep_their_own_rows(tmp_path):
    """``blend@0.15:v`` and ``blend@0.15:v:guard=off`` are two methods: neither may overwrite the other."""
    from blend.evals.methods import parse_method

    names = {"blend@0.15:v": 0.1, "blend@0.15:v:guard=off": 0.4, "blend@0.3:v:temp=1.1": 0.2, "blend@0.3:v": 0.3}
    spec = {n: parse_method(n).to_dict() for n in names}
    res = {"methods": {n: {"spec": spec[n]} for n in names},
           "items": [item_json(30, {n: {"kl": kl, "top1": 1.0} for n, kl in names.items()})]}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(res))
    (row,) = research_summary.rows_from_results(path)
    assert row["kl"]["v@0.15"] == 0.1 and row["kl"]["v@0.3"] == 0.3  # plain methods keep their research names
    assert sorted(row["kl"].values()) == [0.1, 0.2, 0.3, 0.4]
    assert row["share"]["v@0.15"] == 0.15


def test_a_variant_not_on_every_item_is_named_not_silently_dropped(tmp_path, capsys):
    """A harness method whose KL is null (not finite) on one item is left out of that item's row; the summary
    then dropped the whole variant from its table without a word (and ``--all`` gave a mean over the others)."""
    from blend.evals import metrics as M
    from blend.evals.methods import parse_method

    names = ("blend@0.15:v", "blend@0.15:combo")
    res = {"methods": {n: {"spec": parse_method(n).to_dict()} for n in names},
           "items": [item_json(30 + i, {"blend@0.15:v": {"kl": 0.1 * (i + 1)},
                                        "blend@0.15:combo": {"kl": None if i == 1 else 0.05}}) for i in range(4)]}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(res))
    assert research_summary.main([str(path), "--items", "30-99"]) == 0
    out = capsys.readouterr().out
    assert "`v@0.15` | 4 |" in out and "`combo@0.15` |" not in out
    assert "Left out, not on every item" in out and "`combo@0.15` (3 of 4)" in out
    (s,) = research_summary.summarise(research_summary.load_rows([path]))  # the harness's statistics
    kl = [0.1, 0.2, 0.3, 0.4]
    assert (s["mean"], s["median"], s["p90"], s["max"]) == (M.mean(kl), M.median(kl), M.percentile(kl, 90), 0.4)
    assert s["ci"] == M.bootstrap_ci(kl)
