"""What the tests of ``kvblend chat``'s Ctrl-C share: a typed terminal, the printed answers, a fresh engine's
answer for a given history."""

from __future__ import annotations

import io

from blend.generation import generate
from blend.generation_cli import generation_config_from_args
from blend.options import engine_from_args, policy_from_args
from blend.prompt import Turn

QUESTIONS = ["where is the quay?", "and the lamp?", "who lit it?"]


class Terminal(io.StringIO):
    """Typed questions: ``isatty`` is what makes the chat interactive."""

    def isatty(self) -> bool:
        return True


def answers_of(text: str) -> list[str]:
    """The printed answers (an interactive chat's lines start with its prompt, '> ')."""
    lines = [ln.removeprefix("> ") for ln in text.splitlines()]
    return [ln[len("answer: "):] for ln in lines if ln.startswith("answer: ")]


def reference_answer(args, question: str, history: list[Turn]) -> str:
    """The answer a fresh engine (empty store, no hot prefix) gives with ``history``: what the chat's next turn
    must answer when its history is what it says."""
    engine = engine_from_args(args)
    docs = [open(p).read() for p in args.doc]
    prompt = engine.build_prompt(question, docs, args.system, history=history)
    return generate(engine, prompt, policy_from_args(args), generation_config_from_args(args)).text.strip()
