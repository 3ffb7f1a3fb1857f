"""Metric functions against hand-computed cases."""

import math

import numpy as np
import pytest
import torch

from blend.evals import metrics as M


def test_normalize_answer_squad_rules():
    assert M.normalize_answer("The  Tessel, Observatory!") == "tessel observatory"
    assert M.normalize_answer("An apple a day") == "apple day"
    assert M.normalize_answer("theatre") == "theatre"  # 'the' only as a word


def test_token_f1_hand_computed():
    # pred tokens: [paris, france]; gold: [paris]; common 1 -> P=1/2, R=1 -> F1=2/3
    assert M.token_f1("Paris, France", "Paris") == pytest.approx(2 / 3)
    # pred [new, york, city], gold [york, new] -> common 2, P=2/3, R=1 -> 0.8
    assert M.token_f1("New York City", "the York New") == pytest.approx(0.8)
    # repeated tokens count with multiplicity: pred [a1,a1], gold [a1] -> common 1, P=.5 R=1
    assert M.token_f1("x x", "x") == pytest.approx(2 / 3)
    assert M.token_f1("Berlin", "Paris") == 0.0
    assert M.token_f1("the", "a") == 1.0  # both normalise to nothing
    assert M.token_f1("", "Paris") == 0.0


def test_exact_match_and_best_over():
    assert M.exact_match("the Varnholm.", "varnholm") == 1.0
    assert M.exact_match("Varnholm city", "Varnholm") == 0.0
    assert M.best_over(M.token_f1, "Paris", ["Berlin", "Paris, France"]) == pytest.approx(2 / 3)
    with pytest.raises(ValueError):
        M.best_over(M.token_f1, "x", [])


def test_contains_answer():
    assert M.contains_answer("Mara Quill lives in Tarnow Vale.", "tarnow vale") == 1.0
    assert M.contains_answer("Mara lives in Tarnow.", "Tarnow Vale") == 0.0
    assert M.contains_answer("Vale Tarnow", "Tarnow Vale") == 0.0  # order matters
    assert M.best_over(M.contains_answer, "it is 4412", ["9981", "4412"]) == 1.0


def test_rouge_l_hand_computed():
    # pred [police, killed, gunman], gold [police, kill, gunman]: LCS=2, P=R=2/3 -> F=2/3
    assert M.rouge_l("police killed the gunman", "police kill the gunman") == pytest.approx(2 / 3)
    # pred [b, c, d, e], gold [c, e, f]: LCS=2 (c,e) -> P=1/2 R=2/3 -> F=4/7
    assert M.rouge_l("b c d e", "c e f") == pytest.approx(4 / 7)
    assert M.rouge_l("x y", "y x") == pytest.approx(0.5)  # LCS 1 of 2
    assert M.rouge_l("", "a b") == 0.0


def test_kl_divergence_hand_computed():
    # P = softmax([0, ln 3]) = [1/4, 3/4]; Q uniform [1/2, 1/2]
    p = torch.tensor([0.0, math.log(3.0)], dtype=torch.float64)  # ln 3 exact in fp64
    q = torch.tensor([5.0, 5.0])  # shift-invariant
    expected = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    assert M.kl_divergence(p, q) == pytest.approx(expected, rel=1e-12)
    assert M.kl_divergence(p, p + 7.0) == pytest.approx(0.0, abs=1e-15)
    # asymmetric
    assert M.kl_divergence(q, p) != pytest.approx(expected)


def test_kl_masked_reference_and_fp64():
    # P puts zero mass on the masked token: its term contributes 0, not nan
    p = torch.tensor([0.0, 0.0, float("-inf")])
    q = torch.tensor([0.0, 0.0, 0.0])
    assert M.kl_divergence(p, q) == pytest.approx(math.log(3 / 2), rel=1e-12)
    # fp32 logits that differ by less than fp32 resolution of probabilities still give a positive KL
    a = torch.tensor([0.0, 1e-4], dtype=torch.float32)
    b = torch.tensor([0.0, 0.0], dtype=torch.float32)
    assert 0 < M.kl_divergence(a, b) < 1e-8
    with pytest.raises(ValueError):
        M.kl_divergence(torch.zeros(3), torch.zeros(4))


def test_top1_and_teacher_forced():
    assert M.top1_agree(torch.tensor([0.0, 2.0, 1.0]), torch.tensor([0.0, 3.0, -1.0])) == 1.0
    assert M.top1_agree(torch.tensor([0.0, 2.0, 1.0]), torch.tensor([4.0, 3.0, -1.0])) == 0.0
    logits = torch.tensor(
        [[0.0, 5.0, 0.0], [5.0, 0.0, 0.0], [0.0, 0.0, 5.0], [9.0, 0.0, 0.0]]  # argmax 1, 0, 2, (0: ignored)
    )
    assert M.teacher_forced_agreement(logits, [1, 0, 2]) == 1.0
    assert M.teacher_forced_agreement(logits, [1, 1, 1]) == pytest.approx(1 / 3)
    with pytest.raises(ValueError):
        M.teacher_forced_agreement(logits, [])
    with pytest.raises(ValueError):
        M.teacher_forced_agreement(logits[:2], [1, 0, 2])


