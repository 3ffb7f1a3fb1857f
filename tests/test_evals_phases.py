"""The phase clock: every phase of a prefill timed, nothing left patched, the numbers unchanged."""

from __future__ import annotations

import json

import torch

import blend.blend_plan as blend_plan
import blend.blending as blending
import blend.model as model
from blend.evals.phases import Phase, PhaseClock, Work, causal_pairs, visible_pairs, work_floor
from blend.policy import ReusePolicy
from conftest import make_docs


def test_the_clock_times_a_blend_by_phase_and_restores_what_it_wrapped(tiny_engine):
    prompt = tiny_engine.build_prompt("what is the third word?", make_docs(3, words=30))
    policy = ReusePolicy.blend(ratio=0.3)
    tiny_engine.precompute(prompt, policy)
    plain = tiny_engine.generate(prompt, policy, max_new_tokens=1)
    originals = (model.layer_forward, model.mlp_block, blend_plan.rope_rows, blending.run_probe)
    with PhaseClock(policy.check_layers[0]) as clock:
        clocked = tiny_engine.generate(prompt, policy, max_new_tokens=1)
    assert (model.layer_forward, model.mlp_block, blend_plan.rope_rows, blending.run_probe) == originals
    assert torch.equal(plain.first_logits, clocked.first_logits)  # timing changes no number
    phases = clock.times.with_remainder(clocked.ttft_s)
    for p in (Phase.LOOKUP, Phase.EARLY_LAYERS, Phase.CHECK, Phase.ROPE, Phase.ATTENTION, Phase.MLP, Phase.LOGITS):
        assert phases[p] > 0, p
    assert abs(sum(phases.values()) - clocked.ttft_s) < 1e-9
    assert sum(v for p, v in phases.items() if p is not Phase.OTHER) <= clocked.ttft_s


def test_stored_rows_loaded_for_an_exact_hit_are_lookup_time(tiny_engine, monkeypatch):
    import time

    prompt = tiny_engine.build_prompt("q?", make_docs(3, words=20))
    tiny_engine.generate(prompt, ReusePolicy.exact(), max_new_tokens=1)  # stores the documents
    warm = tiny_engine.with_store(tiny_engine.store)  # no hot prefix: the hit loads its stored rows
    load_many = model.ModelRunner.load_many

    def slow_load_many(self, cache, segs):  # every load, however it is reached, takes 50 ms more
        time.sleep(0.05)
        return load_many(self, cache, segs)

    monkeypatch.setattr(model.ModelRunner, "load_many", slow_load_many)
    with PhaseClock(None) as clock:
        ans = warm.generate(prompt, ReusePolicy.exact(), max_new_tokens=1)
    assert ans.report.segments[0].reuse_class.value == "exact"
    t = clock.times.with_remainder(ans.ttft_s)
    assert t[Phase.LOOKUP] >= 0.05 and t[Phase.OTHER] < 0.05


def test_full_prefill_has_no_check_phase(tiny_engine):
    prompt = tiny_engine.build_prompt("q?", make_docs(2, words=20))
    with PhaseClock(None) as clock:
        ans = tiny_engine.generate(prompt, ReusePolicy.none(), max_new_tokens=1)
    t = clock.times.with_remainder(ans.ttft_s)
    assert t[Phase.CHECK] == 0 and t[Phase.EARLY_LAYERS] == 0
    assert t[Phase.ATTENTION] > 0 and t[Phase.MLP] > 0 and t[Phase.PROJECTIONS] > 0


