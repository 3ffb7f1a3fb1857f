"""``kvblend chat``: a conversation over fixed documents in the terminal.

    kvblend chat --doc FILE [--doc FILE ...] [--reuse exact|blend|none] [--system S] [sampling and engine options]

Questions come one per line on standard input (typed, or piped); each answer
is streamed and followed by one line of what was reused. Every turn is laid
out as the Python API's ``history`` lays it out (the documents open the first
user turn), so under exact reuse (the default) each follow-up loads the
documents and every earlier turn and computes only the last answer and the
new question. ``/reset`` starts a new conversation, ``/exit`` (or end of
input) quits. A question the engine refuses (one that takes the conversation
past the model's context, or a line that is not UTF-8) prints its error on
stderr and the conversation goes on; the exit status is then 2.

At a terminal, Ctrl-C while an answer is printed stops that answer (at its
next piece of text) and brings the prompt back, as ollama's and llama.cpp's
chats do. The conversation keeps what was printed of it: the next turn's
prompt holds exactly that text as the answer, so its KV (computed from the
prompt's tokens, never from the stopped decode) is the KV of what the history
says. Ctrl-C while the turn's prompt is prefilled (seconds for a long prompt
on a CPU) stops the prefill before its next layer (:mod:`blend.cancel`): an
answer stopped before any text was printed drops its question, and the next
turn answers as if it had never been asked (the segments the prefill finished
are stored whole; nothing of the one it was computing is). A second Ctrl-C
before the turn stopped ends the chat (exit 130); Ctrl-C or Ctrl-D at the
prompt ends it with exit 0. When questions are piped in, Ctrl-C ends the
chat, as it ends any command.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

from blend.cancel import PrefillCancelled, cancellable
from blend.cli_messages import flag_names, in_flag_words, named_fields
from blend.defaults import DEFAULT_MAX_NEW_TOKENS
from blend.errors import InvalidRequestError, KVBlendError, PromptTooLongError
from blend.exit_codes import ExitCode
from blend.generation_cli import add_sampling_arguments, generation_config_from_args, print_stream
from blend.options import add_engine_arguments, add_policy_arguments, engine_from_args, policy_from_args, read_document
from blend.prompt import Prompt, Role, SegmentKind, Turn
from blend.report import ReuseClass, ReuseReport
from blend.termination import StopRequest, ctrl_c_requests_stop

if TYPE_CHECKING:
    from blend.policy import ReusePolicy
    from blend.sampling import GenerationConfig

RESET, EXIT = "/reset", "/exit"
CHAT_DESCRIPTION = f"""\
A conversation over the --doc documents: one question per line on standard input (typed or piped).
Each answer is printed as it is decoded, then one line of what was reused.

  {RESET}   start a new conversation (same documents)
  {EXIT}    end the chat (as end of input, Ctrl-D, does)
  Ctrl-C   at a terminal: stop the answer being printed (what was printed stays in the conversation)
           or the prompt's prefill (the question is dropped); at the prompt: end the chat

