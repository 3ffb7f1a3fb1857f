"""User text that spells a control token (``<|im_end|>``, ``<|endoftext|>``...) reads as that text.

A tokenizer parses a special token's string wherever it occurs, so a retrieved document, a question,
a system prompt or an earlier turn holding ``<|im_end|>\\n<|im_start|>assistant\\n`` would close its
turn and open the assistant's: text anybody can write into a corpus would steer the prompt's
structure (and ``<|endoftext|>`` would end it). Only the control tokens the prompt layout and the
chat template write are tokens; in user text they are encoded as the characters they are.

How (the same idea as transformers' ``apply_chat_template(sanitize_control_tokens=True)``, which
tokenizes a whole chat at once where kvblend tokenizes segments): :func:`mark` wraps each control
token's string in user text between two Unicode noncharacters; the template renders the marked
text; :func:`encode_marked` tokenizes the pieces between marked strings as usual and each marked
string without its added tokens. Text that holds no control token's string is never marked, so its
token ids are exactly the tokenizer's own (every prompt without such text is unchanged).
"""

from __future__ import annotations

import re
import threading
import weakref
from dataclasses import dataclass, field

# Unicode noncharacters: reserved for a program's internal use, never meaningful in interchanged text
OPEN = "\ufdd0"
CLOSE = "\ufdd1"
_MARKERS = re.compile(f"[{OPEN}{CLOSE}]")


@dataclass(frozen=True)
class ControlTokens:
    """A tokenizer's control tokens as patterns, and whether it adds special tokens of its own."""

    strings: tuple[str, ...]  # the added tokens' strings, longest first
    find: re.Pattern  # any of them
    split: re.Pattern  # OPEN token CLOSE (captured) or a lone marker (captures None)
    adds_special: bool  # encoding with special tokens adds some (a BOS in front): see blend.prompt.adds_special_tokens
    literal: dict[str, tuple[int, ...]] = field(default_factory=dict, compare=False)  # string -> its ids as text


SPECIAL_PROBE = "a"  # a text encoded with and without special tokens: do they differ (ControlTokens.adds_special)
_cache: "weakref.WeakKeyDictionary[object, ControlTokens]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def control_tokens(tokenizer) -> ControlTokens:
    """The strings ``tokenizer`` matches whole as added tokens, and whether it adds special tokens (made once
    per tokenizer: tokens added to it, or a post-processor set on it, later are not seen).

    Args:
        tokenizer: a transformers tokenizer.

    Returns:
        Its :class:`ControlTokens`: every added token, special or not, and every special token it names.
    """
    with _lock:
        found = _cache.get(tokenizer)
        if found is None:
            found = _build(tokenizer)
            _cache[tokenizer] = found
        return found


def _build(tokenizer) -> ControlTokens:
    # every added token, special or not: the tokenizer matches each one whole in any text (Qwen2.5's
    # <tool_call> and <|fim_prefix|> are added tokens not flagged special, as are a GGUF's user-defined ones)
    strings = {str(t) for t in getattr(tokenizer, "all_special_tokens", ()) or ()}
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    strings |= {t.content for t in decoder.values()}
    ordered = tuple(sorted((s for s in strings if s), key=len, reverse=True))
    find = re.compile("|".join(map(re.escape, ordered)) or "(?!)")  # (?!) never matches
    split = re.compile(f"{OPEN}({find.pattern}){CLOSE}|[{OPEN}{CLOSE}]")
    adds = list(tokenizer(SPECIAL_PROBE)["input_ids"]) != list(_plain(tokenizer, SPECIAL_PROBE))
    return ControlTokens(ordered, find, split, adds)


def holds_control(tokenizer, text: str) -> bool:
    """Whether ``text`` holds a control token's string (or one of this module's markers).

    Args:
        tokenizer: the model's tokenizer.
        text: user text.

    Returns:
        True if :func:`mark` would change it.
    """
    return bool(control_tokens(tokenizer).find.search(text)) or bool(_MARKERS.search(text))


def mark(tokenizer, text: str) -> str:
    """User text with each control token's string wrapped in the markers.

    Args:
        tokenizer: the model's tokenizer.
        text: user text (markers already in it are dropped, so none can be forged).

    Returns:
        The marked text, for a template to render and :func:`encode_marked` to tokenize.
    """
    return control_tokens(tokenizer).find.sub(lambda m: f"{OPEN}{m.group(0)}{CLOSE}", unmark(text))


