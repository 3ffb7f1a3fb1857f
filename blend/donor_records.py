"""Donor-log records: the :class:`Donor` a record registers, the record format, and replaying a log.

A donor log is kept by a persistent store tier (:class:`RecordLog`), one compact JSON line per record: a
registration (a donor's canonical key, the digest of its preamble and its token ids; the signature is
recomputed on reading, so it is always consistent) or a removal (the key it forgets). Replaying a log
(:func:`replay_records`) takes the records in order: a removal cancels the registrations before it, and a
later registration of the same key brings it back as the most recent. A log keeps the
:func:`newest_registrations` of its live donors when it is rewritten (:func:`purge_log` here; the
compactions of :class:`blend.donors.DonorIndex`, the index that appends to the logs).

A log line is untrusted bytes: :func:`parse_record` returns a registration or a
removal, or raises :class:`DonorRecordError`, and nothing else; token ids must be
whole numbers in ``[0, 2**32)`` (``MAX_TOKEN_ID``), keys 32-byte hex. MinHash works over blocks of
shingles, so a long line costs time in proportion, never a (H, S) matrix. A saved index
(:func:`parse_saved_index`, for :meth:`blend.donors.DonorIndex.load`) is parsed row by row and refused at
the first row past the index's caps, before any signature is computed.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np

from blend.defaults import DEFAULT_MAX_DONORS, DEFAULT_PURGE_TRIES
from blend.keys import StoreKey
from blend.minhash import minhash

log = logging.getLogger("blend.donors")  # the donor index's one logger, wherever its code lives

# a compaction keeps at most this many bytes of records (the most recent donors): a quarter of what a tier
# reads at all (blend.store.record_logs.MAX_LOG_BYTES), leaving room for the appends until the next one
LOG_KEEP_BYTES = 64 << 20
MAX_TOKEN_ID = (1 << 32) - 1  # store keys hash token ids as uint32 (keys.token_digest)
MAX_DONOR_TOKENS = 1 << 18  # tokens of one donor: a longer record is refused before any work on it
# a saved index's bytes (DonorIndex.save writes json.dumps' ", " separators): per token at most 10 digits and ", ";
# per donor its key, preamble and field names; any other top-level field at most SAVED_FIELD_BYTES
SAVED_TOKEN_BYTES, SAVED_ROW_BYTES, SAVED_FIELD_BYTES = 12, 256, 1024
_SPACE = re.compile(r"[ \t\n\r]*")


@dataclass(frozen=True)
class Donor:
    """A stored canonical chunk that may lend its KV.

    Attributes:
        key: its canonical store key.
        preamble: token digest of the preamble it was computed after.
        token_ids: its token ids (for alignment).
        signature: (NUM_HASHES,) uint64 MinHash signature.
    """

    key: StoreKey
    preamble: bytes
    token_ids: tuple[int, ...]
    signature: np.ndarray


@runtime_checkable
class RecordLog(Protocol):
    """An append-only log of small records kept by a persistent store tier."""

    def append_record(self, log: str, line: bytes) -> None:
        """Append one record (no newline inside) to the log named ``log``."""

    def read_records(self, log: str) -> list[bytes]:
        """Every record of ``log`` in append order (empty if there is none)."""


@runtime_checkable
class CompactableLog(Protocol):
    """A record log that can be rewritten atomically (disk and Redis tiers)."""

    def rewrite_records(self, log: str, expected: list[bytes], lines: list[bytes]) -> bool:
        """Replace the log with ``lines`` only if it still holds exactly ``expected``."""


def donor_row(d: Donor | Registration) -> dict:
    """A donor as JSON (the signature is recomputed on reading, so it is always consistent).

    Args:
        d: a donor, or a registration read from a log.

    Returns:
        The registration record's fields: key and preamble as hex, the token ids.
    """
    return {"key": d.key.hex(), "preamble": d.preamble.hex(), "tokens": list(d.token_ids)}


def encode_record(row: dict) -> bytes:
    """One log record: compact JSON, no newline.

    Args:
        row: a registration (:func:`donor_row`) or removal (:func:`removal_row`).

    Returns:
        The line's bytes.
    """
    return json.dumps(row, separators=(",", ":")).encode()


def removal_record(key: StoreKey) -> bytes:
    """The donor-log line that removes ``key``.

    Args:
        key: the donor's canonical key.

    Returns:
        The encoded removal record.
    """
    return encode_record(removal_row(key))


def removal_row(key: StoreKey) -> dict:
    """The record that forgets a donor (replayed in order with the registrations).

    Args:
        key: the donor's canonical key.

    Returns:
        The removal record's fields.
    """
    return {"remove": bytes(key).hex()}


class DonorRecordError(ValueError):
    """A donor-log line (or saved index) that is not a registration or removal record."""


def _digest32(x: Any, what: str) -> bytes:
    """32 bytes from exactly 64 hex digits (``bytes.fromhex`` alone skips ASCII whitespace, so 64
    characters with spaces among them would give a shorter key)."""
    if not isinstance(x, str) or len(x) != 64:
        raise DonorRecordError(f"{what} must be 64 hex digits")
    try:
        raw = bytes.fromhex(x)
    except ValueError:
        raise DonorRecordError(f"{what} must be 64 hex digits") from None
    if len(raw) != 32:
        raise DonorRecordError(f"{what} must be 64 hex digits")
    return raw


@dataclass(frozen=True)
class Registration:
    """A registration record, checked but without its signature (replaying a log computes signatures only
    for the donors it keeps: MinHash costs ~0.3 ms per 400-token line)."""

    key: bytes
    preamble: bytes
    token_ids: tuple[int, ...]

    def donor(self) -> Donor:
        """The registered :class:`Donor`, its MinHash signature computed now."""
        return Donor(StoreKey(self.key), self.preamble, self.token_ids, minhash(self.token_ids))

    def record(self) -> bytes:
        """The log line this registration is written as."""
        return encode_record(donor_row(self))  # the line a Donor of these fields is written as


def _registration_from_row(r: Any) -> Registration:
    if not isinstance(r, dict) or set(r) != {"key", "preamble", "tokens"}:
        raise DonorRecordError("a registration is an object with key, preamble and tokens")
    tokens = r["tokens"]
    if isinstance(tokens, list) and len(tokens) > MAX_DONOR_TOKENS:
        raise DonorRecordError(f"a donor holds at most {MAX_DONOR_TOKENS} tokens")
    if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in tokens):
        raise DonorRecordError(f"tokens must be a list of whole numbers in [0, {MAX_TOKEN_ID}]")
    key, pre = _digest32(r["key"], "key"), _digest32(r["preamble"], "preamble")
    return Registration(key, pre, tuple(tokens))


def donor_from_row(r: Any) -> Donor:
    """A registration row (parsed JSON, untrusted) as its :class:`Donor`.

    Args:
        r: the row: an object with exactly key, preamble and tokens.

    Returns:
        The donor, signature computed.

    Raises:
        DonorRecordError: for any row that is not a valid registration (and for nothing else).
    """
    return _registration_from_row(r).donor()


def _parse(line: bytes) -> Registration | StoreKey:
    """:func:`parse_record` without the registration's signature."""
    try:
        row = json.loads(line)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise DonorRecordError(f"not JSON ({type(e).__name__})") from None
    if isinstance(row, dict) and set(row) == {"remove"}:
        return StoreKey(_digest32(row["remove"], "removed key"))
    return _registration_from_row(row)


