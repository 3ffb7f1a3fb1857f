"""What a request's report says: the policy it asked for (``policy``) and what produced its KV (``applied``).

A refused blend (the quality gate, a prompt under ``min_prompt_tokens``, dynamic NTK past its length) ran with
no reuse while its report named only the blend it asked for; ``gate`` alone said why. A blend with nothing to
re-position (no document, one, every document exact at its place) runs the exact path. And the quality gate,
which runs calibration prompts through the model on its first use, ran for blends it had nothing to refuse.
"""

from __future__ import annotations

import io
import threading

import httpx
import pytest
import torch

from _serve_util import TINY, one_torch_thread, running_server, tiny_serve_engine  # noqa: F401
from blend.cli import answer_json, print_report
from blend.engine import Engine
from blend.gate import GateVerdict
from blend.policy import ReuseMode, ReusePolicy
from blend.prompt import SegmentKind, bos_prompt
from blend.refusals import consults_gate
from blend.report import ReuseClass
from conftest import make_docs

REFUSED = "refused by a test gate"


class CountingGate:
    """A gate that refuses every blend it is asked about, and counts the questions (each one a first run)."""

    def __init__(self, refused: str = REFUSED) -> None:
        self.refused = refused
        self.calls = 0
        self._lock = threading.Lock()

    def verdict(self, engine) -> GateVerdict:
        with self._lock:
            self.calls += 1
        return GateVerdict(self.refused, 0.0)


def gated(base: Engine, gate: CountingGate, store=None) -> Engine:
    """An engine over ``base``'s weights that asks ``gate`` before blending."""
    return Engine(base.runner, base.config, store, gate)


def documents(report) -> list[ReuseClass]:
    return [s.reuse_class for s in report.segments if s.kind is SegmentKind.DOCUMENT]


# ---- 1. a refused blend says it ran without reuse ------------------------------------------------------------

def test_a_blend_the_gate_refused_reports_that_it_ran_without_reuse(tiny_engine):
    eng = gated(tiny_engine, CountingGate())
    prompt = eng.build_prompt("Which?", make_docs(3))
    asked = ReusePolicy.blend(ratio=0.2)
    ans = eng.generate(prompt, asked, max_new_tokens=1)
    rep = ans.report
    assert rep.gate == REFUSED and rep.applied is ReuseMode.NONE and rep.asked is ReuseMode.BLEND
    assert rep.policy.startswith("blend@0.2:probe:")  # what was asked, whole: its temperature too (a refused
    assert ":temp=1.05" in rep.policy  # blend's report dropped it, as if a blend had run and tempered nothing)
    d = rep.to_dict()
    assert d["applied"] == "none" and d["policy"] == rep.policy and d["gate"] == REFUSED and d["asked"] == "blend"
    assert list(d)[:3] == ["policy", "applied", "asked"]  # (asked added 2026-12-07: after the two before it)
    assert documents(rep) == [ReuseClass.FALLBACK] * 3 and rep.reused_tokens == 0
    plain = eng.generate(prompt, ReusePolicy.none(), max_new_tokens=1)
    assert torch.equal(ans.first_logits, plain.first_logits)  # what ran: no reuse, as it says
    assert plain.report.applied is plain.report.asked is ReuseMode.NONE and plain.report.policy == "none"
    assert answer_json(eng, ans)["report"]["applied"] == "none"  # kvblend ask --json
    out = io.StringIO()
    print_report(ans, out)
    assert f"policy: {rep.policy}   ran: none" in out.getvalue() and f"gate: {REFUSED}" in out.getvalue()


def test_a_blend_under_its_minimum_length_reports_that_it_ran_without_reuse(tiny_engine):
    prompt = tiny_engine.build_prompt("Which?", make_docs(2))
    rep = tiny_engine.generate(prompt, ReusePolicy.blend(min_prompt_tokens=len(prompt) + 1), max_new_tokens=1).report
    assert "min_prompt_tokens" in rep.gate and rep.applied is ReuseMode.NONE and rep.to_dict()["applied"] == "none"
    assert rep.policy.startswith("blend@")


def test_reuse_refused_past_a_dynamic_ntk_length_reports_none_under_any_mode(tiny_engine_factory):
    eng = tiny_engine_factory("tiny-llama-rope-dynamic")
    prompt = eng.build_prompt("Which?", make_docs(2, words=60))  # byte-level: ~900 tokens, past 512
    assert len(prompt) > eng.runner.rope.length_dependent_after
    for asked in (ReusePolicy.exact(), ReusePolicy.blend(force=True)):
        rep = eng.generate(prompt, asked, max_new_tokens=1).report
        assert "dynamic-NTK" in rep.gate and rep.applied is ReuseMode.NONE, asked
        assert rep.policy.startswith(asked.mode.value)


