"""The blend quality gate: checks, recording, fallback and force."""

import json
import time

import pytest

from blend import gate
from blend.divergence import kl_divergence
from blend.engine import Engine
from blend.errors import InvalidRequestError
from blend.policy import ReuseMode, ReusePolicy
from blend.report import ReuseClass
from conftest import make_docs


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBLEND_HOME", str(tmp_path))
    return tmp_path


def test_gate_checks_have_figures_and_mechanical_checks_pass_on_tiny(home):
    eng = Engine.load("tiny-llama", quality_gate=False)
    result = gate.run_gate(eng, items=2, progress=False)
    by = {c.name: c for c in result.checks}
    assert by[gate.CheckName.REFERENCE].passed and by[gate.CheckName.REFERENCE].figure <= 1e-4
    assert by[gate.CheckName.ROPE].passed and by[gate.CheckName.ROPE].figure <= 1e-5
    assert by[gate.CheckName.RATIO_ONE].passed
    assert by[gate.CheckName.FIDELITY_KL].figure >= 0.0
    assert 0.0 <= by[gate.CheckName.FIDELITY_TOP1].figure <= 1.0
    assert len(list(eng.store.keys(__import__("blend.keys").keys.Namespace.CANONICAL))) == 0  # private store


def test_the_gates_transformers_forward_holds_the_rope_tables_lock(home):
    """The reference forward calls the model's rotary module, which RopeTables shares: on dynamic-NTK
    and LongRoPE models it changes the module's state, and a table built on another thread meanwhile
    (a request beside the gate) rotated KV wrongly and stored it under exact keys."""
    eng = Engine.load("tiny-llama-rope-dynamic", quality_gate=False)
    rope, hf = eng.runner.rope, eng.runner.loaded.model
    seen = []
    hook = hf.register_forward_pre_hook(lambda *_: seen.append(rope._lock.locked()))
    try:
        gate.run_gate(eng, items=1, progress=False)
    finally:
        hook.remove()
    assert seen and all(seen)


def test_failed_gate_falls_back_unless_forced(home):
    eng = Engine.load("tiny-llama")
    bounds = gate.check_bounds(eng.dtype, eng.kv_dtype)
    figures = {n: 1.0 if n in gate.AT_LEAST else 0.0 for n in gate.CheckName} | {gate.CheckName.FIDELITY_KL: 3.0}
    failing = gate.GateResult(eng.model_name, eng.provenance.digest().hex(), tuple(  # a record holds every check
        gate.CheckResult.judged(n, figures[n], bounds[n], "test") for n in gate.CheckName))
    assert not failing.passed
    gate.record(eng, failing)
    prompt = eng.build_prompt("Which?", make_docs(3))
    ans = eng.generate(prompt, ReusePolicy.blend(), max_new_tokens=1)
    docs = [s.reuse_class for s in ans.report.segments if s.kind.value == "document"]
    assert docs == [ReuseClass.FALLBACK] * 3 and "quality gate" in ans.report.gate
    forced = eng.generate(prompt, ReusePolicy.blend(force=True), max_new_tokens=1)
    assert ReuseClass.FALLBACK not in [s.reuse_class for s in forced.report.segments]


def test_first_blend_request_runs_and_records_the_gate(home, capsys):
    eng = Engine.load("tiny-llama")
    assert gate.load_record(eng) is None
    eng.generate(eng.build_prompt("Which?", make_docs(3)), ReusePolicy.blend(), max_new_tokens=1)
    rec = gate.load_record(eng)
    assert rec is not None and rec.provenance_sha256 == eng.provenance.digest().hex()
    assert "running the quality gate" in capsys.readouterr().err
    data = json.loads(gate.gate_path(eng).read_text())
    assert {c["name"] for c in data["checks"]} == {n.value for n in gate.CheckName}


def test_kl_is_zero_for_equal_and_positive_otherwise():
    import torch

    a = torch.tensor([1.0, 2.0, 3.0])
    assert kl_divergence(a, a) == 0.0
    assert kl_divergence(a, torch.tensor([3.0, 2.0, 1.0])) > 0.5
    masked = torch.tensor([1.0, 2.0, float("-inf")])  # a token the reference masks: was a NaN in the gate
    assert kl_divergence(masked, torch.tensor([1.0, 2.0, 0.0])) > 0.0
    assert gate.kl_divergence is kl_divergence  # the gate measures as the evals that set its bounds


