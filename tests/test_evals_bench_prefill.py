"""bench_prefill's reordered-documents case runs what it names (tiny model, synthetic questions)."""

from __future__ import annotations

from blend.evals.bench_prefill import bench_first_document


def test_first_document_case_times_the_three_paths_and_checks_the_reuse():
    row = bench_first_document("tiny-llama", "synthetic:single", range(0, 2), repeats=2, passages=2)
    assert row.items == 2 and row.full_s > 0 and row.first_doc_tokens > 0
    assert row.prompt_tokens > row.first_doc_tokens
    assert 0 < row.preamble_only_ratio and 0 < row.exact_ratio


def test_the_hit_ratio_is_the_median_of_each_repeats_own_ratio():
    from blend.evals.bench_prefill import HitRow

    row = HitRow(100, 90, cold_s=2.0, warm_s=0.2, hot_s=0.1, warm_ratios=(0.05, 0.3, 0.08), hot_ratios=(0.04, 0.06, 0.2))
    assert row.ratio == 0.08 and row.hot_ratio == 0.06  # not 0.2 / 2.0 = 0.1 (a ratio of medians)
    assert HitRow(100, 90, 2.0, 0.2, 0.1).ratio == 0.1  # rows without per-repeat ratios keep the old form


def test_exact_hit_case_profiles_hot_requests_when_asked(capsys):
    from blend.evals.bench_prefill import bench_exact_hit

    row = bench_exact_hit("tiny-llama", repeats=1, prefix_tokens=200, profile_rows=5)
    assert row.cached_tokens >= 200 and row.prompt_tokens > row.cached_tokens and row.warm_s > 0
    out = capsys.readouterr().out
    assert "hot exact hits (3 requests)" in out and "Self CPU" in out


def test_rag_hit_case_times_exact_hits_of_the_data_prompts():
    from blend.evals.bench_prefill import bench_rag_hit

    # the case raises unless warm and hot reuse every segment and equal cold bit for bit
    row = bench_rag_hit("tiny-llama", "synthetic:single", range(0, 2), repeats=1, passages=2)
    assert row.items == 2 and row.passages == 2 and row.cold_s > 0
    assert row.prompt_tokens > row.question_tokens > 0
    assert 0 < row.warm_ratio and 0 < row.hot_ratio


def test_follow_up_case_reuses_the_documents_exactly_and_blends_them_reordered():
    from blend.evals.follow_up import bench_follow_up

    row = bench_follow_up("tiny-llama", "synthetic:single", range(0, 2), repeats=2, passages=2)
    assert row.items == 2 and row.full_s > 0 and row.prompt_tokens > row.history_tokens > row.computed_tokens > 0
    # the case raises if the exact hit did not happen or was not bit-identical to the full prefill
    assert 0 < row.exact_ratio and 0 < row.exact_documents_only_ratio and 0 < row.blend_ratio
    assert 0 <= row.blend_kl_mean <= row.blend_kl_max