def test_requests_that_were_not_refused_report_what_produced_their_kv(tiny_engine):
    """``policy`` keeps its meaning; ``applied`` is the path: a blend that re-positioned documents ``blend``,
    one with nothing to re-position the exact path (bit for bit), ``exact``."""
    eng = tiny_engine
    three = eng.build_prompt("Which?", make_docs(3))
    exact = eng.generate(three, ReusePolicy.exact(), max_new_tokens=1)
    assert exact.report.applied is exact.report.asked is ReuseMode.EXACT and exact.report.policy == "exact"
    blend = eng.generate(three, ReusePolicy.blend(guard_margin=None), max_new_tokens=1)
    assert blend.report.applied is blend.report.asked is ReuseMode.BLEND
    assert blend.report.check_rows  # (cold: chunks computed, then blended)
    for prompt in (eng.build_prompt("Which?", []), eng.build_prompt("Which one?", make_docs(1))):
        asked = eng.generate(prompt, ReusePolicy.blend(), max_new_tokens=1)
        same = eng.generate(prompt, ReusePolicy.exact(), max_new_tokens=1)
        assert asked.report.applied is ReuseMode.EXACT and asked.report.policy.startswith("blend@")
        assert asked.report.asked is ReuseMode.BLEND and asked.report.to_dict()["asked"] == "blend"
        assert torch.equal(asked.first_logits, same.first_logits) and not asked.report.gate
    taken = eng.generate(three, ReusePolicy.blend(take_exact=True), max_new_tokens=1)  # the exact entries above
    assert taken.report.applied is ReuseMode.EXACT and documents(taken.report) == [ReuseClass.EXACT] * 3
    assert torch.equal(taken.first_logits, exact.first_logits)


def test_a_guard_that_recomputed_on_the_exact_path_says_so(tiny_engine):
    """A near tie recomputed at guard ratio 1 answers from the exact path over the preamble and first document;
    one recomputed at a lower ratio from a second blend."""
    prompt = tiny_engine.build_prompt("Which?", make_docs(3))
    exact_path = tiny_engine.generate(prompt, ReusePolicy.blend(guard_margin=1e9, guard_ratio=1.0), max_new_tokens=1)
    assert exact_path.report.guard and exact_path.report.applied is ReuseMode.EXACT
    again = tiny_engine.generate(prompt, ReusePolicy.blend(guard_margin=1e9, guard_ratio=0.3), max_new_tokens=1)
    assert again.report.guard and again.report.applied is ReuseMode.BLEND


def test_the_server_returns_what_ran_beside_what_was_asked():
    base = tiny_serve_engine()
    gate = CountingGate()
    eng = gated(base, gate, base.store)
    body = {"model": TINY, "messages": [{"role": "user", "content": "Which?"}], "documents": make_docs(2),
            "max_tokens": 2, "temperature": 0}
    with running_server(eng) as s:
        refused = httpx.post(s.url + "/v1/chat/completions", timeout=60, json={**body, "kvblend": {"reuse": "blend"}})
        exact = httpx.post(s.url + "/v1/chat/completions", timeout=60, json=body)
        streamed = httpx.post(s.url + "/v1/chat/completions", timeout=60,
                              json={**body, "stream": True, "kvblend": {"reuse": "blend"}})
    assert refused.status_code == 200, refused.text
    rep = refused.json()["kvblend"]["report"]
    assert rep["applied"] == "none" and rep["policy"].startswith("blend@") and rep["gate"] == REFUSED
    assert rep["asked"] == "blend" and exact.json()["kvblend"]["report"]["asked"] == "exact"
    assert refused.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert exact.json()["kvblend"]["report"]["applied"] == "exact"
    assert streamed.status_code == 200 and '"applied":"none"' in streamed.text
    assert gate.calls > 0


# ---- 2. the gate is asked only where it could refuse something -----------------------------------------------

def test_a_blend_with_no_document_never_runs_the_gate_and_reports_no_refusal(tiny_engine):
    gate = CountingGate()
    eng = gated(tiny_engine, gate)
    bare = eng.build_prompt("Which?", [])
    ans = eng.generate(bare, ReusePolicy.blend(), max_new_tokens=1)
    assert gate.calls == 0 and not ans.report.gate and not ans.report.gate_ran
    assert ans.report.applied is ReuseMode.EXACT and ReuseClass.FALLBACK not in [s.reuse_class for s in
                                                                                  ans.report.segments]
    assert not consults_gate(eng, bare, ReusePolicy.blend())
    with_docs = eng.build_prompt("Which?", make_docs(2))
    assert consults_gate(eng, with_docs, ReusePolicy.blend())  # the gate still runs where it must
    assert eng.generate(with_docs, ReusePolicy.blend(), max_new_tokens=1).report.gate == REFUSED
    assert gate.calls == 1
    assert not consults_gate(eng, with_docs, ReusePolicy.blend(force=True))  # force skips it
    assert not consults_gate(eng, with_docs, ReusePolicy.blend(min_prompt_tokens=10 ** 6))  # refused before it
    assert not consults_gate(eng, with_docs, ReusePolicy.exact())


