"""A few invariants on the real SmolLM2-135M (fp32), converted once and cached."""

import pytest
import torch

from blend.calibration import calibration_items
from blend.policy import ReuseMode, ReusePolicy
from blend.report import ReuseClass
from blend.store.memory import MemoryStore

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def prompt(real_engine):
    item = calibration_items(1)[0]
    return real_engine.build_prompt(item.question, item.documents)


def test_real_logits_equal_transformers(real_engine, prompt):
    with torch.inference_mode():
        ref = real_engine.runner.loaded.model(torch.tensor([prompt.token_ids])).logits[0, -1].float()
    ans = real_engine.generate(prompt, ReusePolicy.none(), max_new_tokens=1)
    assert (ans.first_logits - ref).abs().max() <= 1e-3


def test_real_greedy_matches_transformers_generate(real_engine, prompt):
    hf = real_engine.runner.loaded.model
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt.token_ids]), max_new_tokens=16, do_sample=False,
                          eos_token_id=sorted(real_engine.eos_ids), pad_token_id=2)
    want = [t for t in out[0, len(prompt):].tolist() if t not in real_engine.eos_ids]
    got = real_engine.generate(prompt, ReusePolicy.none(), max_new_tokens=16, stop_at_newline=False)
    assert got.token_ids == want
    assert "Marisol Ortega" in got.text


@pytest.fixture
def fresh_engine(real_engine):
    """The real model's weights over an empty store of its own (no gate): the session engine's store
    holds whatever earlier tests ran, and an exact chain stored there turns a later blend of the same
    prompt into the all-documents-exact path, which never blends."""
    return real_engine.with_store(MemoryStore())


def test_real_cold_equals_warm_exact_and_blend(real_engine, prompt):
    for policy, warm_docs in ((ReusePolicy.exact(), [ReuseClass.EXACT] * len(prompt.documents)),
                              (ReusePolicy.blend(ratio=0.15, force=True),
                               [ReuseClass.EXACT] + [ReuseClass.BLENDED] * (len(prompt.documents) - 1))):
        engine = real_engine.with_store(MemoryStore())  # each policy cold on its own empty store
        cold = engine.generate(prompt, policy, max_new_tokens=4)
        warm = engine.generate(prompt, policy, max_new_tokens=4)
        assert torch.equal(cold.first_logits, warm.first_logits)
        assert cold.token_ids == warm.token_ids
        assert ReuseClass.COMPUTED in [s.reuse_class for s in cold.report.segments[:-1]], policy.describe()
        assert [s.reuse_class for s in warm.report.segments[:-1]] == [ReuseClass.EXACT, *warm_docs], policy.describe()
        if policy.mode is ReuseMode.BLEND:  # really blended: rows of the re-positioned documents recomputed
            assert warm.report.recomputed_tokens > 0
            assert warm.report.recomputed_tokens == cold.report.recomputed_tokens
        else:
            assert warm.report.recomputed_tokens == 0


def test_real_ratio_one_equals_full_prefill(fresh_engine, prompt):
    full = fresh_engine.generate(prompt, ReusePolicy.none(), max_new_tokens=1)
    for _ in ("cold", "warm"):
        one = fresh_engine.generate(prompt, ReusePolicy.blend(ratio=1.0, force=True), max_new_tokens=1)
        assert (one.first_logits - full.first_logits).abs().max() <= 1e-3
    rows = one.report.segments
    # warm: the first document exact at its place, every later one blended with all its rows recomputed
    blended = [ReuseClass.BLENDED] * (len(prompt.documents) - 1)
    assert [s.reuse_class for s in rows[1:-1]] == [ReuseClass.EXACT, *blended]
    assert all(s.recomputed == s.tokens for s in rows[2:-1])
    assert one.report.recomputed_tokens == sum(len(d) for d in prompt.documents[1:]) > 0


def test_real_conversation_turns_are_found_and_reused_bit_for_bit(real_engine):
    """SmolLM2's chat template and tokenizer are append-only across turns, so every earlier turn's
    prompt ends inside the question segment and a third turn reuses both, bit-identical to no reuse."""
    from blend.prompt import Role, SegmentKind, Turn

    item = calibration_items(1)[0]
    history = (Turn(Role.USER, item.question), Turn(Role.ASSISTANT, "Marisol Ortega."),
               Turn(Role.USER, "Which document says so?"), Turn(Role.ASSISTANT, "The second one, about the lighthouse."))
    third = real_engine.build_prompt("Quote it.", item.documents, history=history)
    assert len(third.question.turn_ends) == 2
    second = real_engine.build_prompt("Which document says so?", item.documents, history=history[:2])
    assert third.token_ids[:len(second)] == second.token_ids
    real_engine.generate(second, ReusePolicy.exact(), max_new_tokens=1)  # stores turn 1's and turn 2's parts
    warm = real_engine.generate(third, ReusePolicy.exact(), max_new_tokens=4)
    assert [(s.kind, s.reuse_class) for s in warm.report.segments[-3:]] == [
        (SegmentKind.TURN, ReuseClass.EXACT), (SegmentKind.TURN, ReuseClass.EXACT),
        (SegmentKind.QUESTION, ReuseClass.COMPUTED)]
    none = real_engine.generate(third, ReusePolicy.none(), max_new_tokens=4)
    assert torch.equal(warm.first_logits, none.first_logits) and warm.token_ids == none.token_ids


def test_real_bf16_engine_passes_the_gates_mechanical_checks(tmp_path, monkeypatch):
    """bf16 values are known to an ulp of their magnitude: SmolLM2's bf16 K (up to ~10) and logits (~30)
    differ from a full prefill's and transformers' by one to a few ulps. With absolute bounds the gate
    refused every blend of a bf16 engine (rope 0.0625 > 0.02, reference 0.37 > 0.3)."""
    from blend import gate
    from blend.engine import Engine
    from blend.store.memory import MemoryStore

    monkeypatch.setenv("KVBLEND_HOME", str(tmp_path))
    eng = Engine.load("smollm2-135m", dtype="bfloat16", store=MemoryStore(), quality_gate=False)
    by = {c.name: c for c in gate.run_gate(eng, items=1, progress=False).checks}
    for name in (gate.CheckName.REFERENCE, gate.CheckName.ROPE, gate.CheckName.RATIO_ONE):
        assert by[name].passed, by[name]
