"""Chunking by model tokens, cut at paragraph or sentence boundaries.

A document is split into units (sentences inside paragraphs; an over-long
sentence is split at line breaks, then words, then characters), each unit's
tokens are counted with the model's tokenizer, and units are packed greedily
up to ``target_tokens``. A cut at a paragraph break is preferred when the
chunk is at least ``min_fill`` full there. Overlap is made of whole trailing
units of the previous chunk (at most ``overlap_tokens`` tokens), so chunks
still begin at a sentence boundary.

A chunk's id is sha256 over the tokenizer fingerprint and its text: an
unchanged document always yields the same ids.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from blend.defaults import DEFAULT_CHUNK_TOKENS

CHUNKER_VERSION = 2  # part of every file's chunking signature: a change re-chunks indexed files (2: closing quotes kept)
_PARA = re.compile(r"\n[ \t]*\n\s*")
_SENT = re.compile(r"[.!?][\"')\]]*(\s+)")  # the cut is group 1: closing quotes stay in the sentence
_LINE = re.compile(r"\n+")
_WORD = re.compile(r"\s+")


@dataclass(frozen=True)
class ChunkerConfig:
    """How documents are cut.

    Attributes:
        target_tokens: maximum tokens per chunk (by the sum of unit counts).
        overlap_tokens: at most this many tokens of whole trailing sentences repeated.
        min_fill: a paragraph break is preferred as the cut if the chunk is at
            least this fraction of ``target_tokens`` there.
    """

    target_tokens: int = DEFAULT_CHUNK_TOKENS
    overlap_tokens: int = 0
    min_fill: float = 0.5

    def __post_init__(self) -> None:
        if self.target_tokens < 8:
            raise ValueError(f"target_tokens must be >= 8, got {self.target_tokens}")
        if not 0 <= self.overlap_tokens < self.target_tokens:
            raise ValueError(f"overlap_tokens must be in [0, target_tokens), got {self.overlap_tokens}")
        if not 0.0 <= self.min_fill <= 1.0:
            raise ValueError(f"min_fill must be in [0, 1], got {self.min_fill}")

    def fingerprint(self) -> str:
        """Canonical JSON of the configuration."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class Chunk:
    """One chunk of a document.

    Attributes:
        chunk_id: sha256 hex of (tokenizer fingerprint, text).
        text: the chunk text, ``doc_text[start:end]``.
        start: character offset in the document text (inclusive).
        end: character offset in the document text (exclusive).
        n_tokens: tokens of ``text`` alone (no special tokens).
        ordinal: position of the chunk within its document.
    """

    chunk_id: str
    text: str
    start: int
    end: int
    n_tokens: int
    ordinal: int


@dataclass(frozen=True)
class _Unit:
    start: int
    end: int
    para_start: bool  # a paragraph break precedes this unit


def chunk_id(tokenizer_fp: str, text: str) -> str:
    """The id of a chunk: sha256 over the tokenizer fingerprint and the text.

    Args:
        tokenizer_fp: fingerprint string of the tokenizer used for chunking.
        text: the chunk text.

    Returns:
        64 hex characters.
    """
    h = hashlib.sha256(b"kvblend-chunk-v1\x00")
    h.update(tokenizer_fp.encode("utf-8"))
    h.update(b"\x00")
    h.update(text.encode("utf-8"))
    return h.hexdigest()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A sha256 fingerprint of a tokenizer's vocabulary and rules.

    Args:
        tokenizer: a ``transformers`` tokenizer or a ``tokenizers.Tokenizer``.

    Returns:
        64 hex characters; equal for equal tokenizers across processes.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None and hasattr(tokenizer, "to_str"):
        backend = tokenizer
    if backend is not None:
        payload = backend.to_str()
    else:
        vocab = sorted(tokenizer.get_vocab().items())
        payload = json.dumps([type(tokenizer).__name__, vocab], ensure_ascii=False)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def count_tokens(tokenizer: Any, texts: Sequence[str]) -> list[int]:
    """Token counts of each text, without special tokens.

    Args:
        tokenizer: a ``transformers`` tokenizer or a ``tokenizers.Tokenizer``.
        texts: strings to count.

    Returns:
        One count per text.
    """
    if not texts:
        return []
    if hasattr(tokenizer, "encode_batch") and not hasattr(tokenizer, "backend_tokenizer"):
        return [len(e.ids) for e in tokenizer.encode_batch(list(texts), add_special_tokens=False)]
    ids = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    return [len(x) for x in ids]


def _spans(text: str, start: int, end: int, pattern: re.Pattern[str]) -> list[tuple[int, int]]:
    """Split ``text[start:end]`` at ``pattern`` (at its group 1 if it has one) into whitespace-trimmed spans."""
    out: list[tuple[int, int]] = []
    pos = start
    g = 1 if pattern.groups else 0
    for m in pattern.finditer(text, start, end):
        out.append((pos, m.start(g)))
        pos = m.end(g)
    out.append((pos, end))
    trimmed: list[tuple[int, int]] = []
    for s, e in out:
        while s < e and text[s].isspace():
            s += 1
        while e > s and text[e - 1].isspace():
            e -= 1
        if e > s:
            trimmed.append((s, e))
    return trimmed


