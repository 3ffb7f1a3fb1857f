"""The rows of ``kvblend eval``: one :class:`ItemRow` per item, holding one :class:`MethodRow` per method.

The harness writes each item's row as one JSON line of ``rows.jsonl`` (and results.json keeps them under
``items``); ``--resume``, results.md, the survival and guard-margin tables read them back. A row's JSON::

    {"index", "id", "question", "item_sha256", "answers": [str], "prompt_tokens", "full_answer", "ref_margin",
     "methods": {"<name>": {prediction, answer_tokens, f1, em, rouge_l, contains, agreement, same_tokens, kl,
                            top1, tf_agreement, tf_kl, ttft_s, ttft_samples: [float], ttft_ratio, ttft_ref_s,
                            threads, first_token_margin, guarded, applied, recomputed_tokens, reused_tokens,
                            prompt_tokens, recomputed_frac, computed_frac}}}

Keys in that order; a number that is not finite is null (JSON has no NaN), and so is a score with nothing
to score against (F1 of an item without gold answers). Fields added after the first runs are absent from
the rows written before them (:data:`ITEM_FIELDS_SINCE`, :data:`METHOD_FIELDS_SINCE`): such a row reads
back with them None, and :meth:`ItemRow.to_json` writes it back as it was, without them (a ``--resume``
rewrites ``rows.jsonl``; results.json's validator and ``--resume`` check those fields where present, and
``item_sha256`` or ``same_tokens`` as null would fail them). Where null is itself a value a field is written
with (``first_token_margin`` of a method that does not blend), the row's ``absent`` says which were absent.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Iterator

from blend import json_text, safeio
from blend.numeric import finite_real
from blend.prompt import is_unicode

MAX_ROWS_BYTES = 1 << 30  # the largest rows file a reader reads (a run of 10k items is ~100 MB)

# Fields a row may lack: written since (date, and issue where known); absent in rows written before
# (docs/results holds both).
METHOD_FIELDS_SINCE = {
    "ttft_ref_s": "2026-11-30",
    "threads": "2026-11-30",
    "same_tokens": "2026-12-06 (17)",
    "first_token_margin": "2026-12-06",
    "guarded": "2026-12-06",
    "applied": "2026-12-07 (27)",
}
ITEM_FIELDS_SINCE = {
    "ref_margin": "2026-12-04",
    "item_sha256": "2026-12-06",
}


def brief(name: str, width: int = 40) -> str:
    """A name read from a file as an error message shows it: quoted and escaped (``repr``), cut at ``width``.

    Args:
        name: the name (a key of the file's JSON).
        width: characters kept.

    Returns:
        e.g. ``'mystery'`` or ``'xxxx...'``.
    """
    return repr(name if len(name) <= width else name[:width] + "...")


def brief_list(names: list[str], count: int = 5, width: int = 40) -> str:
    """At most ``count`` names, each :func:`brief`, and how many more there are.

    Args:
        names: the names, in the order to show them.
        count: names shown.
        width: characters kept of each.

    Returns:
        e.g. ``'a', 'b' and 3 more``.
    """
    shown = ", ".join(brief(str(k), width) for k in names[:count])
    return shown + (f" and {len(names) - count} more" if len(names) > count else "")


class RowError(ValueError):
    """A JSON value that is not an eval row (not an object, a field missing, unknown or of the wrong type)."""


def is_int(x: Any) -> bool:
    """An integer (never a bool)."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_count(x: Any) -> bool:
    """A count or an index: an integer >= 0."""
    return is_int(x) and x >= 0


def is_number(x: Any) -> bool:
    """A finite JSON number (an int or a float, never a bool; an int too large for a float is not)."""
    return isinstance(x, (int, float)) and finite_real(x)


def is_real(x: Any) -> bool:
    """A JSON number that Python's ``json`` may have written: a float (NaN and infinity too, which it writes as
    ``NaN``/``Infinity``) or an int a float holds (not 10**400); never a bool."""
    return isinstance(x, float) or (is_int(x) and finite_real(x))


def is_str(x: Any) -> bool:
    """A string of valid Unicode (JSON's ``\\ud800`` escape reads as a lone surrogate, which no UTF-8 file or
    terminal takes: a summary that printed or wrote it raised UnicodeEncodeError)."""
    return isinstance(x, str) and is_unicode(x)


def or_null(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """``check``, or null."""
    return lambda x: x is None or check(x)


def list_of(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """A list whose every item passes ``check``."""
    return lambda x: isinstance(x, list) and all(check(v) for v in x)


# field -> (check of its JSON value, what the message calls a value that fails it), in the order written
FieldTypes = dict[str, tuple[Callable[[Any], bool], str]]


def jsonl_lines(text: str) -> Iterator[tuple[int, str]]:
    """The non-blank lines of a JSON Lines text with their 1-based line numbers.

    Lines end at "\\n" only (a "\\r" before it is JSON whitespace): ``str.splitlines`` also ends them at
    U+2028, U+2029, U+0085, "\\x1c"-"\\x1e", "\\v" and "\\f", which a JSON string may hold unescaped
    (``json.dumps(..., ensure_ascii=False)`` writes them so), cutting such a row in two.

    Args:
        text: the file's text.

    Returns:
        An iterator of (line number, line).
    """
    for n, line in enumerate(text.split("\n"), 1):
        if line.strip(" \t\r"):  # JSON's whitespace
            yield n, line


def read_jsonl(path: Path, max_bytes: int = MAX_ROWS_BYTES) -> Iterator[tuple[str, Any]]:
    """The decoded values of a JSON Lines file, each with where it was read (``PATH:LINE``), for the
    messages of the row checks that follow.

    Args:
        path: the file (a regular file, or a link to one).
        max_bytes: the largest file read.

    Returns:
        An iterator of (``"PATH:LINE"``, value), blank lines skipped.

    Raises:
        RowError: the file cannot be read (absent, not a regular file, larger than ``max_bytes``, not UTF-8)
            or a line is not JSON; the message names the file and the line.
    """
    try:
        text = safeio.read_regular(path, max_bytes, follow_symlinks=True).decode("utf-8")
    except safeio.FileTooLargeError as e:  # its size against the cap, unread
        raise RowError(f"{path}: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise RowError(f"{path}: cannot read it ({type(e).__name__}: {str(e)[:200]})") from None
    for n, line in jsonl_lines(text):
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise RowError(f"{path}:{n}: not JSON ({e.msg}, column {e.colno})") from None
        except (ValueError, RecursionError) as e:  # an integer of too many digits; nesting too deep
            raise RowError(f"{path}:{n}: not JSON ({type(e).__name__}: {str(e)[:200]})") from None
        yield f"{path}:{n}", value


def check_fields(d: Any, types: FieldTypes, where: str,
                 optional: frozenset[str] | set[str] = frozenset(), others: bool = False) -> dict[str, Any]:
    """The fields of a JSON object, each checked against its type.

    Args:
        d: the decoded value.
        types: field -> (check of its JSON value, what a message calls a value that passes it), in order.
        where: what a message names the object by (``PATH:LINE``, ``row.methods['x']``).
        optional: fields it may lack.
        others: whether fields not in ``types`` are allowed (kept unchecked); else they are refused.

    Returns:
        The fields ``d`` holds, as they are (lists stay lists).

    Raises:
        RowError: ``d`` is not an object, holds an unknown field (unless ``others``), lacks one not in
            ``optional``, or holds one whose value fails its check; the message names it under ``where``.
    """
    if not isinstance(d, dict):
        raise RowError(f"{where}: not an object ({type(d).__name__})")
    unknown = [] if others else sorted(str(k) for k in d if k not in types)
    if unknown:  # named briefly: the keys come from the file (a crafted one may hold thousands, or long ones)
        raise RowError(f"{where}: unknown field(s) {brief_list(unknown)}")
    for name, (check, what) in types.items():
        if name not in d:
            if name not in optional:
                raise RowError(f"{where}.{name}: missing")
        elif not check(d[name]):
            lone = isinstance(d[name], str) and not is_unicode(d[name])
            raise RowError(f"{where}.{name}: " + ("not valid Unicode (a lone surrogate)" if lone else f"not {what}"))
    return dict(d)


@dataclass(frozen=True, kw_only=True)
class MethodRow:
    """One method on one item (fields in the order rows.jsonl writes them).

    Attributes:
        prediction: the method's answer text.
        answer_tokens: its length in tokens.
        f1: token F1 against the gold answers, best over them (None: the item has none).
        em: exact match, likewise.
        rouge_l: Rouge-L, likewise.
        contains: 1.0 where the answer contains a gold answer, likewise.
        agreement: 1.0 where the normalised answer equals full prefill's.
        same_tokens: leading answer tokens that are full prefill's own (None: a row from before the field,
            written without it).
        kl: KL(full || method) of the first answer token, nats (None: not finite).
        top1: 1.0 where the first token's argmax is full's.
        tf_agreement: share of full's answer tokens predicted, teacher-forced along full's answer.
        tf_kl: mean KL along full's answer, teacher-forced.
        ttft_s: median TTFT over the item's samples, seconds.
        ttft_samples: the TTFT samples, seconds.
        ttft_ratio: ``ttft_s`` over the full prefill TTFT timed beside it.
        ttft_ref_s: that full prefill TTFT (the ratio's denominator).
        threads: intra-op threads the times were measured with.
        first_token_margin: the blend's own first-token top-2 gap before any guard, nats (None for methods
            that do not blend, and in rows from before the field).
        guarded: whether the near-tie guard fired (None: a row from before the field, written without it).
        applied: the path that produced the first token's KV, as the request's report says (``none``,
            ``exact`` or ``blend``: a blend refused, or with nothing to blend, ran ``exact`` or ``none``);
            None in rows from before the field.
        recomputed_tokens: reused rows recomputed.
        reused_tokens: rows whose KV was reused.
        prompt_tokens: the prompt's tokens.
        recomputed_frac: ``recomputed_tokens / prompt_tokens``.
        computed_frac: rows with fresh KV above the check layer over ``prompt_tokens``.
        absent: those of ``ttft_ref_s``, ``threads`` and ``first_token_margin`` (fields written since, that
            may be null) the JSON row lacked: None here, left out again by :meth:`to_json`; empty for rows the
            harness builds.
    """

    prediction: str
    answer_tokens: int
    f1: float | None
    em: float | None
    rouge_l: float | None
    contains: float | None
    agreement: float | None
    same_tokens: int | None = None
    kl: float | None
    top1: float | None
    tf_agreement: float | None
    tf_kl: float | None
    ttft_s: float | None
    ttft_samples: tuple[float | None, ...]
    ttft_ratio: float | None
    ttft_ref_s: float | None = None
    threads: int | None = None
    first_token_margin: float | None = None
    guarded: bool | None = None
    applied: str | None = None
    recomputed_tokens: int
    reused_tokens: int
    prompt_tokens: int
    recomputed_frac: float | None
    computed_frac: float | None
    absent: frozenset[str] = field(default=frozenset(), repr=False)

    def __post_init__(self) -> None:
        _check_absent(self, _METHOD_TYPES, METHOD_FIELDS_SINCE)

    def to_json(self) -> dict[str, Any]:
        """The row's JSON object: its fields in order (tuples as lists), without those the row lacks."""
        return _to_json(self, _METHOD_TYPES, METHOD_FIELDS_SINCE)

    @classmethod
    def from_json(cls, d: Any) -> MethodRow:
        """Parse a method row (a decoded JSON object).

        Args:
            d: the decoded value.

        Returns:
            The row; fields of :data:`METHOD_FIELDS_SINCE` it lacks are None (see ``absent``).

        Raises:
            RowError: ``d`` is not an object, lacks a field, holds an unknown one or one of the wrong type.
        """
        return cls(**_parse(d, _METHOD_TYPES, METHOD_FIELDS_SINCE, "method row"))

    def finite(self) -> MethodRow:
        """This row with every non-finite number (NaN, infinity) None: what its JSON holds."""
        return replace(self, **_finite_fields(self))


@dataclass(frozen=True, kw_only=True)
class ItemRow:
    """One item: what it asked and every method's row (fields in the order rows.jsonl writes them).

    Attributes:
        index: the item's index in the data.
        id: the item's id.
        question: its question.
        item_sha256: SHA-256 of its question, passages and gold answers (what ``--resume`` checks the data
            against; None: a row from before the field, written without it).
        answers: its gold answers (may be empty).
        prompt_tokens: the prompt's tokens.
        full_answer: full prefill's answer text.
        ref_margin: full prefill's own first-token top-2 gap, nats (None: not finite, or a row from before
            the field).
        methods: ``{method name: its row}``, in the order they were written.
        absent: ``{"ref_margin"}`` where the JSON row lacked it (a field written since, that may be null):
            None here, left out again by :meth:`to_json`; empty for rows the harness builds.
    """

    index: int
    id: str
    question: str
    item_sha256: str | None = None
    answers: tuple[str, ...]
    prompt_tokens: int
    full_answer: str
    ref_margin: float | None = None
    methods: dict[str, MethodRow]
    absent: frozenset[str] = field(default=frozenset(), repr=False)

    def __post_init__(self) -> None:
        _check_absent(self, _ITEM_TYPES, ITEM_FIELDS_SINCE)

    def to_json(self) -> dict[str, Any]:
        """The row's JSON object (one line of rows.jsonl once dumped): its fields in order (tuples as lists),
        without those the row lacks, ``methods`` as ``{name: MethodRow.to_json()}``."""
        d = _to_json(self, _ITEM_TYPES, ITEM_FIELDS_SINCE)
        d["methods"] = {name: m.to_json() for name, m in self.methods.items()}
        return d

    @classmethod
    def from_json(cls, d: Any) -> ItemRow:
        """Parse an item row (a decoded rows.jsonl line, or an item of results.json).

        Args:
            d: the decoded value.

        Returns:
            The row; fields of :data:`ITEM_FIELDS_SINCE` (and of its methods, :data:`METHOD_FIELDS_SINCE`)
            it lacks are None (see ``absent``).

        Raises:
            RowError: ``d`` (or a method row in it) is not an object, lacks a field, holds an unknown one or
                one of the wrong type; the message names the field.
        """
        kw = _parse(d, _ITEM_TYPES, ITEM_FIELDS_SINCE, "row")
        methods = {name: MethodRow(**_parse(m, _METHOD_TYPES, METHOD_FIELDS_SINCE, f"row.methods[{brief(name)}]"))
                   for name, m in kw["methods"].items()}
        return cls(**{**kw, "methods": methods})

    def finite(self) -> ItemRow:
        """This row with every non-finite number (NaN, infinity) None, its methods' too: what its JSON holds."""
        return replace(self, **_finite_fields(self), methods={n: m.finite() for n, m in self.methods.items()})


_STR, _INT, _NUM = is_str, is_count, or_null(is_number)
_METHOD_TYPES: FieldTypes = {
    "prediction": (_STR, "a string"), "answer_tokens": (_INT, "a non-negative integer"),
    **{f: (_NUM, "a finite number or null") for f in ("f1", "em", "rouge_l", "contains", "agreement")},
    "same_tokens": (_INT, "a non-negative integer"),
    **{f: (_NUM, "a finite number or null") for f in ("kl", "top1", "tf_agreement", "tf_kl", "ttft_s")},
    "ttft_samples": (list_of(_NUM), "a list of numbers or nulls"), "ttft_ratio": (_NUM, "a finite number or null"),
    "ttft_ref_s": (_NUM, "a finite number or null"),
    "threads": (or_null(lambda x: is_count(x) and x >= 1), "a positive integer or null"),
    "first_token_margin": (_NUM, "a finite number or null"), "guarded": (lambda x: isinstance(x, bool), "a boolean"),
    "applied": (_STR, "a string"),
    **{f: (_INT, "a non-negative integer") for f in ("recomputed_tokens", "reused_tokens", "prompt_tokens")},
    **{f: (_NUM, "a finite number or null") for f in ("recomputed_frac", "computed_frac")},
}
_ITEM_TYPES: FieldTypes = {
    "index": (_INT, "a non-negative integer"), "id": (_STR, "a string"), "question": (_STR, "a string"),
    "item_sha256": (_STR, "a string"), "answers": (list_of(_STR), "a list of strings"),
    "prompt_tokens": (_INT, "a non-negative integer"), "full_answer": (_STR, "a string"),
    "ref_margin": (_NUM, "a finite number or null"),
    "methods": (lambda x: isinstance(x, dict) and all(is_str(k) for k in x), "an object (names of valid Unicode)"),
}


def _nullable(types: FieldTypes, name: str) -> bool:
    """Whether a field's JSON may hold null (then null and absent differ, and ``absent`` tells them apart)."""
    return types[name][0](None)


def _parse(d: Any, types: FieldTypes, since: dict[str, str], where: str) -> dict[str, Any]:
    """Constructor arguments from a JSON object checked against ``types`` (lists become tuples); errors
    name the field under ``where``."""
    d = check_fields(d, types, where, optional=set(since))
    kw: dict[str, Any] = {}
    absent = []
    for name in types:
        if name not in d:
            kw[name] = None
            if _nullable(types, name):
                absent.append(name)
            continue
        kw[name] = tuple(d[name]) if isinstance(d[name], list) else d[name]
    return {**kw, "absent": frozenset(absent)}


def _check_absent(row: Any, types: FieldTypes, since: dict[str, str]) -> None:
    """``absent`` names only fields written since, that may be null, each of them None here."""
    bad = sorted(n for n in row.absent if n not in since or not _nullable(types, n) or getattr(row, n) is not None)
    if bad:
        raise ValueError(f"{type(row).__name__}.absent: {bad} are not None fields it may lack")


def _to_json(row: Any, types: FieldTypes, since: dict[str, str]) -> dict[str, Any]:
    """A row's fields in order, but ``absent`` ones and those written since that cannot be null and are None."""
    out = {}
    for f in fields(row):
        v = getattr(row, f.name)
        lacks = f.name in row.absent or (v is None and f.name in since and not _nullable(types, f.name))
        if f.name == "absent" or lacks:
            continue
        out[f.name] = list(v) if isinstance(v, tuple) else v
    return out


def _finite_fields(row: Any) -> dict[str, Any]:
    """Every float (or tuple of floats) field of ``row`` with non-finite values as None (tuples kept tuples)."""
    return {f.name: json_text.finite(getattr(row, f.name), keep_tuples=True) for f in fields(row)
            if f.name not in ("absent", "methods")}