Exit status: 0, 2 when a question was refused (its error on stderr; the chat went on), 130 interrupted."""


def add_chat_command(sub: argparse._SubParsersAction) -> None:
    """Register ``kvblend chat`` on the top-level sub-parsers.

    Args:
        sub: the top-level parser's sub-parsers (``kvblend``'s commands).
    """
    p = sub.add_parser("chat", help="a conversation over documents, questions from standard input",
                       description=CHAT_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--doc", action="append", default=[], metavar="FILE", help="a document (repeatable)")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS, metavar="N",
                   help="the longest answer, in tokens (default: %(default)s)")
    add_sampling_arguments(p)
    add_engine_arguments(p)
    add_policy_arguments(p)
    p.set_defaults(func=run_chat)


def turn_summary(report, earlier: int) -> str:
    """One line: TTFT, reused and computed tokens, and how many of the ``earlier`` turns (question and
    answer pairs) were loaded. A blend computes them inside its question segment (only the exact path
    keeps a segment per turn), so their count comes from the conversation, not from the report.

    Args:
        report: the turn's :class:`~blend.report.ReuseReport`.
        earlier: the question and answer pairs before this turn.

    Returns:
        The bracketed summary line (no newline).
    """
    loaded = sum(1 for s in report.segments if s.kind is SegmentKind.TURN and s.reuse_class is ReuseClass.EXACT)
    # the policy as asked; what ran only where it is another mode (a refused or exact-only blend)
    ran = "" if report.applied is report.asked else f", ran {report.applied.value}"
    return (f"[ttft {report.timings.ttft_s * 1000:.0f} ms | reused {report.reused_tokens} of {report.prompt_tokens} "
            f"tokens | earlier turns loaded {loaded} of {earlier} | {report.policy}{ran}]")


@dataclass(frozen=True)
class Answered:
    """One question's outcome: the answer as the conversation keeps it, and its report (None when Ctrl-C
    stopped it: the report is the whole answer's)."""

    text: str
    report: ReuseReport | None


def answer_turn(engine, prompt: Prompt, policy: ReusePolicy, config: GenerationConfig, out: TextIO,
                stop: StopRequest) -> Answered:
    """Stream one answer to ``out``, up to where ``stop`` was requested. The prefill runs under ``stop.cancel``
    (:func:`~blend.cancel.cancellable`): a Ctrl-C during it stops it before its next layer, nothing printed.

    Args:
        engine: the chat's engine.
        prompt: the turn's prompt (documents, earlier turns, question).
        policy: the reuse policy.
        config: sampling and stop settings.
        out: where the answer goes.
        stop: the turn's Ctrl-C request (:func:`~blend.termination.ctrl_c_requests_stop`).

    Returns:
        The answer stripped, as the next turn's prompt lays it out: the whole one with its report, or, once
        Ctrl-C stopped it, the text printed before it stopped (what the reader saw; "" when it stopped the
        prefill) without a report.
    """
    from blend.generation import stream

    g = stream(engine, prompt, policy, config)
    try:
        with cancellable(stop.cancel):  # the prefill (the quality gate's first run too) and the first token
            first = next(g, "")  # (decoding never reads the flag: its steps do not run the prefill's layer loop)
    except PrefillCancelled:  # its cache goes with it; each segment it stored is whole (see blend.cancel)
        return Answered("", None)
    shown = print_stream(itertools.chain([first], g), out, stop=lambda: stop.requested)
    if stop.requested:  # the answer's decoding (and its store flush) ends with g: the next turn flushes
        return Answered(shown.strip(), None)
    done = g.result()
    return Answered(done.text.strip(), done.report)


def interrupted_note(kept: str) -> str:
    """The line printed where Ctrl-C stopped an answer: what of the turn the conversation keeps.

    Args:
        kept: the text of the answer written before the interrupt ("" if none).

    Returns:
        The note, without a newline.
    """
    if kept:
        return "(interrupted: the answer so far stays in the conversation)"
    return "(interrupted before the answer began: the question is not kept)"


def read_question(lines: TextIO, out: TextIO, interactive: bool) -> str | None:
    """The next line of input, or None at its end: end of input, or Ctrl-C at an interactive prompt (a
    piped chat's Ctrl-C interrupts the command, as any other's).

    Args:
        lines: where questions are read, one per line (standard input).
        out: where the ``> `` prompt is written (interactive only).
        interactive: whether ``lines`` is a terminal: a prompt is shown and Ctrl-C ends the chat.

    Returns:
        The line as read (its newline kept), or None at the end of input.

    Raises:
        KeyboardInterrupt: Ctrl-C while reading piped input.
    """
    if interactive:
        out.write("> ")
        out.flush()
    try:
        line = lines.readline()
    except KeyboardInterrupt:
        if not interactive:
            raise
        line = ""
    if not line and interactive:  # Ctrl-D or Ctrl-C at the prompt: the shell's prompt on a line of its own
        out.write("\n")
    return line or None


