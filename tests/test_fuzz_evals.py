"""Fuzz: eval data (CacheBlend-style records) through the real loader.

Property: ``evals.data.parse_record`` returns an Item or raises ``DataError``;
``load_file`` returns items or raises ``DataError`` naming the file; all within
the per-example bounds. Mutations start from real musique records."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from blend.evals.data import DataError, Item, load_file, parse_record
from _fuzz_util import FUZZ, bounded, dumps_mutated, json_values, mutate_bytes, mutate_json

MUSIQUE = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "musique_dev.json"
SAMPLE = {"ctxs": [{"title": "Ferry", "text": "The ferry leaves at noon."}, {"title": "", "text": "Bruno."}],
          "question": "Who is the captain?", "answers": ["Bruno"], "id": "x1"}


def _records() -> list[Any]:
    if MUSIQUE.is_file():
        return json.loads(MUSIQUE.read_text())[:5]
    return [SAMPLE]


RECORDS = _records()


def _item_or_declared(rec: Any) -> Item | None:
    try:
        item = parse_record(rec, 0)
    except DataError:
        return None
    assert item.question.strip() and item.documents  # answers may be absent (a user's own questions)
    assert all(isinstance(a, str) for a in item.answers)
    assert all(isinstance(d.text, str) and d.text.strip() for d in item.documents)
    return item


@FUZZ
@given(rec=json_values)
def test_random_records(rec: Any) -> None:
    with bounded():
        _item_or_declared(rec)


@FUZZ
@given(data=st.data())
def test_mutated_musique_records(data: st.DataObject) -> None:
    base = data.draw(st.sampled_from(RECORDS))
    rec = base
    for _ in range(data.draw(st.integers(1, 3))):
        rec = mutate_json(rec, data)
    with bounded():
        _item_or_declared(rec)


@FUZZ
@given(data=st.data(), jsonl=st.booleans())
def test_files_of_mutated_bytes(tmp_path_factory: pytest.TempPathFactory, data: st.DataObject, jsonl: bool) -> None:
    recs = RECORDS[:2]
    text = "\n".join(json.dumps(r) for r in recs) if jsonl else json.dumps(recs)
    how = data.draw(st.sampled_from(["bytes", "text", "random"]))
    if how == "text":  # one record (or the list) written as a JSON text json.dumps never writes
        blob = (b"\n".join(dumps_mutated(r, data) if i == 0 else json.dumps(r).encode() for i, r in enumerate(recs))
                if jsonl else dumps_mutated(recs, data))
    else:
        blob = mutate_bytes(text.encode(), data) if how == "bytes" else data.draw(st.binary(max_size=256))
    path = tmp_path_factory.mktemp("data") / ("d.jsonl" if jsonl else "d.json")
    path.write_bytes(blob)
    with bounded():
        try:
            items = load_file(path)
        except DataError as e:
            assert str(path) in str(e)
        else:
            assert items and all(isinstance(i, Item) for i in items)


@pytest.mark.parametrize("content", [b"[" * 100_000 + b"]" * 100_000, b"\xff\xfe[]", b"[1" + b"0" * 5000 + b"]",
                                     b'{"ctxs": ' + b"[" * 100_000 + b"\n"])
def test_bad_files_are_one_data_error_naming_the_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(DataError, match=str(path)):
        load_file(path)


def test_fifo_and_oversized_data_files_are_refused(tmp_path: Path) -> None:
    from blend.evals import data

    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    box: dict[str, BaseException] = {}

    def load() -> None:
        try:
            load_file(fifo)
        except BaseException as e:  # noqa: BLE001 - checked below
            box["e"] = e

    t = threading.Thread(target=load, daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert not t.is_alive(), "hung on a FIFO"
    assert isinstance(box["e"], DataError) and "FIFO" in str(box["e"]) and str(fifo) in str(box["e"])
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(data.MAX_DATA_BYTES + 1)
    with pytest.raises(DataError, match="over the cap"):
        load_file(big)
