"""Benches keep every first call (lazy packing, plans, pools, a new engine's first request) out of their timed
samples, and stop or say so where a request ran another path than the one they claim to time."""

from __future__ import annotations

import json
import time

import pytest

from blend.engine import Engine

ONE_OFF_S = 0.4  # far above any tiny-model request


@pytest.fixture
def slow_first_calls(monkeypatch):
    """Each engine's first prefill under each policy pays a one-off ONE_OFF_S (what lazy initialisation
    costs a real first call); returns the set of (engine, policy) pairs that paid it."""
    paid: set = set()
    real = Engine.prefill

    def prefill(self, prompt, policy, *a, **kw):
        key = (id(self), policy)
        if key not in paid:
            paid.add(key)
            time.sleep(ONE_OFF_S)
        return real(self, prompt, policy, *a, **kw)

    monkeypatch.setattr(Engine, "prefill", prefill)
    return paid


def test_bench_tiers_times_no_engines_first_request(tmp_path, slow_first_calls):
    """The overlap-off engines got no warm-up (their first request was repeat 0's sample) and neither did the
    full prefill every ratio divides by."""
    from blend.evals import bench_tiers

    out = tmp_path / "tiers.json"
    assert bench_tiers.main(["--model", "tiny-llama", "--data", "synthetic:single", "--passages", "3",
                             "--repeats", "1", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert len(slow_first_calls) >= 5  # the full prefill's engine and four tier engines each paid once
    assert res["full_ttft_s"] < ONE_OFF_S and all(r["ttft_s"] < ONE_OFF_S for r in res["rows"])
    assert {(r["tier"], r["overlap"]) for r in res["rows"]} == {(t, o) for t in ("memory", "disk") for o in (1, 0)}
    assert res["threads"] >= 1 and "machine" in res["environment"]


def test_bench_tiers_stops_when_a_request_did_not_blend(tmp_path, monkeypatch):
    """A blend refused (the quality gate, a dynamic-NTK model past its trained length) is a full prefill: it
    loads nothing from the tier it was meant to time."""
    import blend.engine
    from blend.evals import bench_tiers
    from blend.refusals import Refusal

    monkeypatch.setattr(blend.engine, "refusal_for", lambda engine, prompt, policy: Refusal("refused for the test"))
    with pytest.raises(RuntimeError, match="ran none, not a blend"):
        bench_tiers.main(["--model", "tiny-llama", "--data", "synthetic:single", "--passages", "3", "--repeats", "1"])
