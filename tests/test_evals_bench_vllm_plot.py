"""bench_vllm's figure (vllm.png) states what the runs measured: the concurrent round's client count, or
no concurrent bars where a run had none, and the runs' items and prompt length."""

from __future__ import annotations

import json

from blend import safeio
from blend.evals.bench_vllm import plot


def _run(path, items: str, concurrent: list[dict], tokens: int = 3000) -> None:
    rows = [dict(item=30, repeat=0, mode=m, tokens=tokens, ttft_s=1.0, ratio=r, kl=0.0, top1=1.0)
            for m, r in (("full", 1.0), ("kvblend-blend@0.15", 0.3))]
    path.write_text(json.dumps(dict(env=dict(items=items, data="../shared/data/musique_dev.json"), rows=rows,
                                    concurrent=concurrent)))


def _figure(monkeypatch, out):
    figures = []
    monkeypatch.setattr(safeio, "save_figure", lambda fig, path, **kw: figures.append(fig))
    assert plot(out) == out / "vllm.png"
    return figures[0].axes[0]


def test_the_concurrent_bars_say_how_many_clients_and_vanish_without_a_concurrent_round(tmp_path, monkeypatch):
    """The legend said "4 concurrent" whatever --concurrent was, also for a run without that round
    (docs/results/dec07_s24/vllm_bf16/vllm.png), whose missing ratios were drawn as zero-height bars."""
    _run(tmp_path / "kvblend.json", "30-39", [dict(mode="full", clients=8, ratio=1.0),
                                              dict(mode="kvblend-blend@0.15", clients=8, ratio=0.2)])
    ax = _figure(monkeypatch, tmp_path)
    labels = ax.get_legend_handles_labels()[1]
    assert "8 concurrent (the batch's wall time)" in labels and not any("4 concurrent" in x for x in labels)
    assert "items 30-39" in ax.get_title() and "median 3000 tokens" in ax.get_title()
    assert "musique_dev" in ax.get_title()
    _run(tmp_path / "kvblend.json", "30-39", [])  # --concurrent 0
    ax = _figure(monkeypatch, tmp_path)
    assert not any("concurrent" in label for label in ax.get_legend_handles_labels()[1])
    assert len(ax.patches) == 1  # the one-request bar alone, no zero-height stand-in


def test_the_table_says_what_served_each_timed_request_and_warns_of_a_blend_that_did_not_blend():
    """A blend the connector refused (another model config, a malformed request) or kvblend refused (its
    quality gate: ``applied`` none) is vLLM's or kvblend's full prefill, and was timed and tabled under the
    blend's name without a word; the guarded count also came from the untimed log-prob request."""
    from blend.evals.bench_vllm import mode_table, ran_as

    def row(mode, report, ratio=0.3):
        return dict(item=0, repeat=0, mode=mode, tokens=100, ttft_s=ratio, ratio=ratio, kl=0.01, top1=1.0,
                    report=report)

    blended = {"claim": "blend", "claimed_tokens": 90, "applied": "blend"}
    assert ran_as(blended) == "blend" and ran_as(None) == "vllm" and ran_as({"error": "blend refused"}) == "error"
    assert ran_as({**blended, "applied": "none"}) == "none" and ran_as({"claim": "exact"}) == "exact"
    ok = mode_table([row("full", None, 1.0), row("kvblend-blend@0.15", blended)], ["kvblend-blend@0.15"])
    assert "| blend 1 |" in ok[3] and not any("WARNING" in ln for ln in ok)
    assert any("KL p90 over fewer than 10" in ln for ln in ok)
    rows = [row("full", None, 1.0), row("kvblend-blend@0.15", blended),
            row("kvblend-blend@0.15", {"error": "blend refused: another model config"}, 1.0),
            row("kvblend-blend@0.15", {**blended, "applied": "none"}, 1.0)]
    table = mode_table(rows, ["kvblend-blend@0.15"])
    assert "| blend 1, error 1, none 1 |" in table[3]
    assert any(ln.startswith("WARNING: kvblend-blend@0.15: 2 of 3 timed requests were not blended") for ln in table)


def test_a_non_finite_kl_dashes_the_kl_cells_wherever_it_sits():
    """An inf KL (the method put no mass on full's token) was kept in the mean and max but dropped from the
    p90, and a NaN's effect on the max depended on where it sat; the cells are dashes with the count now,
    as every other KL table (metrics.kl_cells)."""
    import math

    from blend.evals.bench_vllm import mode_table

    def row(mode, kl):
        return dict(item=0, repeat=0, mode=mode, tokens=100, ttft_s=0.3, ratio=0.3, kl=kl, top1=1.0,
                    report={"claim": "blend", "claimed_tokens": 90, "applied": "blend"})

    for kls in ([0.1, math.inf, 0.2], [math.nan, 0.1, 0.2], [0.1, 0.2, math.nan]):
        table = mode_table([row("full", 0.0)] + [row("kvblend-blend@0.15", k) for k in kls], ["kvblend-blend@0.15"])
        assert "| – | – | – (1 not finite) |" in table[3]
    table = mode_table([row("full", 0.0)] + [row("kvblend-blend@0.15", k) for k in (0.1, 0.2, 0.4)],
                       ["kvblend-blend@0.15"])
    assert "| 0.2333 | 0.3600 | 0.4000 |" in table[3]  # mean, p90 (linear: 0.2 + 0.8 * 0.2), max