def test_the_gates_first_run_is_reported_apart_from_the_requests_ttft(home):
    eng = Engine.load("tiny-llama")
    prompt = eng.build_prompt("Which?", make_docs(3))
    t0 = time.perf_counter()
    first = eng.generate(prompt, ReusePolicy.blend(), max_new_tokens=1)
    wall = time.perf_counter() - t0
    t = first.report.timings
    assert first.report.gate_ran and t.gate_s > 0.0
    assert first.report.to_dict()["gate_ran"] is True and first.report.to_dict()["timings"]["gate_s"] == t.gate_s
    # the gate's seconds are not the request's: its TTFT is the call's time less (about) the gate's, however
    # loaded the machine is (a TTFT that included them would be the whole call's)
    assert t.ttft_s <= wall - 0.5 * t.gate_s and first.ttft_s <= wall - 0.5 * t.gate_s
    again = eng.generate(prompt, ReusePolicy.blend(), max_new_tokens=1)
    assert not again.report.gate_ran and again.report.timings.gate_s == 0.0


def test_the_streaming_apis_ttft_leaves_the_gates_first_run_out_too(home):
    """``kvblend ask`` and the server answer through blend.generation; its TTFT once counted the gate's
    one-off run while the printed report said "not in TTFT"."""
    from blend.generation import generate
    from blend.sampling import GenerationConfig

    eng = Engine.load("tiny-llama")
    done = generate(eng, eng.build_prompt("Which?", make_docs(3)), ReusePolicy.blend(), GenerationConfig(max_tokens=1))
    t = done.report.timings
    assert done.report.gate_ran and done.ttft_s < t.gate_s
    assert done.e2e_s >= t.gate_s  # wall time from the call still holds everything


def test_the_engine_consults_the_gate_object_it_was_given(home):
    from blend.engine import Engine as E

    class Refuse:
        calls = 0

        def verdict(self, engine):
            Refuse.calls += 1
            return gate.GateVerdict("refused by a test gate", 0.0)

    base = Engine.load("tiny-llama", quality_gate=False)
    eng = E(base.runner, base.config, gate=Refuse())
    prompt = eng.build_prompt("Which?", make_docs(3))
    ans = eng.generate(prompt, ReusePolicy.blend(), max_new_tokens=1)
    assert Refuse.calls == 1 and ans.report.gate == "refused by a test gate"
    assert [s.reuse_class for s in ans.report.segments if s.kind.value == "document"] == [ReuseClass.FALLBACK] * 3
    assert not eng.generate(prompt, ReusePolicy.blend(force=True), max_new_tokens=1).report.gate  # force skips it
    assert Refuse.calls == 1


def test_a_record_holds_only_for_the_policy_and_prompts_it_was_measured_under(home, monkeypatch):
    """A verdict measured on another blend policy (yesterday's defaults) or fewer prompts is not
    today's: the record's name carries the gate's fingerprint, so a change runs the gate again once."""
    eng = Engine.load("tiny-llama")
    before = gate.gate_fingerprint()
    assert gate.gate_fingerprint(3) != before
    gate.record(eng, gate.run_gate(eng, progress=False))
    assert gate.load_record(eng) is not None
    monkeypatch.setattr(gate, "GATE_RATIO", 0.3)  # the fidelity check would blend with another policy
    assert gate.gate_fingerprint() != before
    assert gate.load_record(eng) is None
    # the policy's description is what the fingerprint reads: a changed default temperature shows in it
    assert ReusePolicy.blend(reused_temperature=1.2).describe() != ReusePolicy.blend().describe()


def test_beyond_allows_ulps_of_the_magnitude_and_nothing_in_fp32():
    import torch

    from blend.kernels.tolerances import TOL

    bf16 = TOL[torch.bfloat16]
    row = torch.tensor([[12.0, 3.0, -0.5, 0.0]])
    one_ulp = torch.tensor([[12.0625, 3.0, -0.5, 0.0]])  # bf16 neighbours at 8-16 are 0.0625 apart
    assert gate.beyond(one_ulp, row, 0.0) == pytest.approx(0.0625)  # fp32's absolute bound sees it all
    assert gate.beyond(one_ulp, row, bf16.gate_rtol) <= 0  # two ulps of 12 cover it
    partner = torch.tensor([[12.0, 3.0, -0.5625, 0.0]])  # the small element of a row holding a 12
    assert gate.beyond(partner, row, bf16.gate_rtol) > 0  # elementwise: -0.5 allows only ~0.008
    assert gate.beyond(partner, row, bf16.gate_rtol, per_row=True) <= 0  # the row magnitude covers it
    wrong = torch.tensor([[10.0, 3.0, -0.5, 0.0]])  # a real error stays an error
    assert gate.beyond(wrong, row, bf16.gate_rtol, per_row=True) > bf16.logits