def reconfigured_stdin() -> TextIO:
    """Standard input, its undecodable bytes read as lone surrogates (as a C locale reads them), so that one
    line that is not UTF-8 is refused on its own (the prompt refuses lone surrogates) instead of ending the
    chat: a strict decoder failed on the first read of a chunk, before any question of it was answered.

    Returns:
        ``sys.stdin``, reconfigured where it could be; None where Python started with it closed.
    """
    if sys.stdin is not None and hasattr(sys.stdin, "reconfigure") and sys.stdin.errors == "strict":
        try:
            sys.stdin.reconfigure(errors="surrogateescape")
        except (OSError, ValueError):  # already read with another setting: left as it is
            pass
    return sys.stdin


def run_chat(args: argparse.Namespace, lines: TextIO | None = None, out: TextIO | None = None,
             err: TextIO | None = None) -> int:
    """Answer each line of ``lines`` (default stdin) as the next turn of one conversation.

    At an interactive prompt (``lines`` a terminal), Ctrl-C during an answer stops it at its next piece of
    text and the prompt comes back; what was printed of it stays in the conversation. Ctrl-C during the
    turn's prefill stops it before its next layer and drops the question, as an answer stopped before any
    text does. A second Ctrl-C before the turn stopped ends the chat.
    Ctrl-C or Ctrl-D at the prompt ends it. A piped chat's Ctrl-C ends it (``KeyboardInterrupt``).

    Args:
        args: parsed ``kvblend chat`` arguments.
        lines: where questions come from (one per line).
        out: where answers and summaries go.
        err: where a refused question's error goes (default stderr).

    Returns:
        0, or :data:`~blend.exit_codes.ExitCode.USER_ERROR` when a question was refused (its error is
        printed and the conversation goes on).
    """
    lines = reconfigured_stdin() if lines is None else lines
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    if not args.doc:
        raise InvalidRequestError("give at least one --doc FILE")
    if lines is None:  # started with standard input closed (`<&-`): Python's sys.stdin is None
        raise InvalidRequestError("standard input is closed: the chat reads its questions there, one per line")
    docs = [read_document(p) for p in args.doc]
    policy = policy_from_args(args)
    config = generation_config_from_args(args)  # a bad sampling flag is refused before the model loads
    engine = engine_from_args(args)
    interactive = lines.isatty()
    history: list[Turn] = []
    refused = 0
    while (line := read_question(lines, out, interactive)) is not None:
        question = line.strip()
        if not question:
            continue
        if question == EXIT:
            break
        if question == RESET:
            history.clear()
            print("(new conversation)", file=out)
            continue
        with ctrl_c_requests_stop() if interactive else nullcontext(StopRequest()) as stop:
            try:
                prompt = engine.build_prompt(question, docs, args.system, history=history)
                ans = answer_turn(engine, prompt, policy, config, out, stop)
            except KVBlendError as e:  # e.g. the conversation outgrew the model's context
                outgrown = history and isinstance(e, PromptTooLongError)
                hint = f" ({RESET} starts a new conversation)" if outgrown else ""
                parser = getattr(args, "parser", None)  # a setting's field named as the flag a user typed
                msg = in_flag_words(str(e), flag_names(parser), named_fields(e)) if parser is not None else str(e)
                print(f"kvblend: error: {msg}{hint}", file=err)  # as every other user error: not in the answers
                refused += 1
                continue
            if ans.report is not None:
                print(turn_summary(ans.report, len(history) // 2), file=out)
            else:
                print(interrupted_note(ans.text), file=out)
            if ans.report is not None or ans.text:  # "" if it ended at once; a stopped one with no text: dropped
                history += [Turn(Role.USER, question), Turn(Role.ASSISTANT, ans.text)]
    return ExitCode.USER_ERROR if refused else ExitCode.OK