def _units(text: str, tokenizer: Any, target: int) -> tuple[list[_Unit], list[int]]:
    """Sentence units with token counts; over-long sentences are split further."""
    units: list[_Unit] = []
    for ps, pe in _spans(text, 0, len(text), _PARA):
        for i, (s, e) in enumerate(_spans(text, ps, pe, _SENT)):
            units.append(_Unit(s, e, i == 0))
    counts = count_tokens(tokenizer, [text[u.start : u.end] for u in units])
    out_u: list[_Unit] = []
    out_c: list[int] = []
    for u, c in zip(units, counts):
        if c <= target:
            out_u.append(u)
            out_c.append(c)
            continue
        for k, (pu, pc) in enumerate(_split_long(text, u.start, u.end, tokenizer, target)):
            out_u.append(_Unit(pu[0], pu[1], u.para_start and k == 0))
            out_c.append(pc)
    return out_u, out_c


def _split_long(text: str, start: int, end: int, tokenizer: Any, target: int) -> list[tuple[tuple[int, int], int]]:
    """Split one over-long span into pieces of <= target tokens (lines, words, chars)."""
    for pattern in (_LINE, _WORD):
        parts = _spans(text, start, end, pattern)
        if len(parts) > 1:
            counts = count_tokens(tokenizer, [text[s:e] for s, e in parts])
            pieces: list[tuple[tuple[int, int], int]] = []
            for (s, e), c in zip(parts, counts):
                if c > target:
                    pieces.extend(_split_long(text, s, e, tokenizer, target))
                else:
                    pieces.append(((s, e), c))
            return _merge(pieces, target)
    # one unbreakable word: cut by characters, shrinking until each piece fits
    pieces = []
    pos = start
    while pos < end:
        step = max(1, min(end - pos, target * 2))
        while True:
            c = count_tokens(tokenizer, [text[pos : pos + step]])[0]
            if c <= target or step == 1:
                break
            step = max(1, step * target // max(c, 1) - 1)
        pieces.append(((pos, pos + step), c))
        pos += step
    return pieces


def _merge(pieces: list[tuple[tuple[int, int], int]], target: int) -> list[tuple[tuple[int, int], int]]:
    """Greedily merge adjacent small pieces back up to the target."""
    out: list[tuple[tuple[int, int], int]] = []
    for (s, e), c in pieces:
        if out and out[-1][1] + c <= target:
            (ps, _), pc = out[-1]
            out[-1] = ((ps, e), pc + c)
        else:
            out.append(((s, e), c))
    return out


def chunk_text(text: str, tokenizer: Any, tokenizer_fp: str, config: ChunkerConfig = ChunkerConfig()) -> list[Chunk]:
    """Cut one document into chunks.

    Args:
        text: the document text.
        tokenizer: the model's tokenizer (any ``transformers`` or ``tokenizers`` one).
        tokenizer_fp: its fingerprint (see :func:`tokenizer_fingerprint`).
        config: sizes and overlap.

    Returns:
        Chunks in document order; empty for whitespace-only text.
    """
    units, counts = _units(text, tokenizer, config.target_tokens)
    n = len(units)
    spans: list[tuple[int, int]] = []  # (first unit, one past last unit)
    i = end = 0  # end: one past the previous chunk's last unit
    while i < n:
        j, total = i, 0
        while j < n and (j == i or total + counts[j] <= config.target_tokens):
            total += counts[j]
            j += 1
        if j < n:  # cutting: prefer the last paragraph break that leaves the chunk full enough
            fill, best = 0, None
            for p in range(i + 1, j):
                fill += counts[p - 1]
                # past the previous chunk's end: a cut inside the overlap made a chunk of repeated text only
                if p > end and units[p].para_start and fill >= config.min_fill * config.target_tokens:
                    best = p
            if best is not None:
                j = best
        spans.append((i, j))
        end = j
        if j >= n:
            break
        k, ov = j, 0  # overlap: whole trailing units, never the chunk's first, leaving room for unit j
        while k - 1 > i and ov + counts[k - 1] <= config.overlap_tokens and ov + counts[k - 1] + counts[j] <= config.target_tokens:
            ov += counts[k - 1]
            k -= 1
        i = k
    texts = [text[units[a].start : units[b - 1].end] for a, b in spans]
    exact = count_tokens(tokenizer, texts)
    return [
        Chunk(chunk_id(tokenizer_fp, t), t, units[a].start, units[b - 1].end, c, o)
        for o, ((a, b), t, c) in enumerate(zip(spans, texts, exact))
    ]
