"""Log-probabilities of the answer's tokens (OpenAI's ``logprobs``).

A token's log-probability is read from the model's own distribution for that
step: ``log_softmax`` of the logits row it was sampled from, before penalties,
logit_bias, temperature, top-k or top-p (vLLM's default, "raw" log-probabilities), so a
blended answer's log-probabilities compare directly with an exact one's. The
alternatives are that row's most likely tokens, most likely first (equal values
in token-id order, so a greedy answer's token, the argmax, comes first).

A token's bytes (OpenAI's ``bytes``) are its own UTF-8 bytes, so that a
character spread over several tokens can be put back together, whereas its
text decodes such a piece to U+FFFD.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch

from blend.detokenize import REPLACEMENT

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a SentencePiece byte-fallback token


@dataclass(frozen=True)
class TokenLogprob:
    """One answer token's log-probability and the step's most likely alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, log-probability), most likely first


def token_logprob(logits: torch.Tensor, token_id: int, top_n: int) -> TokenLogprob:
    """The log-probability of ``token_id`` under one step's logits.

    Args:
        logits: (V,) the step's next-token logits (any float dtype).
        token_id: the token that was sampled.
        top_n: how many alternatives to keep (0: none).

    Returns:
        The token's entry.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)  # (V,)
    top = top_alternatives(logp, top_n) if top_n > 0 else ()
    return TokenLogprob(int(token_id), float(logp[token_id]), top)


def top_alternatives(logp: torch.Tensor, n: int) -> tuple[tuple[int, float], ...]:
    """The ``n`` most likely tokens of a row, most likely first, equal values in token-id order.

    ``torch.topk`` orders equal values arbitrarily (and picks arbitrarily among those tied at the n-th
    place): a greedy answer's token (``argmax``: the lowest id of the tied best) was then not always the
    first alternative, and the same row could list its ties in another order. Ties are common in a bf16
    engine's logits (8 bits of mantissa).

    Args:
        logp: (V,) float32 log-probabilities.
        n: alternatives to keep (>= 1).

    Returns:
        (token id, log-probability) pairs.
    """
    vals, ids = torch.topk(logp, min(n, logp.shape[0]))  # (n,) each
    last = vals[-1]
    above = torch.nonzero(logp > last).flatten()  # (a,) ids, ascending
    tied = torch.nonzero(logp == last).flatten()[: vals.shape[0] - above.shape[0]]  # (n - a,) the lowest ids
    if above.shape[0] + tied.shape[0] != vals.shape[0]:  # a NaN row orders nothing: topk's own pick
        return tuple(zip(ids.tolist(), vals.tolist()))
    ids = torch.cat([above, tied])  # (n,)
    vals, order = torch.sort(logp[ids], descending=True, stable=True)  # (n,) each; equal values keep id order
    return tuple(zip(ids[order].tolist(), vals.tolist()))


@functools.lru_cache(maxsize=1)
def byte_level_chars() -> dict[int, str]:
    """The GPT-2 byte-level BPE alphabet: the printable character that stands for each byte.

    Returns:
        {byte: character} for the 256 bytes.
    """
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    keep += list(range(ord("®"), ord("ÿ") + 1))
    chars = keep[:]
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(keep, (chr(c) for c in chars)))


@functools.lru_cache(maxsize=1)
def _byte_of_char() -> dict[str, int]:
    """The byte each character of :func:`byte_level_chars` stands for."""
    return {c: b for b, c in byte_level_chars().items()}


SP_SPACE = "\u2581"  # SentencePiece's word-boundary mark: a space before the piece


def token_bytes(tokenizer, token_id: int) -> bytes:
    """A token's own bytes: its text's UTF-8, or, for a piece of a multi-byte character (whose
    text is U+FFFD), the bytes its vocabulary entry stands for (byte-level BPE or a SentencePiece
    byte token).

    Args:
        tokenizer: the model's tokenizer.
        token_id: the token.

    Returns:
        The bytes (the text's UTF-8 when the entry is of neither kind).
    """
    text = tokenizer.decode([token_id])
    if REPLACEMENT not in text:
        # SentencePiece marks a word's leading space with U+2581 and decoding one token alone drops it
        # ("\u2581Paris" -> "Paris"): the piece keeps it, so the tokens' texts join up to the answer's
        piece = tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and piece.startswith(SP_SPACE) and not text.startswith(" "):
            spaced = piece.replace(SP_SPACE, " ")
            if spaced.lstrip(" ") == text:
                return spaced.encode("utf-8")
        return text.encode("utf-8")
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if not isinstance(piece, str) or not piece:
        return text.encode("utf-8")
    m = _BYTE_PIECE.fullmatch(piece)
    if m is not None:
        return bytes([int(m.group(1), 16)])
    table = _byte_of_char()
    if all(c in table for c in piece):
        return bytes(table[c] for c in piece)
    return text.encode("utf-8")
