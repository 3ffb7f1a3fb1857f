"""The ``kvblend`` command line: argument parsing and printing only.

    kvblend ask QUESTION --doc FILE [--doc FILE ...] [--reuse exact|blend|none] [--json]
    kvblend ask QUESTION --index DIR [--top-k K] ...
    kvblend chat --doc FILE ...   (blend.chat_cli: a conversation, questions from stdin)
    kvblend check [--model M] [--json]
    kvblend eval ...      (blend.evals.cli)
    kvblend ingest ...    (blend.retrieval.cli)
    kvblend demo          (the README's main job)
    kvblend store stats|ls|verify|clear|prune   (blend.store.cli)

Each area's sub-commands are registered by its own cli module, imported only
when that command (or the top-level help) is asked for: ``kvblend ask --help``
imports neither faiss nor the eval harness. Options, defaults and
args -> engine/policy live in :mod:`blend.options`. Nothing imports this module.

Errors a user can cause print one line and exit 2; no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Callable, Sequence, TextIO

from blend import json_text
from blend.cli_messages import OneLineParser, flag_names, in_flag_words, named_fields
from blend.defaults import DEFAULT_GATE_ITEMS, DEFAULT_MAX_NEW_TOKENS, DEFAULT_TOP_K
from blend.errors import InvalidRequestError, KVBlendError
from blend.generation_cli import add_sampling_arguments, generate_answer, generation_config_from_args, stream_answer
from blend.options import (
    add_engine_arguments, add_policy_arguments, engine_from_args, policy_from_args, read_document,
)
from blend.exit_codes import ExitCode
from blend.terminal_text import for_output
from blend.termination import Terminated, sigterm_unwinds

EXIT_USER_ERROR = ExitCode.USER_ERROR
EXIT_BROKEN_PIPE = ExitCode.BROKEN_PIPE  # as a tool the signal ended: the reader of our output left

# command -> (module, function registering it on the subparsers); the module is imported on demand
AREA_COMMANDS: dict[str, tuple[str, str]] = {
    "chat": ("blend.chat_cli", "add_chat_command"),
    "eval": ("blend.evals.cli", "add_eval_command"),
    "ingest": ("blend.retrieval.cli", "add_ingest_command"),
    "demo": ("blend.retrieval.cli", "add_demo_command"),
    "store": ("blend.store.cli", "add_store_command"),
}


def answer_json(engine, ans) -> dict:
    """The JSON object ``kvblend ask --json`` prints.

    Args:
        engine: the engine that answered (its model name and provenance are recorded).
        ans: the :class:`~blend.generation.Completion`, its report included.

    Returns:
        The answer's text and token ids, the prompt's token ids, TTFT in seconds, the logits' sha256, the
        model, the provenance digest and the reuse report, as JSON types.
    """
    return {
        "answer": ans.text,
        "answer_token_ids": ans.token_ids,
        "prompt_token_ids": ans.prompt_token_ids,
        "ttft_s": ans.ttft_s,
        "logits_sha256": ans.logits_sha256(),
        "model": engine.model_name,
        "provenance_sha256": engine.provenance.digest().hex(),
        "report": ans.report.to_dict(),
    }


def print_report(ans, out: TextIO | None = None, with_answer: bool = True) -> None:
    """Human-readable answer (unless it was streamed already) and reuse report (to ``out``, default the
    standard output of the moment).

    Args:
        ans: the :class:`~blend.generation.Completion`, its report included.
        out: where to print; None: ``sys.stdout`` as it is at the call.
        with_answer: whether to print the answer's text first (False where it was streamed).
    """
    out = sys.stdout if out is None else out
    r = ans.report
    if with_answer:
        print(f"answer: {for_output(out)(ans.text)}", file=out)  # escape sequences escaped on a terminal
    print(f"ttft: {ans.ttft_s * 1000:.1f} ms   policy: {r.policy}   ran: {r.applied.value}   "
          f"prompt tokens: {r.prompt_tokens}   "
          f"reused: {r.reused_tokens}   recomputed: {r.recomputed_tokens}", file=out)
    for s in r.segments:
        extra = f" recomputed={s.recomputed}" if s.recomputed else ""
        note = f" ({s.note})" if s.note else ""
        print(f"  {s.kind.value:9s} {s.reuse_class.value:9s} {s.tokens:5d} tok @{s.start:<5d}{extra}{note}", file=out)
    if r.ratio is not None:
        spent = f" (spent {r.spent:.3g} over both passes)" if r.guard and r.spent is not None else ""
        gap = "" if r.first_token_margin is None else f"   first-token gap: {r.first_token_margin:.3g} nats"
        print(f"blend: recompute ratio {r.ratio:.3g}{spent}{gap}", file=out)
    if r.guard:
        print(f"near-tie guard: {r.guard}", file=out)
    if r.gate:
        print(f"gate: {r.gate}", file=out)
    if r.gate_ran:
        print(f"quality gate ran once before this request: {r.timings.gate_s:.1f} s (not in TTFT)", file=out)


def run_ask(args: argparse.Namespace) -> int:
    """``kvblend ask``: answer a question over ``--doc`` files (or an ``--index``), streaming the answer and
    printing its reuse report, or printing one JSON object with ``--json``.

    Args:
        args: the parsed ``ask`` arguments.

    Returns:
        The exit status: 0 (every failure raises).

    Raises:
        InvalidRequestError: neither ``--doc`` nor ``--index`` was given.
    """
    if args.index:
        from blend.retrieval.cli import ask_over_index  # faiss and the index load only for --index

        return ask_over_index(args)
    if not args.doc:
        raise InvalidRequestError("give at least one --doc FILE (or --index DIR)")
    docs = [read_document(p) for p in args.doc]
    policy = policy_from_args(args)
    config = generation_config_from_args(args)  # sampling options, refused before the model loads
    engine = engine_from_args(args)
    prompt = engine.build_prompt(args.question, docs, args.system)
    if args.json:
        print(json_text.dumps(answer_json(engine, generate_answer(engine, prompt, policy, config))))
    else:
        print_report(stream_answer(engine, prompt, policy, config), with_answer=False)
    return 0


def run_check(args: argparse.Namespace) -> int:
    """``kvblend check``: run, record and print the gate; exit 1 when it fails.

    Args:
        args: the parsed ``check`` arguments (``--items``, ``--json``, the engine's flags).

    Returns:
        The exit status: 0 if the gate passed, 1 if it failed.
    """
    from blend.gate import AT_LEAST, check_items, record, run_gate

    check_items(args.items, "--items")  # before the engine loads
    engine = engine_from_args(args)
    result = run_gate(engine, items=args.items, progress=not args.json)
    try:
        record(engine, result, args.items)
    except OSError as e:  # the verdict still stands for what it measured: shown, not thrown away
        print(f"kvblend: warning: could not record the gate's result ({e}); it is shown below but later "
              "processes will run the gate again", file=sys.stderr)
    if args.json:
        print(json_text.dumps(result.to_dict()))
    else:
        for c in result.checks:
            cmp = ">=" if c.name in AT_LEAST else "<="
            print(f"{'PASS' if c.passed else 'FAIL'}  {c.name.value:14s} {c.figure:.3g} ({cmp} {c.bound:g})  {c.detail}")
        print(f"blend gate for {engine.model_name}: {'PASSED' if result.passed else 'FAILED'}")
    return 0 if result.passed else 1


def _command_of(argv: Sequence[str]) -> str | None:
    """The sub-command named on the command line (None: none yet, e.g. ``kvblend --help``)."""
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``kvblend`` parser; with ``command``, only that area's cli module is imported.

    Args:
        command: the sub-command about to be parsed (None: register every command).

    Returns:
        The parser.
    """
    parser = OneLineParser(prog="kvblend", description="KV reuse for RAG prompts")
    sub = parser.add_subparsers(dest="command", required=True)

    ask = sub.add_parser("ask", help="answer a question over documents")
    ask.add_argument("question", help="the question (one argument: quote it)")
    ask.add_argument("--doc", action="append", default=[], metavar="FILE",
                     help="a document (repeatable); with --index, placed after the retrieved chunks")
    ask.add_argument("--index", default=None, metavar="DIR", help="retrieve documents from an index")
    ask.add_argument("--top-k", type=int, default=DEFAULT_TOP_K, metavar="K",
                     help="with --index: how many chunks to retrieve (default: %(default)s)")
    ask.add_argument("--system", default=None, help="system prompt")
    ask.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS, metavar="N",
                     help="the longest answer, in tokens (default: %(default)s)")
    ask.add_argument("--json", action="store_true", help="print one JSON object")
    add_sampling_arguments(ask)
    add_engine_arguments(ask)
    add_policy_arguments(ask)
    ask.set_defaults(func=run_ask)

    check = sub.add_parser("check", help="the per-model quality gate for blended reuse")
    check.add_argument("--json", action="store_true")
    check.add_argument("--items", type=int, default=DEFAULT_GATE_ITEMS,
                       help="calibration prompts, 1-6 (default: %(default)s)")
    add_engine_arguments(check)
    check.set_defaults(func=run_check)

    # serve is parsed by blend.serve.cli, imported only when serve runs (FastAPI, uvicorn)
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (kvblend serve --help)",
                           add_help=False, prefix_chars="+")  # "+": every -- option reaches serve's own parser
    serve.add_argument("serve_args", nargs="*", help=argparse.SUPPRESS)
    serve.set_defaults(func=lambda args: importlib.import_module("blend.serve.cli").main(args.serve_args))

    for name, (module, adder) in AREA_COMMANDS.items():
        if command is None or command == name or command not in {"ask", "check", "serve", *AREA_COMMANDS}:
            register: Callable = getattr(importlib.import_module(module), adder)
            register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvblend`` console script.

    Args:
        argv: the command line after the program's name; None: ``sys.argv[1:]``.

    Returns:
        The exit status: the command's (0 on success), :class:`~blend.exit_codes.ExitCode` ``USER_ERROR``
        for an error a user caused (one line on stderr), ``INTERRUPTED``, ``TERMINATED`` or ``BROKEN_PIPE``.
    """
    printable_output()
    try:
        try:
            return _run(argv)
        finally:  # what is still buffered goes now, where a reader that left is seen: at interpreter exit
            sys.stdout.flush()  # it printed "Exception ignored ... BrokenPipeError" and exited 120
    except BrokenPipeError:  # the reader left (`kvblend store ls | head`): not an error of ours
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to flush at exit
        except (OSError, ValueError):  # a stdout without a descriptor (captured): nothing to redirect
            pass
        return EXIT_BROKEN_PIPE


def printable_output() -> None:
    """Standard output and error write what their encoding cannot hold as escapes (``\\ufffd``), as Python's
    own stderr does: an answer or a file name in a non-UTF-8 terminal (``LANG=en_US.ISO-8859-1``,
    ``PYTHONIOENCODING=ascii``) ended the command with a codec error, half printed. A stream the command was
    started without (``>&-``: Python's ``None``) discards what is written to it, as ``print`` does."""
    if sys.stdout is None:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - the process's own stdout from now on
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115
    for stream in (sys.stdout, sys.stderr):
        if getattr(stream, "errors", None) == "strict" and hasattr(stream, "reconfigure"):
            try:
                stream.reconfigure(errors="backslashreplace")
            except (OSError, ValueError):
                pass


def _run(argv: Sequence[str] | None) -> int:
    """Parse and run one command; every error a user can cause is one line on stderr and an exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(_command_of(argv))
    args = parser.parse_args(argv)
    args.parser = parser  # an error names the flag a user typed, not a Python field (cli_messages)
    try:
        with sigterm_unwinds():  # finally blocks run and queued store writes are flushed at exit
            return int(args.func(args) or 0)
    except Terminated:
        print("kvblend: terminated", file=sys.stderr)
        return ExitCode.TERMINATED
    except BrokenPipeError:
        raise  # main's: not an OSError of the command's
    except (KVBlendError, ValueError, OSError) as e:  # OSError, ValueError: the store/eval/retrieval layers'
        print(f"kvblend: error: {in_flag_words(str(e), flag_names(parser), named_fields(e))}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("kvblend: interrupted", file=sys.stderr)
        return ExitCode.INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
