"""Error messages in the command line's own words.

Settings are checked where they live (``GenerationConfig``, ``ReusePolicy``,
``ChunkerConfig``, the server's ``Limits`` and ``SchedulerConfig``), whose
messages name their Python fields: right for the Python API, wrong at a shell
prompt, where ``max_tokens must be an integer >= 1`` answers
``--max-new-tokens 0``. The command line rewrites each field name a message
holds (a snake_case word) into the flag that sets it. A one-word name (``ratio``,
``selector``, ``candidates``) is also a plain word, so it is rewritten only where
the error says its message names that field (:attr:`InvalidPolicyError.fields
<blend.errors.InvalidPolicyError>`, see :func:`named_fields`).
"""

from __future__ import annotations

import argparse
import re

from blend.errors import InvalidPolicyError

# fields whose flag is not the field's own name: the candidates, the first a parser has wins
FIELD_FLAGS = {
    "max_tokens": ("--max-new-tokens", "--max-tokens-limit"),
    "target_tokens": ("--chunk-tokens",),
    "overlap_tokens": ("--overlap",),
}
# one-word policy fields whose flag is not the field's own name; () where no flag sets it (the command line's
# --seed is the sampling seed, not the random selector's)
POLICY_FLAGS = {"mode": ("--reuse",), "force": ("--force-blend",), "seed": ()}
# a field name standing alone: never a plain word, and never part of a path, a file name or a flag a user
# typed ("/data/top_k.txt", "--max_tokens" stay as they are)
_SNAKE = re.compile(r"(?<![-/.\w])[a-z][a-z0-9]*(?:_[a-z0-9]+)+(?![\w/-]|\.\w)")


def flag_names(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Field name -> the long flag that sets it, over a parser and its sub-commands' parsers.

    Args:
        parser: the command line's parser.

    Returns:
        Each destination's first long option, and :data:`FIELD_FLAGS`' renamed fields whose flag the
        parser has.
    """
    out: dict[str, str] = {}
    flags: set[str] = set()
    stack = [parser]
    while stack:
        p = stack.pop()
        for action in getattr(p, "_actions", ()):
            if isinstance(action, argparse._SubParsersAction):
                stack.extend(action.choices.values())
                continue
            longs = [o for o in action.option_strings if o.startswith("--")]
            flags.update(longs)
            if longs:
                out.setdefault(action.dest, longs[0])
    for field, candidates in FIELD_FLAGS.items():
        have = [f for f in candidates if f in flags]
        if have:  # only a flag this command line has
            out[field] = have[0]
    return out


def in_flag_words(message: str, names: dict[str, str], fields: tuple[str, ...] = ()) -> str:
    """``message`` with each field name it holds written as its flag (``top_p must be ...`` ->
    ``--top-p must be ...``); words that name no flag are left as they are.

    Args:
        message: an error's message.
        names: from :func:`flag_names`.
        fields: one-word policy fields the message names (:func:`named_fields`): each whole word spelling
            one is written as its flag too (a one-word name is otherwise left alone: it is also a word).

    Returns:
        The message for a shell user.
    """
    out = _SNAKE.sub(lambda m: names.get(m.group(0), m.group(0)), message)
    for name in fields:
        flag = _policy_flag(name, names)
        if flag is not None:
            out = re.sub(rf"(?<![-/.\w]){re.escape(name)}(?![\w/-]|\.\w)", lambda _, f=flag: f, out)
    return out


def named_fields(error: BaseException) -> tuple[str, ...]:
    """The one-word policy fields ``error``'s message names (only a policy's refusals say; () otherwise).

    Args:
        error: an error a command caught.

    Returns:
        Its :attr:`~blend.errors.InvalidPolicyError.fields`, or ().
    """
    return error.fields if isinstance(error, InvalidPolicyError) else ()


def _policy_flag(name: str, names: dict[str, str]) -> str | None:
    """The flag that sets the policy field ``name`` on this command line (None: none does)."""
    if name in POLICY_FLAGS:
        have = set(names.values())
        return next((f for f in POLICY_FLAGS[name] if f in have), None)
    return names.get(name)


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser whose usage errors are one line on stderr, as every other user error of the
    command line is (argparse printed its whole usage block first: 20-25 lines for one bad flag), and in
    the command line's words: a setting's field name is written as its flag. Exit status 2."""

    def error(self, message: str):  # type: ignore[override] # argparse's signature: never returns
        self.exit(2, f"{self.prog}: error: {in_flag_words(message, flag_names(self))} "
                     f"(see {self.prog} --help)\n")