def parse_record(line: bytes) -> Donor | StoreKey:
    """One donor-log line: a registration (the :class:`Donor`) or a removal (the key it removes).

    Args:
        line: the raw record, as read from a log.

    Returns:
        The donor registered, or the key of a removal record.

    Raises:
        DonorRecordError: for any line that is neither (and for nothing else).
    """
    rec = _parse(line)
    return rec.donor() if isinstance(rec, Registration) else rec


def replay_records(lines: Sequence[bytes]) -> tuple[list[Registration], int]:
    """Replay a record log in order.

    Args:
        lines: the log's records, in append order (untrusted: unreadable ones are skipped).

    Returns:
        (the live registrations, least recently registered first; how many unreadable lines were skipped).
    """
    state: dict[bytes, Registration | None] = {}  # key -> registration, None once removed
    bad = 0
    for line in lines:
        try:
            rec = _parse(line)
        except DonorRecordError as e:
            bad += 1
            log.debug("donor log: skipped a bad line: %s", e)
            continue
        if isinstance(rec, Registration):
            state.pop(rec.key, None)  # registered again: the most recent now
            state[rec.key] = rec
        else:
            state[bytes(rec)] = None
    return [r for r in state.values() if r is not None], bad


def newest_registrations(live: list[Registration], max_donors: int) -> list[Registration]:
    """The most recent registrations of ``live`` (oldest first) that a log keeps: at most ``max_donors``,
    and at most :data:`LOG_KEEP_BYTES` of records (a log past MAX_LOG_BYTES is not read at all).

    Args:
        live: live registrations, least recently registered first (:func:`replay_records`).
        max_donors: the most donors kept.

    Returns:
        The registrations kept, oldest first.
    """
    kept, size, max_bytes = [], 0, LOG_KEEP_BYTES
    for r in reversed(live[-max_donors:]):
        size += len(r.record()) + 1
        if size > max_bytes:
            break
        kept.append(r)
    return kept[::-1]


def purge_log(sink: RecordLog, name: str, max_donors: int = DEFAULT_MAX_DONORS) -> bool:
    """Rewrite ``sink``'s donor log to one line per live donor, whatever its share of dead lines: a
    deleted document's tokens must leave the disk or Redis now, not at some later compaction.

    Args:
        sink: a persistent tier's record log.
        name: the log's name.
        max_donors: the most donors the log keeps (the most recent; see :func:`newest_registrations`).

    Returns:
        True if the log holds no removed or repeated donor afterwards (False: it cannot be rewritten, or
        other processes kept appending through every try).
    """
    for _ in range(DEFAULT_PURGE_TRIES):
        lines = sink.read_records(name)
        live, _ = replay_records(lines)
        rows = [r.record() for r in newest_registrations(live, max_donors)]
        if rows == lines:  # nothing dead in it (an empty or absent log too)
            return True
        if not isinstance(sink, CompactableLog):
            return False
        if sink.rewrite_records(name, lines, rows):
            return True
    return False


