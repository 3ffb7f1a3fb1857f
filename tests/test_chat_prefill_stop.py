"""``kvblend chat`` and a Ctrl-C during a turn's prefill: the prefill stops before its next layer, the turn is
dropped, and the chat goes on as if it had never been asked.

Ctrl-C is a real SIGINT sent to this process from inside the prefill's layer loop (``blend.model.layer_forward``
as :meth:`~blend.model.ModelRunner.run_layers` calls it; decoding runs its own), counted per turn, so the
chat's handler sees it exactly where a user's would land, at a chosen layer. Before the fix the prefill ran
to its end whatever Ctrl-C asked (the turn's layer count shows it), and only then was the question dropped.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal

import pytest
import torch

import blend.chat_cli
import blend.gate
import blend.generation
import blend.model
from _chat_util import QUESTIONS, Terminal, answers_of
from blend.chat_cli import run_chat
from blend.cli import build_parser
from blend.generation import generate
from blend.generation_cli import generation_config_from_args
from blend.options import engine_from_args, policy_from_args
from blend.prompt import Role, Turn
from conftest import write_docs

ASIDE = "what of the boat?"  # the question Ctrl-C stops
DROPPED = "(interrupted before the answer began: the question is not kept)"
MODES = {"exact": [], "blend": ["--reuse", "blend", "--force-blend"]}  # forced: no quality gate (tested apart)


class LayerClock:
    """Counts the prefill layers each turn runs (a turn starts with its Generation) and sends SIGINT as a
    chosen one starts: ``arm(turn, layer, times)`` (both from 1), or ``arm_gate(layer)`` for the quality
    gate's own run (its layers counted from 1 across the run)."""

    def __init__(self, monkeypatch) -> None:
        self.turns: list[int] = []  # layers each turn ran
        self.gate_layers = 0  # layers the gate's runs ran
        self.gate_runs: list[str] = []  # how each gate run ended: "returned" or the exception's name
        self._at: dict[tuple[str, int, int], int] = {}
        self._in_gate = False
        real_layer, real_init, real_gate = blend.model.layer_forward, blend.generation.Generation.__init__, \
            blend.gate.run_gate

        def init(gen, *a, **kw):
            self.turns.append(0)
            real_init(gen, *a, **kw)

        def layer(*a, **kw):
            self.turns[-1] += 1
            if self._in_gate:
                self.gate_layers += 1
                self._ctrl_c(self._at.get(("gate", 0, self.gate_layers), 0))
            self._ctrl_c(self._at.get(("turn", len(self.turns), self.turns[-1]), 0))
            return real_layer(*a, **kw)

        def run_gate(*a, **kw):
            self._in_gate = True
            try:
                result = real_gate(*a, **kw)
            except BaseException as e:
                self.gate_runs.append(type(e).__name__)
                raise
            finally:
                self._in_gate = False
            self.gate_runs.append("returned")
            return result

        monkeypatch.setattr(blend.model, "layer_forward", layer)
        monkeypatch.setattr(blend.generation.Generation, "__init__", init)
        monkeypatch.setattr(blend.gate, "run_gate", run_gate)

    @staticmethod
    def _ctrl_c(times: int) -> None:
        for _ in range(times):
            os.kill(os.getpid(), signal.SIGINT)

    def arm(self, turn: int, layer: int, times: int = 1) -> None:
        self._at[("turn", turn, layer)] = times

    def arm_gate(self, layer: int) -> None:
        self._at[("gate", 0, layer)] = 1


@pytest.fixture
def clock(monkeypatch):
    return LayerClock(monkeypatch)


@pytest.fixture
def engines(monkeypatch):
    """The engines the chats of a test build, in order."""
    made = []
    monkeypatch.setattr(blend.chat_cli, "engine_from_args", lambda a: made.append(engine_from_args(a)) or made[-1])
    return made


def chat_args(tmp_path, *extra: str):
    docs = [a for path in write_docs(tmp_path, 2, words=25, seed=3) for a in ("--doc", path)]
    return build_parser("chat").parse_args(["chat", *docs, "--model", "tiny-llama", "--store", "memory",
                                            "--max-new-tokens", "24", *extra])


def chat(args, questions: list[str]) -> str:
    """An interactive chat over ``questions``: its output (a Ctrl-C that ends it fails the test)."""
    out = io.StringIO()
    try:
        assert run_chat(args, Terminal("".join(q + "\n" for q in questions)), out, io.StringIO()) == 0
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C ended the chat (KeyboardInterrupt out of run_chat)")
    return out.getvalue()


def summaries(text: str) -> list[str]:
    """Each turn's reuse line as far as a stopped turn before it leaves it alone: the history's length and the
    policy. (What was loaded, and so the TTFT and the reused tokens, may differ: a stopped prefill keeps the
    segments it finished stored, for the next turn to load.)"""
    rows = [ln.removeprefix("> ") for ln in text.splitlines() if ln.removeprefix("> ").startswith("[ttft ")]
    return [re.sub(r"^\[ttft .*? \| earlier turns loaded \d+ of ", "", r) for r in rows]


