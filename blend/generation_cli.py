"""Generation options of ``kvblend ask`` and its streamed output.

    kvblend ask QUESTION --doc FILE ... [--temperature T] [--top-p P] [--seed S] [--stop STR ...] [--multiline]

(``ask --top-k`` is the retrieval depth; top-k sampling is in the Python API and the server.) The same
options apply with ``--index`` (answers over an index decode through the same stream).

The answer is printed as it is decoded; the reuse report follows it.
Defaults reproduce the engine's historical answers: greedy, single line (the sampling defaults come
from :mod:`blend.defaults`, as the Python API's and the server's do).
Like ``blend.cli``, this module imports torch only when a command runs (so
``kvblend --help`` stays fast).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from typing import TYPE_CHECKING, Callable, Iterator, TextIO

from blend.defaults import DEFAULT_TEMPERATURE, DEFAULT_TOP_P
from blend.termination import Terminated
from blend.terminal_text import for_output

if TYPE_CHECKING:
    from blend.generation import Completion
    from blend.policy import ReusePolicy
    from blend.prompt import Prompt
    from blend.generation_config import GenerationConfig


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    """--temperature, --top-p, --seed, --stop, --multiline.

    Args:
        p: the command's parser.
    """
    p.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE,
                   help="0 = greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=DEFAULT_TOP_P, help="nucleus sampling (default: %(default)s: off)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (same seed, same answer)")
    p.add_argument("--stop", action="append", default=[], metavar="STR", help="stop string (repeatable)")
    p.add_argument("--multiline", action="store_true", help="do not stop at the first newline")


def generation_config_from_args(args: argparse.Namespace) -> "GenerationConfig":
    """The :class:`GenerationConfig` of parsed ``ask`` arguments.

    Args:
        args: parsed arguments holding :func:`add_sampling_arguments`' flags and ``max_new_tokens``.

    Returns:
        The config.

    Raises:
        InvalidSettingError: a setting out of range (checked before any model loads).
    """
    from blend.generation_config import GenerationConfig

    return GenerationConfig(max_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed, stop=tuple(args.stop),
                            stop_at_newline=not args.multiline)


def stream_answer(engine, prompt: "Prompt", policy: "ReusePolicy", config: "GenerationConfig",
                  out: TextIO | None = None) -> "Completion":
    """Print ``answer: ...`` as the tokens come (leading whitespace dropped; to ``out``, default the standard
    output of the moment) and return the completion.

    Args:
        engine: a :class:`blend.engine.Engine`.
        prompt: from ``engine.build_prompt``.
        policy: the reuse policy.
        config: sampling and stop settings.
        out: where the answer is printed; None: ``sys.stdout`` as it is at the call.

    Returns:
        The finished :class:`~blend.generation.Completion` (its text unstripped).
    """
    from blend.generation import stream

    g = stream(engine, prompt, policy, config)
    print_stream(g, sys.stdout if out is None else out)
    return g.result()


def print_stream(pieces: Iterator[str], out: TextIO | None = None, prefix: str = "answer: ",
                 stop: Callable[[], bool] | None = None) -> str:
    """Write a streamed answer as its pieces come: ``prefix``, the text (leading whitespace dropped), a
    newline. Nothing is written when the first piece raises (a request refused when generation
    starts), so no half answer is left behind, nor when ``stop`` is already true when it comes.

    An interrupt (Ctrl-C, SIGTERM) raised while the text is printed ends its line before it goes on, so
    the command's ``kvblend: interrupted`` starts a line of its own.

    Args:
        pieces: the answer's text pieces (a :class:`~blend.generation.Generation` or a RAG stream).
        out: where to write (default: the standard output of the moment).
        prefix: written before the first piece.
        stop: asked before each piece is written; True ends the answer there (a chat's Ctrl-C).

    Returns:
        The text written after ``prefix`` (what a reader saw of the answer), without the newline.
    """
    out = sys.stdout if out is None else out
    stopped = stop if stop is not None else (lambda: False)
    first = next(pieces, "")  # a request refused when generation starts raises here, before any output
    if stopped():
        return ""
    out.write(prefix)
    visible = for_output(out)  # a terminal gets control characters escaped; the returned text stays the model's
    shown: list[str] = []
    try:
        for piece in itertools.chain([first], pieces):
            if stopped():
                break
            if not shown:
                piece = piece.lstrip()
            out.write(visible(piece))
            out.flush()
            if piece:
                shown.append(piece)
    except (KeyboardInterrupt, Terminated):
        _end_line(out)
        raise
    out.write("\n")
    return "".join(shown)


def _end_line(out: TextIO) -> None:
    """End a half-printed answer's line (best effort: the reader may have left)."""
    try:
        out.write("\n")
        out.flush()
    except (OSError, ValueError):
        pass


def generate_answer(engine, prompt: "Prompt", policy: "ReusePolicy", config: "GenerationConfig") -> "Completion":
    """The whole answer at once, its text stripped as ``kvblend ask --json`` reports it.

    Args:
        engine: a :class:`blend.engine.Engine`.
        prompt: from ``engine.build_prompt``.
        policy: the reuse policy.
        config: sampling and stop settings.

    Returns:
        The finished :class:`~blend.generation.Completion`, its text stripped of surrounding whitespace.
    """
    import dataclasses

    from blend.generation import generate

    done = generate(engine, prompt, policy, config)
    return dataclasses.replace(done, text=done.text.strip())