def test_a_bf16_engine_passes_the_mechanical_checks_and_records_apart(home):
    import torch

    eng = Engine.load("tiny-llama", dtype="bfloat16", quality_gate=False)
    result = gate.run_gate(eng, items=1, progress=False)
    by = {c.name: c for c in result.checks}
    assert all(by[n].passed for n in (gate.CheckName.REFERENCE, gate.CheckName.ROPE, gate.CheckName.RATIO_ONE)), \
        result.summary()
    assert "two ulps" in by[gate.CheckName.ROPE].detail
    assert gate.gate_fingerprint(dtype=torch.bfloat16) != gate.gate_fingerprint(dtype=torch.float32)


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16"])
def test_a_float32_engine_keeping_kv_in_16_bits_is_held_to_that_formats_bounds(home, kv_dtype):
    """Every stored row is rounded to the storage dtype: float32's absolute bounds refused such an engine, and
    every blend fell back although its fidelity passed."""
    import torch

    eng = Engine.load("tiny-llama", kv_dtype=kv_dtype, quality_gate=False)
    result = gate.run_gate(eng, items=1, progress=False)
    by = {c.name: c for c in result.checks}
    assert all(by[n].passed for n in (gate.CheckName.REFERENCE, gate.CheckName.ROPE, gate.CheckName.RATIO_ONE)), \
        result.summary()
    kv = getattr(torch, kv_dtype)
    assert gate.gate_tol(torch.float32, kv) == gate.TOL[kv] and gate.gate_tol(kv, torch.float32) == gate.TOL[kv]
    assert gate.gate_fingerprint(kv_dtype=kv) != gate.gate_fingerprint()  # measured under other bounds: apart
    assert gate.gate_fingerprint(kv_dtype=torch.float32) == gate.gate_fingerprint()  # float32 KV: records kept


def test_the_servers_first_blend_reports_the_gates_run_apart_from_its_ttft(home):
    """The scheduler consults the gate before the prefill: its run was thrown away, the report said the gate
    had not run, and the request's TTFT held the whole run."""
    from blend.sampling import GenerationConfig
    from blend.serve.config import SchedulerConfig
    from blend.serve.jobs import EventKind
    from blend.serve.scheduler import Scheduler

    eng = Engine.load("tiny-llama")
    sched = Scheduler(eng, SchedulerConfig(max_concurrency=1))
    sched.start()
    try:
        events, done = [], __import__("threading").Event()

        def sink(ev):
            events.append(ev)
            if ev.kind in (EventKind.DONE, EventKind.FAILED):
                done.set()

        sched.submit(eng.build_prompt("Which?", make_docs(3)), ReusePolicy.blend(), GenerationConfig(max_tokens=1),
                     sink)
        assert done.wait(120)
    finally:
        sched.close()
    started = next(e for e in events if e.kind is EventKind.STARTED)
    assert started.report.gate_ran and started.report.timings.gate_s > 0
    assert started.ttft_s < started.report.timings.gate_s  # the gate's seconds are not the request's