def test_the_server_asks_the_gate_only_for_a_blend_it_could_refuse(one_torch_thread):  # noqa: F811
    """The scheduler asks the gate ahead of the prefill (to keep its run out of the request's TTFT): it asked
    it for every blend, an empty prompt's (which the engine refuses as one segment) and a document-less
    chat's included, and so ran the calibration prompts for requests the gate had nothing to decide."""
    base = tiny_serve_engine()
    gate = CountingGate()
    eng = gated(base, gate, base.store)
    blend = {"reuse": "blend"}
    with running_server(eng) as s:
        empty = httpx.post(s.url + "/v1/completions", timeout=60,
                           json={"model": TINY, "prompt": "", "max_tokens": 2, "temperature": 0, "kvblend": blend})
        bare = httpx.post(s.url + "/v1/chat/completions", timeout=60,
                          json={"model": TINY, "messages": [{"role": "user", "content": "Which?"}], "max_tokens": 2,
                                "temperature": 0, "kvblend": blend})
        assert empty.status_code == 200 and bare.status_code == 200, (empty.text, bare.text)
        assert gate.calls == 0
        assert empty.json()["kvblend"]["report"]["applied"] == "none"  # one segment: refused, said so
        assert bare.json()["kvblend"]["report"]["applied"] == "exact" and not bare.json()["kvblend"]["report"]["gate"]
        docs = httpx.post(s.url + "/v1/chat/completions", timeout=60,
                          json={"model": TINY, "messages": [{"role": "user", "content": "Which?"}], "max_tokens": 2,
                                "temperature": 0, "kvblend": blend, "documents": make_docs(2)})
    assert docs.json()["kvblend"]["report"]["gate"] == REFUSED and gate.calls > 0


def test_the_server_does_not_ask_the_gate_for_a_prompt_past_a_dynamic_ntk_length(tiny_engine_factory):
    base = tiny_engine_factory("tiny-llama-rope-dynamic")
    gate = CountingGate()
    eng = gated(base, gate)
    long = eng.build_prompt("Which?", make_docs(2, words=60))
    assert not consults_gate(eng, long, ReusePolicy.blend())  # the engine refuses it whatever the gate says
    assert consults_gate(eng, eng.build_prompt("Which?", make_docs(2, words=10)), ReusePolicy.blend())


def test_a_lone_segment_blend_is_refused_before_the_gate(tiny_engine):
    gate = CountingGate()
    eng = gated(tiny_engine, gate)
    prompt = bos_prompt(eng.tokenizer)
    rep = eng.generate(prompt, ReusePolicy.blend(), max_new_tokens=1).report
    assert gate.calls == 0 and "no document to blend" in rep.gate and rep.applied is ReuseMode.NONE
    assert not consults_gate(eng, prompt, ReusePolicy.blend())


@pytest.mark.parametrize("mode", [ReuseMode.EXACT, ReuseMode.NONE])
def test_exact_and_no_reuse_never_ask_the_gate(tiny_engine, mode):
    gate = CountingGate()
    eng = gated(tiny_engine, gate)
    rep = eng.generate(eng.build_prompt("Which?", make_docs(2)), ReusePolicy(mode=mode), max_new_tokens=1).report
    assert gate.calls == 0 and rep.applied is rep.asked is mode and not rep.gate


def test_the_chat_turn_line_names_what_ran_only_where_it_is_not_what_was_asked():
    from blend.chat_cli import turn_summary
    from blend.policy_types import ReuseMode
    from blend.report import ReuseReport

    exact, none = ReuseReport(policy="exact", applied=ReuseMode.EXACT, asked=ReuseMode.EXACT), \
        ReuseReport(policy="none", applied=ReuseMode.NONE, asked=ReuseMode.NONE)
    assert turn_summary(exact, 0).endswith("| exact]") and turn_summary(none, 0).endswith("| none]")
    blend = "blend@0.15:probe:check=1"
    for ran, line in [(ReuseMode.BLEND, f"| {blend}]"), (ReuseMode.EXACT, f"| {blend}, ran exact]"),
                      (ReuseMode.NONE, f"| {blend}, ran none]")]:
        assert turn_summary(ReuseReport(policy=blend, applied=ran, asked=ReuseMode.BLEND), 0).endswith(line)
