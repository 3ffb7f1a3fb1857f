"""bench_ingest times each phase without the models' first calls in it."""

from __future__ import annotations

import json
import time

from blend.engine import Engine
from blend.retrieval.embedder import Embedder

ONE_OFF_S = 4.0  # above what the tiny corpus takes to embed on a busy 2-core machine (~1 s)


def _slow_first(monkeypatch, cls, name: str) -> None:
    real, paid = getattr(cls, name), set()

    def slow(self, *a, **kw):
        if id(self) not in paid:
            paid.add(id(self))
            time.sleep(ONE_OFF_S)
        return real(self, *a, **kw)

    monkeypatch.setattr(cls, name, slow)


def test_the_embed_and_kv_phases_time_no_first_call(tmp_path, monkeypatch):
    """The KV phase's per-chunk time is extrapolated to the whole corpus, so a first call's one-off cost in
    it came back multiplied by chunks / kv-chunks in the estimated ingest; the embed phase timed the
    embedder's first call too."""
    from blend.evals import bench_ingest

    _slow_first(monkeypatch, Engine, "precompute_chunks")
    _slow_first(monkeypatch, Embedder, "embed")
    out = tmp_path / "ingest.json"
    assert bench_ingest.main(["--model", "tiny-llama", "--chunks", "7", "--kv-chunks", "2", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["kv"]["s"] < ONE_OFF_S and res["embed"]["s"] < ONE_OFF_S
    assert len(res["environment"]["machine"]["load_average"]) == 3