def test_bench_phases_writes_a_table_a_plot_and_the_fixed_overhead(tmp_path):
    from blend.evals import bench_phases

    out = tmp_path / "ph"
    assert bench_phases.main(["--model", "tiny-llama", "--data", "synthetic:single", "--items", "0-1",
                              "--sizes", "600", "--repeats", "1", "--methods", "full,reuse,blend@0.3",
                              "--out", str(out)]) == 0
    res = json.loads((out / "phases.json").read_text())
    assert [r["method"] for r in res["rows"]] == ["full", "reuse", "blend@0.3"]
    full, reuse, blend = res["rows"]
    assert full["ratio"] == 1.0 and 0 < reuse["ratio"] and 0 < blend["ratio"]
    assert blend["phases"][Phase.CHECK.value] > 0 and full["phases"][Phase.CHECK.value] == 0
    assert set(res["fixed_overhead_s"]) == {"600"} and set(res["exact_docs_overhead_s"]) == {"600"}
    assert set(res["exact_docs_hot_overhead_s"]) == {"600"}
    md = (out / "phases.md").read_text()
    assert "documents that are all exact hits, loaded from the store" in md and "hot-prefix cache" in md
    assert (out / "phases.png").stat().st_size > 1000
    assert "| 600 | blend@0.3 |" in (out / "phases.md").read_text()
    assert full["pairs_share"] == 1.0 and full["rows_share"] == 1.0 and abs(full["floor"] - 1.0) < 1e-12
    # (the tiny model's few layers: a blend there does more work than the full prefill, its probe included)
    assert 0 < reuse["rows_share"] < 1 and reuse["rows_share"] < blend["rows_share"] and 0 < reuse["floor"] < 1
    assert "| 600 | blend@0.3 | " in (out / "phases.md").read_text().split("work floor")[1]
    # two samples per row: the p90 column is an interpolated max, and the table says so
    assert "A p90 of fewer than 10 samples" in md
    machine = res["meta"]["environment"]["machine"]  # what else ran: the load average beside the threads
    assert len(machine["load_average"]) == 3 and machine["torch_threads"] == res["meta"]["threads"]


def test_bench_phases_stops_when_a_blend_did_not_blend(tmp_path, monkeypatch):
    """A blend refused (a dynamic-NTK model past its trained length, min_prompt_tokens) is a full prefill;
    bench_phases timed it as the blend, its ratio near 1 and its phases a full prefill's, without a word."""
    import pytest

    import blend.engine
    from blend.evals import bench_phases
    from blend.refusals import Refusal

    real = blend.engine.refusal_for
    monkeypatch.setattr(blend.engine, "refusal_for", lambda engine, prompt, policy: (
        Refusal("refused for the test") if policy.ratio == 0.3 and policy.mode.value == "blend"
        else real(engine, prompt, policy)))
    with pytest.raises(RuntimeError, match="blend@0.3 ran none, not a blend"):
        bench_phases.main(["--model", "tiny-llama", "--data", "synthetic:single", "--items", "0-0", "--sizes", "600",
                           "--repeats", "1", "--methods", "full,blend@0.3", "--out", str(tmp_path / "ph")])


def test_bench_bf16_scores_against_fp32_full_prefill():
    from blend.evals import bench_bf16

    res = bench_bf16.run("tiny-llama", "synthetic:single", [0, 1], 2, [0.3], repeats=2)
    assert res["repeats"] == 2 and set(res["gemm"]) == {"float32", "bfloat16"}
    for row in res["rows"]:
        m = row["methods"]
        assert m["fp32 full"]["kl"] == 0.0 and m["fp32 full"]["ratio"] == 1.0
        assert 0.0 < m["bf16 full"]["kl"] < 0.05  # bf16 rounding, not a different model
    assert "| bf16 blend@0.3 |" in bench_bf16.summarise(res) and "2 rounds" in bench_bf16.summarise(res)
    assert bench_bf16._methods([0.3])["bf16 reuse"][1].guard_margin is None  # the floor is never guarded
    assert len(res["environment"]["machine"]["load_average"]) == 3


def test_bench_bf16_stops_when_a_blend_did_not_blend(monkeypatch):
    """A refused blend (a full prefill) was timed and scored as the bf16 or fp32 blend."""
    import pytest

    import blend.engine
    from blend.evals import bench_bf16
    from blend.refusals import Refusal

    monkeypatch.setattr(blend.engine, "refusal_for", lambda engine, prompt, policy: Refusal("refused for the test"))
    with pytest.raises(RuntimeError, match="ran none, not a blend"):
        bench_bf16.run("tiny-llama", "synthetic:single", [0], 2, [0.3], repeats=1)