def saved_index_max_bytes(max_donors: int, max_tokens: int) -> int:
    """The most bytes a saved index of at most ``max_donors`` donors and ``max_tokens`` tokens can hold
    (:meth:`blend.donors.DonorIndex.load` reads no more).

    Args:
        max_donors: the index's donor cap.
        max_tokens: its token cap.

    Returns:
        A byte count.
    """
    return max_tokens * SAVED_TOKEN_BYTES + max_donors * SAVED_ROW_BYTES + 4 * SAVED_FIELD_BYTES


def parse_saved_index(text: str, max_donors: int, max_tokens: int) -> list[Registration]:
    """The registrations of a saved index (``{"donors": [row, ...], ...}``), parsed row by row and stopped at
    the first row past the caps: a file of more donors or tokens than an index holds costs no more than the
    caps (json.loads of the whole would build every row first, and the index computed every signature).

    Args:
        text: the file's text (untrusted).
        max_donors: the most rows accepted.
        max_tokens: the most tokens accepted over all rows (a single row may hold more, as in an index).

    Returns:
        The registrations in file order (signatures not computed).

    Raises:
        DonorRecordError: not a saved index, a bad row (naming it), or more than the caps.
    """
    dec = json.JSONDecoder()
    pos = _skip(text, 0)
    if not text.startswith("{", pos):
        raise DonorRecordError("not a saved donor index (no list of donors)")
    pos, rows = _skip(text, pos + 1), None
    while not text.startswith("}", pos):
        field, pos = _decode(dec, text, pos, "a field name")
        pos = _skip(text, pos)
        if not isinstance(field, str) or not text.startswith(":", pos):
            raise DonorRecordError("not a saved donor index (not a JSON object)")
        pos = _skip(text, pos + 1)
        if field == "donors" and text.startswith("[", pos):
            if rows is not None:
                raise DonorRecordError("a saved donor index with two lists of donors")
            rows, pos = _rows(text, pos + 1, max_donors, max_tokens)
        else:  # shingle, num_hashes: small values
            _, end = _decode(dec, text[pos:pos + SAVED_FIELD_BYTES], 0, f"field {field[:40]!r}")
            pos += end
        pos = _skip(text, pos)
        if text.startswith(",", pos):
            pos = _skip(text, pos + 1)
        elif not text.startswith("}", pos):
            raise DonorRecordError("not a saved donor index (not a JSON object)")
    if _skip(text, pos + 1) != len(text):
        raise DonorRecordError("not a saved donor index (text after its object)")
    if rows is None:
        raise DonorRecordError("not a saved donor index (no list of donors)")
    return rows


def _skip(text: str, pos: int) -> int:
    """The first position at or after ``pos`` that is not JSON whitespace."""
    return _SPACE.match(text, pos).end()


def _decode(dec: json.JSONDecoder, text: str, pos: int, what: str) -> tuple[Any, int]:
    try:
        return dec.raw_decode(text, pos)
    except (ValueError, RecursionError) as e:
        raise DonorRecordError(f"not a saved donor index ({what}: {type(e).__name__})") from None


def _rows(text: str, pos: int, max_donors: int, max_tokens: int) -> tuple[list[Registration], int]:
    """The rows of the donors list from ``pos`` (after its ``[``), and the position after its ``]``. A valid
    row is an object whose strings are hex: it ends at its first ``}``, so each is parsed alone."""
    out: list[Registration] = []
    tokens, pos = 0, _skip(text, pos)
    while not text.startswith("]", pos):
        i = len(out)
        end = text.find("}", pos) + 1
        if not text.startswith("{", pos) or not end:
            raise DonorRecordError(f"donor {i}: a registration is an object with key, preamble and tokens")
        try:
            reg = _registration_from_row(json.loads(text[pos:end]))
        except (ValueError, RecursionError) as e:  # DonorRecordError is a ValueError
            raise DonorRecordError(f"donor {i}: {e if isinstance(e, DonorRecordError) else 'not a registration'}"
                                   ) from None
        tokens += len(reg.token_ids)
        if i >= max_donors or (tokens > max_tokens and i):
            raise DonorRecordError(f"holds more than an index does ({max_donors} donors, {max_tokens} tokens)")
        out.append(reg)
        pos = _skip(text, end)
        if text.startswith(",", pos):
            pos = _skip(text, pos + 1)
        elif not text.startswith("]", pos):
            raise DonorRecordError(f"donor {i}: not followed by ',' or ']'")
    return out, pos + 1
