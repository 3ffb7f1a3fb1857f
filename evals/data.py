"""Evaluation data: CacheBlend-style records from JSON / JSONL, validated.

Record format (as in ``../shared/data/musique_dev.json``)::

    {"ctxs": [{"title": "...", "text": "..."}, ...], "question": "...", "answers": ["...", ...]}

or, for a user's own questions (what a RAG pipeline logs), the server's shape::

    {"question": "...", "documents": ["...", {"title": "...", "text": "..."}, ...]}

``answers`` is optional: without gold answers the answer-vs-gold scores (F1,
EM, Rouge-L, contains) are null for that item, and every measure against
full prefill (first-token KL and top-1, teacher-forced agreement, TTFT
ratio) is computed as usual, which is what decides whether blending is safe
on those questions.

A file is either a JSON list of records or JSONL (one record per line). An
optional string ``id`` is kept. A malformed file raises :class:`DataError`
whose message names the file, the item index (and JSONL line) and the field;
nothing else escapes. Only a regular file of at most ``MAX_DATA_BYTES`` is read.

``synthetic:single`` / ``synthetic:two-hop`` are built in (see
:mod:`blend.evals.synthetic`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from blend import safeio
from blend.evals.items import DataError, Document, Item
from blend.evals.synthetic import generate

SYNTHETIC_PREFIX = "synthetic:"
MAX_DATA_BYTES = 1 << 30  # an eval data file is read whole
__all__ = ["DataError", "Document", "Item", "load_file", "load_items", "limit_items", "parse_record"]


def _type_name(x: Any) -> str:
    return type(x).__name__


def parse_record(rec: Any, index: int, where: str = "") -> Item:
    """Validate one record and build an :class:`Item`.

    Args:
        rec: the decoded JSON value.
        index: 0-based item index (named in errors).
        where: extra location text for errors, e.g. " (line 4)".

    Returns:
        The item.

    Raises:
        DataError: naming the item and the offending field.
    """
    loc = f"item {index}{where}"
    if not isinstance(rec, dict):
        raise DataError(f"{loc}: must be an object with question and ctxs (or documents); got {_type_name(rec)}")
    if "question" not in rec:
        raise DataError(f"{loc}: missing field 'question'")
    q = rec["question"]
    if not isinstance(q, str) or not q.strip():
        raise DataError(f"{loc}: field 'question' must be a non-empty string, got {_type_name(q)}")
    answers = rec.get("answers", [])
    if answers is None:
        answers = []
    if isinstance(answers, str) or not isinstance(answers, list):
        raise DataError(f"{loc}: field 'answers' must be a list of strings, got {_type_name(answers)}")
    for j, a in enumerate(answers):
        if not isinstance(a, str):
            raise DataError(f"{loc}: field 'answers[{j}]' must be a string, got {_type_name(a)}")
    if ("ctxs" in rec) == ("documents" in rec):
        raise DataError(f"{loc}: needs exactly one of 'ctxs' and 'documents'")
    field = "ctxs" if "ctxs" in rec else "documents"
    ctxs = rec[field]
    if not isinstance(ctxs, list) or not ctxs:
        raise DataError(f"{loc}: field '{field}' must be a non-empty list of passages, got {_type_name(ctxs)}")
    docs = []
    for j, c in enumerate(ctxs):
        if isinstance(c, str) and field == "documents":
            c = {"text": c}
        if not isinstance(c, dict):
            raise DataError(f"{loc}: field '{field}[{j}]' must be an object with title/text, got {_type_name(c)}")
        if "text" not in c:
            raise DataError(f"{loc}: missing field '{field}[{j}].text'")
        text, title = c["text"], c.get("title", "")
        if not isinstance(text, str) or not text.strip():
            raise DataError(f"{loc}: field '{field}[{j}].text' must be a non-empty string, got {_type_name(text)}")
        if title is None:
            title = ""
        if not isinstance(title, str):
            raise DataError(f"{loc}: field '{field}[{j}].title' must be a string, got {_type_name(title)}")
        docs.append(Document(title=title.strip(), text=text))
    rid = rec.get("id", str(index))
    if not isinstance(rid, (str, int)):
        raise DataError(f"{loc}: field 'id' must be a string, got {_type_name(rid)}")
    return Item(id=str(rid), question=q, documents=tuple(docs), answers=tuple(answers))


def _text(path: Path) -> str:
    try:
        data = safeio.read_regular(path, MAX_DATA_BYTES, follow_symlinks=True)
    except FileNotFoundError:
        raise DataError(f"{path}: no such data file") from None
    except OSError as e:  # safeio.UnsafeFileError too: a FIFO, an oversized file
        raise DataError(f"{path}: unreadable data file ({e})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start})") from None


def _decode(path: Path) -> list[tuple[Any, str]]:
    raw = _text(path)
    if not raw.strip():
        raise DataError(f"{path}: empty file, expected a JSON list of records or JSONL")
    if raw.lstrip().startswith("["):
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as e:  # JSONDecodeError; too long an integer; nesting too deep
            raise DataError(f"{path}: invalid JSON: {type(e).__name__}: {str(e)[:200]}") from None
        return [(r, "") for r in data]
    out = []
    # lines end at "\n" only: str.splitlines also cuts at U+2028, U+2029, U+0085 ..., which a passage's text may
    # hold unescaped (json.dumps(ensure_ascii=False) writes them so), and the record was refused as bad JSON
    for lineno, line in enumerate(raw.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            out.append((json.loads(line), f" (line {lineno})"))
        except (ValueError, RecursionError) as e:
            raise DataError(f"{path}: item {len(out)} (line {lineno}): invalid JSON: {type(e).__name__}: "
                            f"{str(e)[:200]}") from None
    return out


def load_file(path: str | Path) -> list[Item]:
    """Load and validate every record of a JSON or JSONL file.

    Args:
        path: the data file.

    Returns:
        All items, in file order.

    Raises:
        DataError: unreadable file, empty list, or a malformed record (named).
    """
    p = Path(path)
    records = _decode(p)
    if not records:
        raise DataError(f"{p}: the data file holds no records (empty list)")
    try:
        return [parse_record(r, i, w) for i, (r, w) in enumerate(records)]
    except DataError as e:
        raise DataError(f"{p}: {e}") from None


def limit_items(items: list[Item], limit: int | None, passages: int | None) -> list[Item]:
    """The first ``limit`` items, each with its first ``passages`` documents.

    Args:
        items: validated items.
        limit: number of items (None: all).
        passages: documents per item, in retrieval order (None: all).

    Returns:
        The truncated items.
    """
    if limit is not None and limit < 1:
        raise DataError(f"--limit must be >= 1, got {limit}")
    if passages is not None and passages < 1:
        raise DataError(f"--passages must be >= 1, got {passages}")
    chosen = items[:limit] if limit is not None else items
    if passages is None:
        return list(chosen)
    return [Item(it.id, it.question, it.documents[:passages], it.answers) for it in chosen]


def load_items(data: str, limit: int | None, passages: int | None, seed: int = 0) -> list[Item]:
    """Load a data file or build a synthetic set.

    Args:
        data: a path, or ``synthetic:single`` / ``synthetic:two-hop``.
        limit: number of items.
        passages: documents per item.
        seed: seed of the synthetic generators (ignored for files).

    Returns:
        The items to evaluate.
    """
    if data.startswith(SYNTHETIC_PREFIX):
        return generate(data[len(SYNTHETIC_PREFIX):], n=limit or 30, passages=passages or 5, seed=seed)
    return limit_items(load_file(data), limit, passages)


def load_item_range(data: str, items: range, passages: int | None, seed: int = 0) -> list[Item]:
    """Items ``items`` of a data file or synthetic set, each with its first ``passages`` documents.

    Args:
        data: as for :func:`load_items`.
        items: a range of item indices, step 1 (``range(lo, hi + 1)`` for ``--items lo-hi``).
        passages: documents per item (None: all).
        seed: as for :func:`load_items`.

    Returns:
        The items in the range, in order: a synthetic set is built up to the range's end (it builds any
        item from its index), a file read up to it (fewer where the file ends first).

    Raises:
        ValueError: a range with another step.
    """
    if items.step != 1:
        raise ValueError(f"an item range has step 1, got {items!r}")
    if not items:
        return []
    return load_items(data, items.stop, passages, seed)[items.start:items.stop]
