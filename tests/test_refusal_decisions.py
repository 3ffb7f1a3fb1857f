"""How often, and for which blends, a request's refusal is decided (blend.refusals).

- The server's scheduler decided a request's refusal ahead of its prefill (to run the gate's first run
  outside it), then the engine decided it again: the rules ran twice for every blend request. The
  scheduler now hands its decision to the prefill.
- A blend of one document asked the quality gate although it runs the exact path whatever the gate says
  (the document sits where its canonical KV was computed: that KV is its exact KV). The gate's first run
  (seconds; minutes on a real model) was paid for nothing, and a failed gate computed the same logits
  with no reuse at all and reported the document as a quality fallback.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
from fastapi.testclient import TestClient

import blend.refusals
from _serve_util import TINY, one_torch_thread, tiny_serve_engine  # noqa: F401
from blend.engine import Engine
from blend.gate import GateVerdict
from blend.policy import ReuseMode, ReusePolicy
from blend.prompt import SegmentKind
from blend.report import ReuseClass
from blend.serve.app import create_app
from blend.serve.config import ServeConfig
from blend.store.memory import MemoryStore
from conftest import make_docs

REFUSED = "refused by a test gate"


class Gate:
    """A gate with a fixed verdict that counts the questions it is asked."""

    def __init__(self, refused: str = "") -> None:
        self.refused = refused
        self.calls = 0
        self._lock = threading.Lock()

    def verdict(self, engine) -> GateVerdict:
        with self._lock:
            self.calls += 1
        return GateVerdict(self.refused, 0.0)


def gated(base: Engine, gate: Gate, store=None) -> Engine:
    return Engine(base.runner, base.config, store if store is not None else MemoryStore(), gate)


# ---- 1. the rules run once per server request ----------------------------------------------------------------

@pytest.fixture
def counted_rules(monkeypatch) -> list[int]:
    """Every call of blend.refusals.rule_refusal, counted (the engine's and the scheduler's callers read
    the module's name)."""
    calls = [0]
    real = blend.refusals.rule_refusal

    def counting(*args, **kw):
        calls[0] += 1
        return real(*args, **kw)

    monkeypatch.setattr(blend.refusals, "rule_refusal", counting)
    return calls


BLEND = {"reuse": "blend", "ratio": 0.3, "guard_margin": None}  # unguarded: a near tie is not re-run as exact
CHAT = {"model": TINY, "messages": [{"role": "user", "content": "Which?"}], "documents": make_docs(3),
        "max_tokens": 2, "temperature": 0}
EMPTY = {"model": TINY, "prompt": "", "max_tokens": 2, "temperature": 0}  # one segment: a blend refused by rule


@pytest.mark.parametrize("case, endpoint, body, refused", [
    ("exact", "/v1/chat/completions", {**CHAT, "kvblend": {"reuse": "exact"}}, ""),
    ("blend", "/v1/chat/completions", {**CHAT, "kvblend": BLEND}, ""),
    ("blend refused by the gate", "/v1/chat/completions", {**CHAT, "kvblend": BLEND}, REFUSED),
    ("blend refused by a rule", "/v1/completions", {**EMPTY, "kvblend": BLEND}, ""),
])
def test_a_server_request_decides_its_refusal_once(one_torch_thread, counted_rules, case, endpoint,  # noqa: F811
                                                   body, refused):
    base = tiny_serve_engine()
    gate = Gate(refused)
    eng = gated(base, gate, base.store)
    with TestClient(create_app(eng, ServeConfig(model=TINY))) as client:
        reports = []
        for n in (1, 2):  # the first request and a repeat (its documents stored by then)
            r = client.post(endpoint, json=body)
            assert r.status_code == 200, r.text
            assert counted_rules[0] == n, f"{case}: the rules ran {counted_rules[0]} times for {n} request(s)"
            reports.append(r.json()["kvblend"]["report"])
    report = reports[0]  # (a repeated blend may take the exact KV the server's idle-time refinement stored)
    # the same decisions as before: what ran, and why not
    if case == "exact":
        assert report["applied"] == "exact" and gate.calls == 0
    elif case == "blend":
        assert report["applied"] == "blend" and not report["gate"] and gate.calls == 2
    elif case == "blend refused by the gate":
        assert report["applied"] == "none" and report["gate"] == REFUSED and gate.calls == 2
    else:
        assert report["applied"] == "none" and "no document to blend" in report["gate"] and gate.calls == 0


# ---- 4. a one-document blend is the exact path: the gate is not asked -------------------------------------------

def test_a_one_document_blend_runs_the_exact_path_without_asking_the_gate(tiny_engine):
    """Whatever the gate would say, the logits are the exact path's: a passing gate ran the exact path, a
    failing one computed the same logits without reuse. Neither is asked now: the request reuses what
    exact reuse would, and no first run of the gate is paid for it."""
    prompt = tiny_engine.build_prompt("Which?", make_docs(1))
    exact = gated(tiny_engine, Gate()).generate(prompt, ReusePolicy.exact(), max_new_tokens=1)
    for verdict in ("", REFUSED):
        gate = Gate(verdict)
        eng = gated(tiny_engine, gate)
        for warm in (False, True):
            ans = eng.generate(prompt, ReusePolicy.blend(), max_new_tokens=1)
            rep = ans.report
            assert gate.calls == 0 and not rep.gate and not rep.gate_ran
            assert rep.applied is ReuseMode.EXACT and torch.equal(ans.first_logits, exact.first_logits)
            classes = [s.reuse_class for s in rep.segments if s.kind is not SegmentKind.QUESTION]
            assert classes == ([ReuseClass.EXACT] * 2 if warm else [ReuseClass.COMPUTED] * 2), classes
        assert not blend.refusals.consults_gate(eng, prompt, ReusePolicy.blend())


def test_blends_the_gate_could_refuse_still_ask_it(tiny_engine):
    """Two documents (the second re-positioned), or one under semantic reuse (a donor's KV for it is
    approximate): the gate decides."""
    gate = Gate(REFUSED)
    eng = gated(tiny_engine, gate)
    two = eng.build_prompt("Which?", make_docs(2))
    rep = eng.generate(two, ReusePolicy.blend(), max_new_tokens=1).report
    assert gate.calls == 1 and rep.gate == REFUSED and rep.applied is ReuseMode.NONE
    assert [s.reuse_class for s in rep.segments if s.kind is SegmentKind.DOCUMENT] == [ReuseClass.FALLBACK] * 2
    semantic = Engine(tiny_engine.runner, dataclasses.replace(tiny_engine.config, experimental_semantic=True),
                      MemoryStore(), gate)
    one = semantic.build_prompt("Which?", make_docs(1))
    assert blend.refusals.consults_gate(semantic, one, ReusePolicy.blend(semantic=True))
    assert not blend.refusals.consults_gate(semantic, one, ReusePolicy.blend())