def test_mean_kl_rows():
    p = torch.tensor([[0.0, math.log(3.0)], [1.0, 1.0], [0.0, 50.0]])
    q = torch.tensor([[0.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    k0 = 0.25 * math.log(0.5) + 0.75 * math.log(1.5)
    assert M.mean_kl_rows(p, q, 2) == pytest.approx(k0 / 2)


def test_stats_and_bootstrap():
    assert M.mean([1.0, None, 3.0, float("nan")]) == 2.0
    assert M.median([3.0, 1.0, 2.0, 10.0]) == 2.5
    assert M.percentile([0.0, 10.0], 90) == pytest.approx(9.0)
    assert M.mean([]) is None and M.median([None]) is None
    vals = list(np.linspace(0, 1, 41))
    lo, hi = M.bootstrap_ci(vals, n=500, seed=3)
    assert lo < 0.5 < hi and hi - lo < 0.4
    assert M.bootstrap_ci(vals, n=500, seed=3) == (lo, hi)  # seeded: reproducible
    assert M.bootstrap_ci([2.0, 2.0, 2.0]) == (2.0, 2.0)
    assert M.bootstrap_ci([None]) is None


def test_a_nan_logit_makes_kl_nan_not_zero():
    import math as _math

    import torch as _torch

    from blend.evals.metrics import kl_divergence
    assert _math.isnan(kl_divergence(_torch.tensor([1.0, float("nan")]), _torch.tensor([0.5, 0.2])))
    assert _math.isnan(kl_divergence(_torch.tensor([1.0, 0.0]), _torch.tensor([float("nan"), 0.2])))


def test_non_finite_kls_make_the_kl_summary_null_not_better():
    """inf/NaN KLs are null in the rows; dropping them made a method whose logits broke look better."""
    from _eval_rows import item_row, method_row
    from blend.evals.aggregate import aggregate_method
    rows = [item_row(i, {"m": method_row(kl=k, top1=1.0)}) for i, k in enumerate((0.01, 0.02, None))]
    out = aggregate_method("m", rows, None, n_boot=10, seed=0)
    assert out["kl_nonfinite"] == 1 and out["kl"] is None and out["kl_max"] is None and out["n"] == 3
    fine = aggregate_method("m", rows[:2], None, n_boot=10, seed=0)
    assert fine["kl_nonfinite"] == 0 and abs(fine["kl"] - 0.015) < 1e-12


def test_a_non_finite_teacher_forced_kl_makes_its_mean_null_too():
    """tf_kl's mean dropped non-finite items silently, where kl's summary is nulled."""
    from _eval_rows import item_row, method_row
    from blend.evals.aggregate import aggregate_method
    rows = [item_row(i, {"m": method_row(kl=0.01, tf_kl=k, top1=1.0)}) for i, k in enumerate((0.01, 0.03, None))]
    out = aggregate_method("m", rows, None, n_boot=10, seed=0)
    assert out["tf_kl"] is None and out["tf_kl_nonfinite"] == 1 and out["kl"] == 0.01
    fine = aggregate_method("m", rows[:2], None, n_boot=10, seed=0)
    assert abs(fine["tf_kl"] - 0.02) < 1e-12 and fine["tf_kl_nonfinite"] == 0


def test_kl_cells_does_not_depend_on_where_a_nan_sits():
    assert M.kl_cells([0.1, math.nan, 0.2]) == M.kl_cells([math.nan, 0.1, 0.2]) == "– | – | – | – (1 not finite)"
    assert M.kl_cells([0.1, 0.2]).startswith("0.1500 | ")


def test_bench_bf16_does_not_call_items_past_99_validation():
    from blend.evals import bench_bf16

    row = {"index": 150, "tokens": 10, "methods": {"fp32 full": {"kl": 0.0, "top1": 1.0, "ttft_s": 1.0, "ratio": 1.0}}}
    md = bench_bf16.summarise({"rows": [row], "methods": ["fp32 full"], "threads": 1, "passages": 5})
    assert "validation" not in md


def test_kl_cells_gives_the_statistics_asked_for_in_their_order():
    vals = [0.4, 0.1, 0.2, 0.3]
    assert M.kl_cells(vals) == "0.2500 | 0.2500 | 0.3700 | 0.4000"  # mean, median (even: 0.2 and 0.3), p90, max
    assert M.kl_cells(vals, ("max", "mean")) == "0.4000 | 0.2500"
    assert M.kl_cells([math.inf, 0.1], ("mean", "p90", "max")) == "– | – | – (1 not finite)"


def test_the_committed_guard_widen_summary_takes_the_harness_p90():
    """docs/results/issue14/guard_widen/summarize.py took a nearest-rank p90 (its BENCHMARKS.md table's p90s
    were 0.0494 where the harness's linear p90 of the same rows is 0.0506); it uses metrics.percentile now."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "docs/results/issue14/guard_widen/summarize.py"
    if not path.is_file():
        pytest.skip("no docs/results in this checkout")
    spec = importlib.util.spec_from_file_location("guard_widen_summarize", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    xs = [0.5, 0.1, 0.4, 0.2, 0.3, 0.6]  # p90 linear: 0.55; nearest-rank: 0.6
    assert mod.q(xs, 0.9) == pytest.approx(M.percentile(xs, 90)) == pytest.approx(0.55)
    assert mod.q(xs, 0.5) == pytest.approx(M.median(xs)) == pytest.approx(0.35)
