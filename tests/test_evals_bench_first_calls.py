"""Benches keep every first call (lazy packing, plans, pools, a new engine's first request) out of their timed
samples, and stop or say so where a request ran another path than the one they claim to time."""

from __future__ import annotations

import json
import time

import pytest

from blend.engine import Engine

# a first call's one-off cost, on a virtual clock: every ``time.perf_counter`` (which each bench and the engine's
# own TTFT read) jumps this far ahead at each first call instead of sleeping, so a timed sample that holds a
# first call is at least this long, whatever the machine's load, and the tests cost no waiting
ONE_OFF_S = 1000.0
LONG_ONE_OFF_S = ONE_OFF_S  # (kept for the tests' parameters: one cost serves all)


@pytest.fixture
def slow_first_calls(monkeypatch, request):
    """Each engine's first prefill under each policy pays a one-off cost, ONE_OFF_S or the test's indirect
    parameter (what lazy initialisation costs a real first call), on a virtual clock that only moves
    forward; returns the set of (engine, policy) pairs that paid it."""
    paid: set = set()
    real = Engine.prefill
    cost = getattr(request, "param", ONE_OFF_S)
    ahead = [0.0]
    clock = time.perf_counter
    monkeypatch.setattr(time, "perf_counter", lambda: clock() + ahead[0])

    def prefill(self, prompt, policy, *a, **kw):
        key = (id(self), policy)
        if key not in paid:
            paid.add(key)
            ahead[0] += cost
        return real(self, prompt, policy, *a, **kw)

    monkeypatch.setattr(Engine, "prefill", prefill)
    return paid


@pytest.mark.parametrize("slow_first_calls", [LONG_ONE_OFF_S], indirect=True)
def test_bench_tiers_times_no_engines_first_request(tmp_path, slow_first_calls):
    """The overlap-off engines got no warm-up (their first request was repeat 0's sample) and neither did the
    full prefill every ratio divides by."""
    from blend.evals import bench_tiers

    out = tmp_path / "tiers.json"
    assert bench_tiers.main(["--model", "tiny-llama", "--data", "synthetic:single", "--passages", "3",
                             "--repeats", "1", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert len(slow_first_calls) >= 5  # the full prefill's engine and four tier engines each paid once
    assert res["full_ttft_s"] < LONG_ONE_OFF_S and all(r["ttft_s"] < LONG_ONE_OFF_S for r in res["rows"])
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


def test_bench_prefill_exact_hits_divide_by_no_first_full_prefill(slow_first_calls):
    """The one-pass full prefill every exact-hit ratio divides by got no warm-up: with --repeats 1 (the
    published run's) the ratio's only denominator was its first call."""
    from blend.evals.bench_prefill import bench_exact_hit, bench_rag_hit

    hit = bench_exact_hit("tiny-llama", repeats=1, prefix_tokens=200)
    assert hit.full_s < ONE_OFF_S and hit.warm_s < ONE_OFF_S and hit.hot_s < ONE_OFF_S
    rag = bench_rag_hit("tiny-llama", "synthetic:single", range(0, 1), repeats=1, passages=2)
    assert 0 < rag.full_s < ONE_OFF_S


@pytest.mark.parametrize("slow_first_calls", [LONG_ONE_OFF_S], indirect=True)
def test_bench_prefill_first_document_times_no_first_call_and_loads_only_what_it_claims(slow_first_calls):
    """The case had no warm-up at all: each arm's first request (the first document's load included) was
    the first item's sample."""
    from blend.evals.bench_prefill import bench_first_document

    row = bench_first_document("tiny-llama", "synthetic:single", range(0, 1), repeats=1, passages=2)
    assert row.full_s < LONG_ONE_OFF_S and max(row.exact_ratio, row.preamble_only_ratio) < 5
    # three orders of two documents: the third repeats the second, whose whole prefix the exact arm stored
    with pytest.raises(RuntimeError, match="an order seen before"):
        bench_first_document("tiny-llama", "synthetic:single", range(0, 1), repeats=3, passages=2)


@pytest.mark.parametrize("slow_first_calls", [LONG_ONE_OFF_S], indirect=True)
def test_bench_prefill_follow_up_times_no_first_call(slow_first_calls):
    """The third turn's arms got no warm-up: the blend's first call, and the loader's, were item 0's samples."""
    from blend.evals.follow_up import bench_follow_up

    row = bench_follow_up("tiny-llama", "synthetic:single", range(0, 1), repeats=1, passages=2, answer_tokens=4)
    assert row.full_s < LONG_ONE_OFF_S
    assert max(row.exact_ratio, row.exact_documents_only_ratio, row.blend_ratio) < 5


@pytest.mark.parametrize("slow_first_calls", [LONG_ONE_OFF_S], indirect=True)
def test_bench_semantic_times_no_methods_first_call(slow_first_calls):
    """The warm-up ran full and stale only: the semantic method's first call (the donor path) and fresh's
    were the first item's samples, in a table of means."""
    from argparse import Namespace

    from blend.evals import bench_semantic as B
    from blend.evals.data import Item, load_items

    eng = Engine.load("tiny-llama", quality_gate=False, experimental_semantic=True)
    items = [Item(it.id, it.question, it.documents[:2], it.answers) for it in load_items("synthetic:single", 1, None)]
    vocab = sorted({w for it in items for d in it.documents for w in d.text.split(" ") if w.isalpha()})
    rows = B.run_quality(eng, items, Namespace(ratio=0.3, seed=0, max_new_tokens=1), vocab,
                         ["An extra sentence for the insert edit."])
    assert {r.method for r in rows} == set(B.METHODS) and all(r.ttft_s < LONG_ONE_OFF_S for r in rows)
