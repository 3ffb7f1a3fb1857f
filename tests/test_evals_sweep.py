"""The first-token sweep's cached reference (evals/sweep.py)."""

from __future__ import annotations

import torch

from blend.evals.sweep import SweepRow, reference_logits, split_of, summarise
from blend.policy import ReusePolicy
from tests.conftest import make_docs


def test_the_reference_is_computed_once_and_a_corrupt_file_is_recomputed(tiny_engine, tmp_path):
    prompt = tiny_engine.build_prompt("Which one?", make_docs(3))
    first = reference_logits(tiny_engine, prompt, tmp_path)
    files = list(tmp_path.glob("*.pt"))
    assert len(files) == 1
    want, _, _ = tiny_engine.prefill(prompt, ReusePolicy.none())
    assert torch.equal(first, want)
    assert torch.equal(reference_logits(tiny_engine, prompt, tmp_path), first)  # read back
    files[0].write_bytes(b"not a tensor")
    assert torch.equal(reference_logits(tiny_engine, prompt, tmp_path), first)  # recomputed, rewritten
    other = tiny_engine.build_prompt("Which two?", make_docs(3))
    reference_logits(tiny_engine, other, tmp_path)
    assert len(list(tmp_path.glob("*.pt"))) == 2  # another prompt, another key


def test_the_summary_splits_items_and_counts_wins():
    rows = [SweepRow(i, m, kl, 1.0, 10.0, 0.15, 100) for i in (0, 1, 30)
            for m, kl in (("a", 0.2), ("b", 0.1 if i else 0.3))]
    text = summarise(rows, ["a", "b"])
    assert split_of(0) == "tuning" and split_of(30) == "validation" and split_of(120) == "other"
    assert "### tuning: 2 items (0-1)" in text and "### validation: 1 items (30-30)" in text
    tuning = text.split("### validation")[0]
    assert "| b | 0.2000 |" in tuning and "| 1/2 |" in tuning


def test_the_summary_gives_ttft_ratios_when_full_prefill_was_timed():
    rows = [SweepRow(i, "a", 0.1, 1.0, ms, 0.15, 100, full_ms=1000.0) for i, ms in ((0, 200.0), (1, 300.0), (2, 1300.0))]
    text = summarise(rows, ["a"])
    assert "TTFT ratio median | mean | p90 |" in text
    assert "| 0.300 | 0.600 | 1.300 |" in text  # median, mean, p90 of 0.2, 0.3, 1.3
    assert "TTFT ratio" not in summarise([SweepRow(0, "a", 0.1, 1.0, 5.0, 0.15, 100)], ["a"])
