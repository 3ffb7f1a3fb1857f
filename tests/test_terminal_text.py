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