def test_two_first_blend_requests_at_once_run_the_gate_once(home, monkeypatch):
    import threading

    runs = []
    real = gate.run_gate
    monkeypatch.setattr(gate, "run_gate", lambda *a, **kw: (runs.append(1), real(*a, **kw))[1])
    eng = Engine.load("tiny-llama")
    prompt = eng.build_prompt("Which?", make_docs(3))
    threads = [threading.Thread(target=lambda: eng.generate(prompt, ReusePolicy.blend(), max_new_tokens=1))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert runs == [1]


def test_a_record_holds_only_for_the_calibration_prompts_it_was_measured_on(home, monkeypatch):
    """The fingerprint names the prompts, not only how many: a release that rewrites a calibration
    document or question measures again instead of trusting a verdict from other text."""
    from blend import calibration

    before = gate.gate_fingerprint()
    assert gate.gate_fingerprint() == before  # stable
    monkeypatch.setattr(calibration, "DOCUMENTS", (calibration.DOCUMENTS[0] + " It has a gift shop.",
                                                   *calibration.DOCUMENTS[1:]))
    assert gate.gate_fingerprint() != before
    monkeypatch.undo()
    questions = list(calibration.QUESTIONS)
    questions[0] = ("Who runs the Quayside Public Library?", questions[0][1])
    monkeypatch.setattr(calibration, "QUESTIONS", tuple(questions))
    assert gate.gate_fingerprint() != before


def test_a_record_that_cannot_be_written_warns_and_the_verdict_still_holds(home, monkeypatch, caplog):
    """A directory squatting on the record's path (or a read-only home) must not turn every blend
    request into a crash after the gate ran: the verdict is used, kept for the process, and the
    failure to record it is a warning."""
    import types

    from blend.keys import Provenance

    prov = Provenance(model_arch="m", weights_sha256="w", tokenizer_sha256="t", dtype="float32",
                      kv_dtype="float32", device_class="cpu", backend="b", rope="r")
    eng = types.SimpleNamespace(provenance=prov, dtype=__import__("torch").float32, kv_dtype=None, model_name="m")
    gate.gate_path(eng).mkdir(parents=True)  # not a file: unreadable as a record, and not replaceable
    checks = tuple(gate.CheckResult(n, True, 0.0, 1.0, "") for n in gate.CheckName)
    runs = []
    monkeypatch.setattr(gate, "run_gate", lambda e, progress=True: runs.append(1) or
                        gate.GateResult("m", prov.digest().hex(), checks))
    g = gate.QualityGate(progress=False)
    with caplog.at_level("WARNING"):
        first = g.verdict(eng)
    assert first.refused == "" and runs == [1]
    assert "could not record" in caplog.text and str(gate.gate_path(eng)) in caplog.text
    assert g.verdict(eng).refused == "" and runs == [1]  # measured once per process, not per request


def test_the_rope_check_compares_full_reuse_whatever_the_guard_says(home, monkeypatch):
    """Every document row re-positioned, none recomputed: under the default near-tie guard the check's first
    prompt (a near tie on a tiny model) was blended again at 0.3, and the check compared that pass's cache,
    whose candidate rows were computed fresh, not re-positioned."""
    eng = Engine.load("tiny-llama", quality_gate=False)
    seen, real = [], Engine.prefill

    def spy(self, prompt, policy, *a, **kw):
        out = real(self, prompt, policy, *a, **kw)
        seen.append((policy, out[2]))
        return out

    monkeypatch.setattr(Engine, "prefill", spy)
    gate.run_gate(eng, items=1, progress=False)
    rope = [report for policy, report in seen if policy.mode is ReuseMode.BLEND and policy.ratio == 0.0]
    assert len(rope) == 1 and rope[0].guard == "" and rope[0].recomputed_tokens == 0 and rope[0].ratio == 0.0


@pytest.mark.parametrize("items", [0, 7, -1, True, 2.0])
def test_a_count_of_calibration_prompts_the_gate_cannot_run_is_refused(home, items):
    """run_gate(items=0) failed with an IndexError deep in the checks; 7 ran six and recorded them as seven."""
    eng = Engine.load("tiny-llama", quality_gate=False)
    with pytest.raises(InvalidRequestError, match="items must be 1 to 6"):
        gate.run_gate(eng, items=items, progress=False)


def test_a_check_whose_blend_was_refused_fails_instead_of_passing_on_full_prefill(home):
    """A dynamic-NTK model past its original length (512 here) computes every calibration prompt (1.2-1.6k
    tokens) in one pass, blends included: the RoPE, ratio-1 and fidelity checks compared full prefill with
    itself and the gate passed, letting shorter prompts blend on a verdict that measured no blend."""
    eng = Engine.load("tiny-llama-rope-dynamic", quality_gate=False)
    result = gate.run_gate(eng, items=1, progress=False)
    by = {c.name: c for c in result.checks}
    assert by[gate.CheckName.REFERENCE].passed and not result.passed
    for name in (gate.CheckName.ROPE, gate.CheckName.RATIO_ONE, gate.CheckName.FIDELITY_KL,
                 gate.CheckName.FIDELITY_TOP1):
        assert not by[name].passed and "not measured, the blend was refused (dynamic-NTK" in by[name].detail
    gate.record(eng, result)
    again = gate.load_record(eng)  # NaN figures are written and read back as failed checks
    assert again is not None and not again.passed
