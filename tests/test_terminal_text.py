"""Text from files, indexes and stores is printed with escape sequences escaped (blend.terminal_text)."""

from __future__ import annotations

import io

from blend.retrieval.corpus import CorpusIssue, IssueKind
from blend.retrieval.ingest import print_issues
from blend.terminal_text import shown

ESC = "notes\x1b[2J\x1b[1;31mSYSTEM COMPROMISED\x1b]0;owned\x07.txt"


def test_shown_escapes_control_characters_and_lone_surrogates_only():
    assert shown("plain caf\u00e9 \u6587\u5b57") == "plain caf\u00e9 \u6587\u5b57"
    assert "\x1b" not in shown(ESC) and "\\x1b" in shown(ESC)
    assert shown("a\ud800b") == "a\\ud800b"
    assert shown("tab\there") == "tab\\there"
    assert shown("caf\u00e9\x1b") == "caf\u00e9\\x1b"  # printable text around a control character stays as it is


def test_ingest_warnings_do_not_pass_a_file_names_escape_sequences_to_the_terminal():
    out = io.StringIO()
    print_issues([CorpusIssue(ESC, None, next(iter(IssueKind)), "unreadable")], out)
    assert "\x1b" not in out.getvalue() and "\x07" not in out.getvalue() and "SYSTEM COMPROMISED" in out.getvalue()


def test_a_cli_error_naming_an_indexs_recorded_name_is_printed_escaped(capsys):
    """An index's meta.json names its embedder: 'built with another embedder (<name>)' printed it raw."""
    import argparse

    from blend.retrieval.cli import _guard
    from blend.retrieval.corpus import RetrievalError

    def fail(_args):
        raise RetrievalError(f"idx: index was built with another embedder ({ESC}, dim 64)")

    assert _guard(fail, argparse.Namespace()) == 2
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\x07" not in err and "another embedder" in err


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_an_answer_keeps_newlines_and_tabs_and_escapes_every_other_control_character():
    from blend.terminal_text import answer_shown

    assert answer_shown("line one\n\tline two caf\u00e9") == "line one\n\tline two caf\u00e9"
    got = answer_shown("ok " + ESC + "\x9b2J\x7f")  # C1 CSI and DEL too
    assert not any(c in got for c in "\x1b\x07\x9b\x7f") and "SYSTEM COMPROMISED" in got and "\\x1b" in got


def test_a_streamed_answer_reaches_a_terminal_escaped_and_a_pipe_as_the_model_wrote_it():
    """A retrieved document can make the model repeat an escape sequence: on a terminal it is shown escaped
    (even split across streamed pieces); a pipe or file gets the exact text; the returned text (what the
    chat keeps in its history) is the model's own either way."""
    from blend.generation_cli import print_stream

    pieces = ["Sure: \x1b", "]0;owned\x07", "\x1b[2J done\n\tok"]
    tty = _Terminal()
    assert print_stream(iter(pieces), tty) == "".join(pieces)
    assert not any(c in tty.getvalue() for c in "\x1b\x07") and "done\n\tok" in tty.getvalue()
    pipe = io.StringIO()
    print_stream(iter(pieces), pipe)
    assert pipe.getvalue() == "answer: " + "".join(pieces) + "\n"


def test_the_printed_report_shows_a_non_streamed_answer_escaped_on_a_terminal():
    from types import SimpleNamespace

    from blend.cli import print_report
    from blend.policy_types import ReuseMode
    from blend.report import ReuseReport

    report = ReuseReport(policy="exact", applied=ReuseMode.EXACT, asked=ReuseMode.EXACT)
    ans = SimpleNamespace(text="hi \x1b[2Jthere", ttft_s=0.01, report=report)
    tty = _Terminal()
    print_report(ans, tty)
    assert "\x1b" not in tty.getvalue() and "hi \\x1b[2Jthere" in tty.getvalue()
