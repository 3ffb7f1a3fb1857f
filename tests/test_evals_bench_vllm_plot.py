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
