"""Text from files, indexes or stores, made safe to print on a terminal; a model's answers too (:func:`answer_shown`).

A file name, a stored model name or an index's recorded path can hold control characters: an escape
sequence printed raw clears the screen, fakes output or sets the window title, and a lone surrogate
crashes the print. Such text is shown with Python's escapes instead (``\\x1b``, ``\\ud800``).
"""

from __future__ import annotations

from typing import Callable

from blend.prompt import is_unicode


def shown(text: str) -> str:
    """``text`` as printed: unchanged when printable, else with control characters and lone surrogates
    escaped (``ascii()`` without its quotes).

    Args:
        text: any string.

    Returns:
        A string with no control character and no lone surrogate.
    """
    if text.isprintable() and is_unicode(text):
        return text
    return "".join(c if c.isprintable() and is_unicode(c) else ascii(c)[1:-1] for c in text)


def answer_shown(text: str) -> str:
    """A model's answer as a terminal shows it: newlines and tabs kept, every other control character (an
    escape sequence's ESC, BEL, a C1 CSI) and lone surrogate escaped as :func:`shown` does. A retrieved
    document can ask the model to repeat an escape sequence; printed raw, it would retitle the window,
    clear the screen or fake the report below the answer.

    Args:
        text: the answer's text, or one streamed piece of it (a sequence split across pieces is caught
            by its first character: each control character is escaped on its own).

    Returns:
        The text with no control character but newlines and tabs.
    """
    if is_unicode(text) and all(c.isprintable() or c in "\n\t" for c in text):
        return text
    return "".join(c if c in "\n\t" else shown(c) for c in text)


def for_output(out: object) -> Callable[[str], str]:
    """How an answer is written to ``out``: through :func:`answer_shown` on a terminal, unchanged to a pipe
    or file (a script reading ``kvblend ask`` gets the model's exact text; ``--json`` escapes it anyway).

    Args:
        out: the stream the answer goes to.

    Returns:
        A function from answer text to the text to write.
    """
    try:
        tty = bool(out.isatty())  # type: ignore[attr-defined]
    except (AttributeError, ValueError, OSError):  # a closed stream, or no isatty at all
        tty = False
    return answer_shown if tty else (lambda text: text)
