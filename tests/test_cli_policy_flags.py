"""A command-line refusal of a policy setting names the flag a user typed, one-word settings included.

The command line rewrote field names into flags by their snake_case shape only (max_ratio -> --max-ratio),
so a refusal of a one-word setting named the Python field: ``--selector v --candidates off`` answered
"candidates is a setting of the query probe, which selector 'v' never runs". A policy error now says which
one-word fields its message names, and the command line writes their flags there.
"""

from __future__ import annotations

import re
from dataclasses import fields

import pytest

from blend.cli import build_parser
from blend.cli import main as cli_main
from blend.cli_messages import flag_names, in_flag_words, named_fields
from blend.errors import InvalidPolicyError
from blend.policy import ReusePolicy

ONE_WORD = sorted(f.name for f in fields(ReusePolicy) if "_" not in f.name)

# each one-word field: a policy that refuses it, and the flag `kvblend ask` sets it with (None: no flag does:
# the policy's seed is the random selector's; --seed is the sampling seed)
REFUSALS = {
    "mode": (lambda: ReusePolicy(mode="blend"), "--reuse"),
    "ratio": (lambda: ReusePolicy.blend(ratio=2.0), "--ratio"),
    "selector": (lambda: ReusePolicy.blend(selector="nope"), "--selector"),
    "threshold": (lambda: ReusePolicy.blend(threshold=-1.0), "--threshold"),
    "force": (lambda: ReusePolicy.blend(force="yes"), "--force-blend"),
    "semantic": (lambda: ReusePolicy.blend(semantic="yes"), "--semantic"),
    "seed": (lambda: ReusePolicy.blend(selector="random", seed=-1), None),
    "budget": (lambda: ReusePolicy.blend(budget="auto"), "--budget"),
    "candidates": (lambda: ReusePolicy.blend(selector="v", candidates=4.0), "--candidates"),
}


def bare(word: str, text: str) -> bool:
    """Whether ``text`` holds ``word`` as a word of its own (not inside a flag or another name)."""
    return re.search(rf"(?<![-\w]){word}(?!\w)", text) is not None


def test_every_one_word_policy_field_has_a_case():
    assert sorted(REFUSALS) == ONE_WORD


@pytest.mark.parametrize("field", ONE_WORD)
def test_a_refusal_of_a_one_word_field_names_its_flag(field):
    make, flag = REFUSALS[field]
    with pytest.raises(InvalidPolicyError) as e:
        make()
    assert field in named_fields(e.value) and bare(field, str(e.value))  # the Python API names the field
    shown = in_flag_words(str(e.value), flag_names(build_parser(None)), named_fields(e.value))
    if flag is None:  # no flag sets it: not written as another setting's flag
        assert shown == str(e.value) and "--seed" not in shown
    else:
        assert flag in shown and not bare(field, shown), shown


@pytest.mark.parametrize("flags, needle, fields_named", [
    (["--selector", "v", "--candidates", "off"],
     "--candidates is a setting of the query probe, which --selector 'v' never runs", ("candidates", "selector")),
    (["--ratio", "2"], "--ratio must be in [0, 1], got 2.0", ("ratio",)),
    (["--ratio", "nan"], "--ratio must be a finite number", ("ratio",)),
    (["--threshold", "-1"], "--threshold must be >= 0", ("threshold",)),
    (["--budget", "auto", "--threshold", "0.1"], "--budget auto and --threshold are two stopping rules",
     ("budget", "threshold")),
    (["--budget", "auto", "--selector", "combo"], "(--selector probe); --selector 'combo' would be ignored",
     ("selector",)),
    (["--budget", "auto", "--ratio", "0.3"], "--ratio=0.3 is a fixed budget", ("ratio",)),
    (["--auto-target", "0.1"], "--auto-target is the stopping target of --budget auto: --budget fixed would",
     ("budget",)),
    (["--check-layers", "0", "--selector", "combo"], "use --check-layers >= 1, or --selector probe_attn",
     ("selector",)),
    (["--check-layers", "-1"], "--check-layers must be >= 0", ()),
])
def test_kvblend_ask_names_the_flags_a_user_typed(tmp_path, capsys, flags, needle, fields_named):
    doc = tmp_path / "doc.txt"
    doc.write_text("The river runs north.")
    code = cli_main(["ask", "q", "--doc", str(doc), "--model", "tiny-llama", "--store", "memory",
                     "--reuse", "blend", *flags])
    err = capsys.readouterr().err
    assert code == 2 and needle in err, err
    assert len(err.strip().splitlines()) == 1
    for field in fields_named:
        assert not bare(field, err.removeprefix("kvblend: error: ")), err


def test_a_chat_turn_refused_by_the_engine_names_the_flag(tmp_path):
    """A blend whose check layer the model lacks is refused when its turn runs (by the engine's rules); the
    chat printed that turn's error as it was raised: check_layers, not --check-layers."""
    import io

    from blend.chat_cli import run_chat

    doc = tmp_path / "doc.txt"
    doc.write_text("The river runs north.")
    parser = build_parser("chat")
    args = parser.parse_args(["chat", "--doc", str(doc), "--model", "tiny-llama", "--store", "memory",
                              "--reuse", "blend", "--check-layers", "99"])
    args.parser = parser  # as kvblend's main sets it
    err = io.StringIO()
    assert run_chat(args, io.StringIO("which river?\n"), io.StringIO(), err) != 0
    assert "kvblend: error: --check-layers (99,) outside the model's" in err.getvalue(), err.getvalue()
