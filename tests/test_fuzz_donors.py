"""Fuzz: donor-log lines through the real record parser, a replaying index and the disk log reader.

Property: ``donor_records.parse_record`` returns a Donor or a removed key, or raises
``DonorRecordError``; attaching to a log of any lines never raises and loads
exactly the lines that parse; all within the per-example bounds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from blend.donor_records import Donor, DonorRecordError, parse_record
from blend.donors import DonorIndex
from blend.minhash import minhash
from blend.keys import StoreKey
from blend.store.disk import DiskStore
from _fuzz_util import FUZZ, bounded, dumps_mutated, json_values, mutate_bytes, mutate_json

KEY, PRE = "ab" * 32, "cd" * 32
VALID = {"key": KEY, "preamble": PRE, "tokens": [5, 6, 7, 8, 9, 10]}


class ListLog:
    """A record log over a list (what a store tier's read_records returns)."""

    def __init__(self, lines: list[bytes]) -> None:
        self.lines = lines

    def append_record(self, log: str, line: bytes) -> None:
        self.lines.append(line)

    def read_records(self, log: str) -> list[bytes]:
        return list(self.lines)


def _parse_or_declared(line: bytes) -> Donor | StoreKey | None:
    try:
        rec = parse_record(line)
    except DonorRecordError:
        return None
    assert isinstance(rec, (Donor, bytes))
    if isinstance(rec, Donor):
        assert len(rec.key) == 32 and len(rec.preamble) == 32 and rec.signature.shape == (128,)
    return rec


# Lines that escaped the old parser (OverflowError, RecursionError) or were misread.
@pytest.mark.parametrize("line", [
    b'{"key": "' + KEY.encode() + b'", "preamble": "' + PRE.encode() + b'", "tokens": [-1]}',
    b'{"key": "' + KEY.encode() + b'", "preamble": "' + PRE.encode() + b'", "tokens": [Infinity]}',
    b'{"key": "' + KEY.encode() + b'", "preamble": "' + PRE.encode() + b'", "tokens": [18446744073709551616]}',
    b'{"key": "' + KEY.encode() + b'", "preamble": "' + PRE.encode() + b'", "tokens": [1.5, true]}',
    b"[" * 50_000 + b"]" * 50_000,
    b'"remove this"',
    b'{"remove": "' + KEY.encode() + b'", "key": 1}',
    b"\xff\xfe",
    # 64 characters that bytes.fromhex reads as 31 bytes (it skips ASCII whitespace): not a 32-byte key
    b'{"key": " ' + KEY[:62].encode() + b' ", "preamble": "' + PRE.encode() + b'", "tokens": [1]}',
    b'{"key": "' + KEY.encode() + b'", "preamble": "\\t\\n' + PRE[:62].encode() + b'", "tokens": [1]}',
    b'{"remove": "' + KEY[:62].encode() + b'  "}',
])
def test_bad_lines_raise_only_the_declared_error(line: bytes) -> None:
    with pytest.raises(DonorRecordError):
        parse_record(line)
    idx = DonorIndex()
    assert idx.attach_log([ListLog([line, json.dumps(VALID).encode()])], "donors") == 1  # skipped, not fatal


def test_long_record_is_hashed_in_bounded_memory() -> None:
    tokens = list(range(200_000))  # a (128, 200k) uint64 matrix would be 200 MB
    line = json.dumps({**VALID, "tokens": tokens}).encode()
    with bounded(max_bytes=64 << 20):
        rec = parse_record(line)
    assert isinstance(rec, Donor) and (rec.signature == minhash(tokens)).all()


@FUZZ
@given(line=st.binary(max_size=512))
@example(line=json.dumps(VALID).encode())
def test_random_bytes(line: bytes) -> None:
    with bounded():
        _parse_or_declared(line)


@FUZZ
@given(value=json_values)
def test_random_json(value: Any) -> None:
    line = json.dumps(value).encode()
    with bounded():
        _parse_or_declared(line)


@FUZZ
@given(data=st.data())
def test_mutated_records(data: st.DataObject) -> None:
    base = data.draw(st.sampled_from([VALID, {"remove": KEY}]))
    if data.draw(st.booleans()):
        line = dumps_mutated(base, data)  # too many digits, NaN, nesting, a key twice...
    else:
        line = json.dumps(mutate_json(base, data)).encode()
    if data.draw(st.booleans()):
        line = mutate_bytes(line, data)
    with bounded():
        _parse_or_declared(line)


@FUZZ
@given(lines=st.lists(st.binary(max_size=64) | st.builds(lambda v: json.dumps(v).encode(), json_values)
                      | st.just(json.dumps(VALID).encode()) | st.just(json.dumps({"remove": KEY}).encode()), max_size=12))
def test_replaying_a_log_of_any_lines(lines: list[bytes]) -> None:
    with bounded():
        idx = DonorIndex()
        loaded = idx.attach_log([ListLog(list(lines))], "donors")
    live: dict[bytes, bool] = {}
    for line in lines:
        rec = _parse_or_declared(line)
        if isinstance(rec, Donor):
            live[bytes(rec.key)] = True
        elif rec is not None:
            live[bytes(rec)] = False
    assert loaded == len(idx) == sum(live.values())


@FUZZ
@given(content=st.binary(max_size=2048))
def test_disk_log_of_any_bytes(tmp_path_factory: pytest.TempPathFactory, content: bytes) -> None:
    root = tmp_path_factory.mktemp("log")
    (root / "logs").mkdir()
    (root / "logs" / "donors.jsonl").write_bytes(content)
    store = DiskStore(root, fsync=False)
    with bounded():
        lines = store.read_records("donors")
        DonorIndex().attach_log([store], "donors")
    assert all(b"\n" not in ln for ln in lines)


@FUZZ
@given(value=json_values)
def test_saved_index_of_any_json(tmp_path_factory: pytest.TempPathFactory, value: Any) -> None:
    path: Path = tmp_path_factory.mktemp("saved") / "donors.json"
    path.write_text(json.dumps({"donors": value} if isinstance(value, list) else value))
    with bounded():
        try:
            DonorIndex.load(path)
        except DonorRecordError as e:
            assert str(path) in str(e)
