"""The research summary (evals/research_summary.py) never pools the tuning and validation splits unasked."""

from __future__ import annotations

import json

import pytest

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