def next_turn(engine, args, history: list[Turn]):
    """The engine's answer to one more question after ``history`` (first-token logits and text)."""
    docs = [open(p).read() for p in args.doc]
    prompt = engine.build_prompt("and then?", docs, args.system, history=history)
    return generate(engine, prompt, policy_from_args(args), generation_config_from_args(args))


# (mode, which turn Ctrl-C stops: 1 the first, cold; 2 a follow-up, earlier turns stored), where in it
CASES = [("exact", 1, "first"), ("exact", 1, "middle"), ("exact", 2, "last"), ("blend", 1, "middle"),
         ("blend", 2, "first"), ("blend", 2, "last")]


@pytest.mark.parametrize("mode, turn, where", CASES)
def test_ctrl_c_during_a_prefill_stops_it_at_the_next_layer_and_the_chat_goes_on_as_if_never_asked(
        tmp_path, clock, engines, mode, turn, where):
    args = chat_args(tmp_path, *MODES[mode])
    with_aside = [*QUESTIONS[:turn - 1], ASIDE, *QUESTIONS[turn - 1:]]
    chat(args, with_aside[:turn])  # how many layers the aside's prefill runs, left alone
    total = clock.turns[-1]
    stop_at = {"first": 1, "middle": total // 2, "last": total - 1}[where]  # (at the last one it is done)
    clock.turns.clear()
    clock.arm(turn, stop_at)
    stopped = chat(args, with_aside)
    assert clock.turns[turn - 1] == stop_at  # stopped before the next layer (before the fix: total)
    assert stopped.count(DROPPED) == 1 and f"> {DROPPED}\n> answer: " in stopped
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

    never = chat(args, QUESTIONS)  # a fresh chat that was never asked the aside
    assert answers_of(stopped) == answers_of(never) and len(answers_of(never)) == len(QUESTIONS)
    assert summaries(stopped) == summaries(never)  # the history's length and the policy: the aside is not in it
    # the stopped chat's engine stays whole: one more turn gives the bits the other chat's engine gives
    history = [t for q, a in zip(QUESTIONS, answers_of(never)) for t in (Turn(Role.USER, q), Turn(Role.ASSISTANT, a))]
    after, other = next_turn(engines[1], args, history), next_turn(engines[2], args, history)
    assert torch.equal(after.first_logits, other.first_logits) and after.text == other.text


def test_ctrl_c_during_the_quality_gates_first_run_stops_it_and_keeps_no_verdict(tmp_path, clock, monkeypatch,
                                                                                    capsys):
    """A blend turn's prefill runs the gate's first run (seconds on a real model): Ctrl-C stops it too. The
    half-run gate neither records nor caches a verdict: the next blend runs it again, from the start, and
    records what an uninterrupted run records."""
    homes = tmp_path / "stopped", tmp_path / "never"
    args = chat_args(tmp_path, "--reuse", "blend")
    monkeypatch.setenv("KVBLEND_HOME", str(homes[0]))
    clock.arm_gate(150)  # well inside its run (its fidelity prompts)
    stopped = chat(args, [ASIDE, *QUESTIONS[:2]])
    assert clock.gate_runs == ["PrefillCancelled", "returned"]  # stopped, then run again in full by the next turn
    assert clock.turns[0] == 150  # the gate's run stopped at the next layer, and the turn with it
    assert stopped.count(DROPPED) == 1 and stopped.startswith(f"> {DROPPED}\n> answer: ")
    assert capsys.readouterr().err.count("running the quality gate") == 2

    monkeypatch.setenv("KVBLEND_HOME", str(homes[1]))
    never = chat(args, QUESTIONS[:2])
    assert answers_of(stopped) == answers_of(never) and summaries(stopped) == summaries(never)
    records = [json.loads(next((h / "gate").iterdir()).read_text()) for h in homes]
    assert records[0] == records[1] and len(list((homes[0] / "gate").iterdir())) == 1


def test_a_second_ctrl_c_during_a_prefill_ends_the_chat_and_every_stored_entry_is_whole(tmp_path, clock, engines,
                                                                                          capsys):
    """One Ctrl-C stops the first turn's prefill inside its first document (the preamble, finished, is stored);
    two within one layer of the next turn's end the chat (exit 130 from ``main``), as they did before."""
    from blend.cli import main

    store = f"disk:{tmp_path / 'kv'}"
    args = chat_args(tmp_path)
    args.store = store
    clock.arm(1, 6)  # cold exact: layers 1-4 the preamble, 5-8 the first document
    clock.arm(2, 3, times=2)  # the preamble loaded: the first document's third layer
    out = io.StringIO()
    with pytest.raises(KeyboardInterrupt):
        run_chat(args, Terminal(ASIDE + "\n" + QUESTIONS[0] + "\n"), out, io.StringIO())
    assert clock.turns == [6, 3] and out.getvalue() == f"> {DROPPED}\n> "
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    engines[0].segments.store.close()  # as at exit: the queued writes finish
    capsys.readouterr()
    assert main(["store", "verify", "--store", store]) == 0
    assert "checked 1 entries, found 0 corrupt" in capsys.readouterr().out  # the preamble alone, whole
