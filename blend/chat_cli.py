"""``kvblend chat``: a conversation over fixed documents in the terminal.

    kvblend chat --doc FILE [--doc FILE ...] [--reuse exact|blend|none] [--system S] [sampling and engine options]

Questions come one per line on standard input (typed, or piped); each answer
is streamed and followed by one line of what was reused. Every turn is laid
out as the Python API's ``history`` lays it out (the documents open the first
user turn), so under exact reuse (the default) each follow-up loads the
documents and every earlier turn and computes only the last answer and the
new question. ``/reset`` starts a new conversation, ``/exit`` (or end of
input) quits. A question the engine refuses (one that takes the conversation
past the model's context) prints its error on stderr and the conversation
goes on; the exit status is then 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from blend.defaults import DEFAULT_MAX_NEW_TOKENS
from blend.errors import InvalidRequestError, KVBlendError
from blend.exit_codes import ExitCode
from blend.generation_cli import add_sampling_arguments, generation_config_from_args, stream_answer
from blend.options import add_engine_arguments, add_policy_arguments, engine_from_args, policy_from_args, read_document
from blend.prompt import Role, SegmentKind, Turn
from blend.report import ReuseClass

RESET, EXIT = "/reset", "/exit"


def add_chat_command(sub: argparse._SubParsersAction) -> None:
    """Register ``kvblend chat`` on the top-level sub-parsers."""
    p = sub.add_parser("chat", help="a conversation over documents, questions from standard input")
    p.add_argument("--doc", action="append", default=[], metavar="FILE", help="a document (repeatable)")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    add_sampling_arguments(p)
    add_engine_arguments(p)
    add_policy_arguments(p)
    p.set_defaults(func=run_chat)


def turn_summary(report, earlier: int) -> str:
    """One line: TTFT, reused and computed tokens, and how many of the ``earlier`` turns (question and
    answer pairs) were loaded. A blend computes them inside its question segment (only the exact path
    keeps a segment per turn), so their count comes from the conversation, not from the report."""
    loaded = sum(1 for s in report.segments if s.kind is SegmentKind.TURN and s.reuse_class is ReuseClass.EXACT)
    return (f"[ttft {report.timings.ttft_s * 1000:.0f} ms | reused {report.reused_tokens} of {report.prompt_tokens} "
            f"tokens | earlier turns loaded {loaded} of {earlier} | {report.policy}, ran {report.applied.value}]")


def run_chat(args: argparse.Namespace, lines: TextIO | None = None, out: TextIO | None = None,
             err: TextIO | None = None) -> int:
    """Answer each line of ``lines`` (default stdin) as the next turn of one conversation.

    Args:
        args: parsed ``kvblend chat`` arguments.
        lines: where questions come from (one per line).
        out: where answers and summaries go.
        err: where a refused question's error goes (default stderr).

    Returns:
        0, or :data:`~blend.exit_codes.ExitCode.USER_ERROR` when a question was refused (its error is
        printed and the conversation goes on).
    """
    lines = sys.stdin if lines is None else lines
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    if not args.doc:
        raise InvalidRequestError("give at least one --doc FILE")
    docs = [read_document(p) for p in args.doc]
    policy = policy_from_args(args)
    config = generation_config_from_args(args)  # a bad sampling flag is refused before the model loads
    engine = engine_from_args(args)
    interactive = lines.isatty()
    history: list[Turn] = []
    refused = 0
    while True:
        if interactive:
            out.write("> ")
            out.flush()
        line = lines.readline()
        if not line:
            if interactive:  # end of input (Ctrl-D) at the prompt: the shell's prompt on a line of its own
                out.write("\n")
            break
        question = line.strip()
        if not question:
            continue
        if question == EXIT:
            break
        if question == RESET:
            history.clear()
            print("(new conversation)", file=out)
            continue
        try:
            prompt = engine.build_prompt(question, docs, args.system, history=history)
            ans = stream_answer(engine, prompt, policy, config, out=out)
        except KVBlendError as e:  # e.g. the conversation outgrew the model's context
            hint = f" ({RESET} starts a new conversation)" if history else ""
            print(f"kvblend: error: {e}{hint}", file=err)  # as every other user error: not in the answers
            refused += 1
            continue
        print(turn_summary(ans.report, len(history) // 2), file=out)
        history += [Turn(Role.USER, question), Turn(Role.ASSISTANT, ans.text.strip())]  # "" if it ended at once
    return ExitCode.USER_ERROR if refused else ExitCode.OK