def test_the_clock_counts_a_full_prefills_work_exactly(tiny_engine):
    """Every segment of the exact schedule attends to every earlier row and itself: T (T + 1) / 2 pairs and T
    rows per layer, whatever the segment boundaries."""
    prompt = tiny_engine.build_prompt("what is the third word?", make_docs(3, words=30))
    t, layers = len(prompt), tiny_engine.dims.num_layers
    with PhaseClock(None) as clock:
        tiny_engine.generate(prompt, ReusePolicy.none(), max_new_tokens=1)
    assert clock.work == Work(attention_pairs=layers * t * (t + 1) // 2, layer_rows=layers * t)
    assert clock.work.share_of(clock.work) == (1.0, 1.0)


def test_the_clock_counts_full_reuse_as_the_questions_rows_only(tiny_engine):
    prompt = tiny_engine.build_prompt("what is the third word?", make_docs(3, words=30))
    policy = ReusePolicy.blend(ratio=0.0, guard_margin=None)  # (a guarded one may recompute at 0.3)
    tiny_engine.precompute(prompt, policy)
    tiny_engine.generate(prompt, policy, max_new_tokens=1)
    t, nq, layers = len(prompt), len(prompt.question), tiny_engine.dims.num_layers
    with PhaseClock(None) as clock:
        tiny_engine.generate(prompt, policy, max_new_tokens=1)
    assert clock.work == Work(attention_pairs=layers * causal_pairs(nq, t), layer_rows=layers * nq)


def test_a_blends_work_counts_the_probe_and_every_recomputed_row(tiny_engine):
    prompt = tiny_engine.build_prompt("what is the third word?", make_docs(3, words=30))
    policy = ReusePolicy.blend(ratio=0.3, guard_margin=None)  # (random weights: the guard would recompute)
    tiny_engine.precompute(prompt, policy)
    tiny_engine.generate(prompt, policy, max_new_tokens=1)
    with PhaseClock(None) as full:
        tiny_engine.generate(prompt, ReusePolicy.none(), max_new_tokens=1)
    with PhaseClock(policy.check_layers[0]) as clock:
        tiny_engine.generate(prompt, policy, max_new_tokens=1)
    pairs, rows = clock.work.share_of(full.work)
    nq, layers = len(prompt.question), tiny_engine.dims.num_layers
    assert layers * nq < clock.work.layer_rows < full.work.layer_rows  # the question twice (probe), some documents
    assert 0.0 < pairs < 1.0 and 0.0 < rows < 1.0


def test_pair_counts_and_the_work_floor():
    assert causal_pairs(3, 3) == 6 and causal_pairs(2, 5) == 2 * 3 + 3 and causal_pairs(0, 4) == 0
    k_pos = torch.tensor([4, 0, 2, 1, 3])  # any order
    assert visible_pairs(torch.tensor([0, 2, 9]), k_pos) == 1 + 3 + 5
    assert visible_pairs(torch.tensor([-1]), k_pos) == 0
    assert work_floor(1.0, 1.0, 0.6) == 1.0
    assert abs(work_floor(0.25, 0.15, 0.6) - (0.25 * 0.6 + 0.15 * 0.4)) < 1e-12


def test_the_phases_plot_labels_each_bar_legibly_and_shows_a_floor_over_the_methods_ttft(tmp_path, monkeypatch):
    """phases.png printed `blend@0.15:attn=bf16:lin=bf16` on one line under each bar, so neighbouring labels ran
    into each other; and a floor over 110% of a bar's TTFT (a bf16 method beats the fp32 full prefill's
    speed) fell outside the axes, so such bars looked as if they had no floor."""
    from blend import safeio
    from blend.evals.bench_phases import PhaseRow, write_plot

    phases = {ph.value: 0.01 for ph in Phase}
    rows = [PhaseRow("3k", "full", 3000, 1.0, 1.0, phases),
            PhaseRow("3k", "blend@0.15:attn=bf16:lin=bf16", 3000, 0.12, 0.12, phases, floor=0.2)]
    figures = []
    monkeypatch.setattr(safeio, "save_figure", lambda fig, path, **kw: figures.append(fig))
    write_plot(rows, tmp_path / "phases.png")
    ax = figures[0].axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["3k\nfull", "3k\nblend@0.15\nattn=bf16\nlin=bf16"]
    assert ax.get_ylim()[1] > 100 * 0.2 / 0.12  # the floor line (167% of its TTFT) is inside the axes
