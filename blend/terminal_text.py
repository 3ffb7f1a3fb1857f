"""Text from files, indexes or stores, made safe to print on a terminal.

A file name, a stored model name or an index's recorded path can hold control characters: an escape
sequence printed raw clears the screen, fakes output or sets the window title, and a lone surrogate
crashes the print. Such text is shown with Python's escapes instead (``\\x1b``, ``\\ud800``).
"""

from __future__ import annotations

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