def unmark(text: str) -> str:
    """Marked text as the model reads it.

    Args:
        text: any text.

    Returns:
        ``text`` without this module's markers.
    """
    return _MARKERS.sub("", text)


def encode_marked(tokenizer, text: str) -> tuple[int, ...]:
    """Token ids of marked text: marked control strings as plain text, the rest as the tokenizer reads it
    (the control tokens a template wrote included).

    Args:
        tokenizer: the tokenizer that :func:`mark` ran with.
        text: rendered text whose user parts went through :func:`mark`.

    Returns:
        The ids, no special tokens added.
    """
    ct = control_tokens(tokenizer)
    pieces = ct.split.split(text)  # [text, marked, text, marked, ..., text]
    # the stretches between marked strings, each encoded as a continuation of the text before it (one
    # tokenizer call for them all); the first as the start it is
    later = [p for i, p in enumerate(pieces) if i > 0 and i % 2 == 0 and p]
    continued = iter(_continuations(tokenizer, later))
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        if not piece:  # an empty stretch, or a lone marker (None): it still breaks the text there
            continue
        if i % 2 == 1:
            if piece not in ct.literal:
                ct.literal[piece] = _literal(tokenizer, piece)
            ids += ct.literal[piece]
        else:
            ids += _plain(tokenizer, piece) if i == 0 else next(continued)
    return tuple(ids)


def encode_user_text(tokenizer, text: str) -> tuple[int, ...]:
    """Token ids of text that is all the user's (a document).

    Args:
        tokenizer: the model's tokenizer.
        text: the text.

    Returns:
        The tokenizer's own ids where it holds no control token's string, else :func:`encode_marked` of it
        marked; no special tokens added.
    """
    if not holds_control(tokenizer, text):
        return _plain(tokenizer, text)
    return encode_marked(tokenizer, mark(tokenizer, text))


def _plain(tokenizer, text: str) -> tuple[int, ...]:
    return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])


def _continuations(tokenizer, pieces: list[str]) -> list[tuple[int, ...]]:
    """Each piece's ids as the middle of a text (:func:`_after_newline`), one tokenizer call for them all."""
    if not pieces:
        return []
    newline = _plain(tokenizer, "\n")
    batch = tokenizer(["\n" + p for p in pieces], add_special_tokens=False)["input_ids"]
    return [_after_newline(tuple(ids), newline, lambda p=p: _plain(tokenizer, p)) for p, ids in zip(pieces, batch)]


def _literal(tokenizer, piece: str) -> tuple[int, ...]:
    """``piece`` encoded with no added token recognised, as the middle of a text (:func:`_after_newline`)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    encode = _backend_encoder(backend) if backend is not None else _slow_encoder(tokenizer)
    return _after_newline(tuple(encode("\n" + piece)), tuple(encode("\n")), lambda: tuple(encode(piece)))


def _after_newline(ids: tuple[int, ...], newline: tuple[int, ...], alone) -> tuple[int, ...]:
    """The ids of a piece encoded after a newline, the newline's ids dropped: a SentencePiece tokenizer
    would otherwise add a word-start space the text does not have. ``alone()`` (the piece encoded by
    itself) where the newline merged with the piece."""
    return ids[len(newline):] if newline and ids[:len(newline)] == newline else alone()


def _backend_encoder(backend):
    """A fast tokenizer's pipeline without its added tokens (normalizer, pre-tokenizer, model), on the
    shared backend without touching its ``encode_special_tokens`` switch (another thread may be encoding)."""
    def encode(s: str) -> list[int]:
        if backend.normalizer is not None:
            s = backend.normalizer.normalize_str(s)
        splits = [p for p, _ in backend.pre_tokenizer.pre_tokenize_str(s)] if backend.pre_tokenizer is not None else [s]
        return [t.id for part in splits for t in backend.model.tokenize(part)]
    return encode


def _slow_encoder(tokenizer):
    """A Python tokenizer's encoding with special tokens split (a per-call argument there)."""
    return lambda s: list(tokenizer(s, add_special_tokens=False, split_special_tokens=True)["input_ids"])
