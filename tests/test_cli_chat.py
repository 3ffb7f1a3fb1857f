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


def test_a_refused_question_goes_to_stderr_the_chat_goes_on_and_the_exit_status_says_so(doc_args):
    """A question over the model's context was printed as 'kvblend: error: ...' among the answers on stdout,
    and the chat exited 0 even when every question of a piped conversation was refused."""
    args = build_parser("chat").parse_args(["chat", *doc_args, "--model", "tiny-llama", "--store", "memory",
                                            "--max-new-tokens", "2"])
    out, err = io.StringIO(), io.StringIO()
    rc = run_chat(args, io.StringIO("word " * 5000 + "\nwhere is the quay?\n"), out, err)
    assert rc == 2
    assert "exceeds the model's context" in err.getvalue() and "kvblend: error" not in out.getvalue()
    assert len([ln for ln in out.getvalue().splitlines() if ln.startswith("[ttft ")]) == 1  # the next one answered


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_end_of_input_at_an_interactive_prompt_ends_the_prompts_line(doc_args):
    """Ctrl-D at '> ' left the shell's next prompt on the same line."""
    args = build_parser("chat").parse_args(["chat", *doc_args, "--model", "tiny-llama", "--store", "memory",
                                            "--max-new-tokens", "2"])
    out = io.StringIO()
    assert run_chat(args, _Terminal("where is the quay?\n"), out, io.StringIO()) == 0
    assert out.getvalue().startswith("> answer: ") and out.getvalue().endswith("]\n> \n")


@pytest.mark.parametrize("command", ["ask", "chat"])
def test_a_bad_sampling_flag_is_refused_before_the_model_loads(doc_args, monkeypatch, capsys, command):
    """--temperature 5 loaded the model first (~20 s for SmolLM2's first run) and only then was refused."""
    import blend.chat_cli
    import blend.cli

    def no_load(args):
        raise AssertionError("the engine loaded before the sampling flags were checked")

    monkeypatch.setattr(blend.cli, "engine_from_args", no_load)
    monkeypatch.setattr(blend.chat_cli, "engine_from_args", no_load)
    monkeypatch.setattr("sys.stdin", io.StringIO("q\n"))
    question = ["q"] if command == "ask" else []
    assert blend.cli.main([command, *question, *doc_args, "--model", "tiny-llama", "--temperature", "5"]) == 2
    assert "temperature must be in [0, 2]" in capsys.readouterr().err


def test_a_blended_follow_up_counts_the_earlier_turns_it_computed(doc_args):
    """A blend computes earlier turns inside its question segment (no turn segments in its report): its
    summary said 'earlier turns loaded 0 of 0' on a conversation's third question."""
    text = chat(doc_args, "where is the quay?\nand the lamp?\nwho lit it?\n", "--reuse", "blend", "--force-blend")
    summaries = [ln for ln in text.splitlines() if ln.startswith("[ttft ")]
    assert [s.split(" | ")[2] for s in summaries] == [f"earlier turns loaded 0 of {n}" for n in range(3)]


def test_a_line_that_is_not_utf8_is_refused_alone_and_the_chat_goes_on(doc_args, monkeypatch):
    """Under a UTF-8 locale's strict decoder the first read of a piped chunk failed on one bad byte: no
    question of it was answered and the chat ended ("'utf-8' codec can't decode byte 0xe9"). The refusal
    also suggested /reset, which only helps a conversation that outgrew the context."""
    import sys

    args = build_parser("chat").parse_args(["chat", *doc_args, "--model", "tiny-llama", "--store", "memory",
                                            "--max-new-tokens", "2"])
    stdin = io.TextIOWrapper(io.BytesIO(b"where is the quay?\ncaf\xe9 au lait?\nand the lamp?\n"),
                             encoding="utf-8", errors="strict")
    monkeypatch.setattr(sys, "stdin", stdin)
    out, err = io.StringIO(), io.StringIO()
    assert run_chat(args, None, out, err) == 2
    assert len([ln for ln in out.getvalue().splitlines() if ln.startswith("[ttft ")]) == 2
    assert "earlier turns loaded 0 of 1" in out.getvalue()  # the refused line left the conversation as it was
    assert err.getvalue().count("kvblend: error:") == 1 and "not valid Unicode" in err.getvalue()
    assert "/reset" not in err.getvalue()


def test_chat_help_says_how_to_stop_an_answer_and_end_the_chat(capsys):
    """`kvblend chat --help` listed flags only: nothing on /reset, /exit, Ctrl-C, Ctrl-D or the exit status."""
    with pytest.raises(SystemExit):
        build_parser("chat").parse_args(["chat", "--help"])
    text = capsys.readouterr().out
    for words in ("/reset", "/exit", "Ctrl-C", "Ctrl-D", "stays in the conversation", "Exit status", "130"):
        assert words in text
    assert "--max-new-tokens N" in text and "the longest answer" in text


def test_a_chat_started_with_standard_input_closed_is_refused_before_the_model_loads(doc_args, monkeypatch):
    """`kvblend chat --doc F <&-` loaded the model, then died with AttributeError: 'NoneType' object has no
    attribute 'isatty' (a traceback)."""
    import sys

    import blend.chat_cli
    from blend.errors import InvalidRequestError

    def no_load(args):
        raise AssertionError("the engine loaded before standard input was checked")

    monkeypatch.setattr(blend.chat_cli, "engine_from_args", no_load)
    monkeypatch.setattr(sys, "stdin", None)
    args = build_parser("chat").parse_args(["chat", *doc_args, "--model", "tiny-llama", "--store", "memory"])
    with pytest.raises(InvalidRequestError, match="standard input is closed"):
        run_chat(args)
