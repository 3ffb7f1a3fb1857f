"""``kvblend chat``: one conversation over fixed documents, questions from standard input."""

from __future__ import annotations

import io

import pytest

from blend.cli import build_parser
from blend.chat_cli import run_chat
from conftest import write_docs


@pytest.fixture
def doc_args(tmp_path):
    return [a for path in write_docs(tmp_path, 2, words=25, seed=3) for a in ("--doc", path)]


def chat(doc_args, stdin: str, *extra: str) -> str:
    args = build_parser("chat").parse_args(["chat", *doc_args, "--model", "tiny-llama", "--store", "memory",
                                            "--max-new-tokens", "3", *extra])
    out = io.StringIO()
    assert run_chat(args, io.StringIO(stdin), out) == 0
    return out.getvalue()


def test_each_follow_up_loads_the_documents_and_every_earlier_turn(doc_args):
    text = chat(doc_args, "where is the quay?\n\nand the lamp?\nwho lit it?\n")
    answers = [ln for ln in text.splitlines() if ln.startswith("answer: ")]
    summaries = [ln for ln in text.splitlines() if ln.startswith("[ttft ")]
    assert len(answers) == len(summaries) == 3  # the empty line is skipped
    assert "earlier turns loaded 0 of 0" in summaries[0]
    assert "earlier turns loaded 0 of 1" in summaries[1]  # turn 1 stored nothing: a single question
    assert "earlier turns loaded 2 of 2" in summaries[2]


def test_reset_starts_a_new_conversation_and_exit_stops(doc_args):
    text = chat(doc_args, "where is the quay?\n/reset\nand the lamp?\n/exit\nnever asked?\n")
    summaries = [ln for ln in text.splitlines() if ln.startswith("[ttft ")]
    assert "(new conversation)" in text and len(summaries) == 2
    assert "earlier turns loaded 0 of 0" in summaries[1]


def test_a_chat_needs_documents(doc_args):
    from blend.errors import InvalidRequestError

    args = build_parser("chat").parse_args(["chat", "--model", "tiny-llama", "--store", "memory"])
    with pytest.raises(InvalidRequestError, match="--doc"):
        run_chat(args, io.StringIO("q\n"), io.StringIO())
