"""A collection reads another index's chunk table and intent log a line at a time: its memory is bounded by
the texts it asks about, not by that index's files (it read chunks.jsonl whole, up to MAX_INDEX_FILE_BYTES =
8 GiB, and the intent log up to 1 GiB, so a large or crafted index made every collection over the store
allocate that much). Files that cannot be read still keep every text being collected (fail safe)."""

from __future__ import annotations

import json
import os
import shutil
import tracemalloc
from pathlib import Path

import pytest

from blend import safeio
from blend.retrieval import index_files, kv_intent
from blend.retrieval.catalog import Catalog
from blend.retrieval.kv_intent import INTENT_FILE
from blend.retrieval.line_reader import bounded_lines, row_bound
from blend.retrieval.registry import index_references
from blend.retrieval.testing import tiny_index

DOCS = {"a.txt": "Anna keeps bees on the hill. The hives face south.", "b.txt": "The ferry leaves at noon."}
BIG = 16 << 20  # bytes of rows the collection does not ask about
PEAK = 4 << 20  # what reading them may allocate at once


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, set[str]]:
    root = tmp_path_factory.mktemp("other")
    tiny_index(root, DOCS)
    return root / "idx", {r.text for r in Catalog.open(root / "idx").records.values()}


@pytest.fixture
def other(built: tuple[Path, set[str]], tmp_path: Path) -> tuple[Path, set[str], Path]:
    """A copy of the built index, its chunk texts, and its chunk table."""
    root = tmp_path / "idx"
    shutil.copytree(built[0], root, symlinks=True)
    return root, built[1], root / (root / "CURRENT").read_text().strip() / "chunks.jsonl"


def _row(i: int, text: str) -> bytes:
    return json.dumps({"chunk_id": f"{i:064x}", "slot": 10_000 + i, "text": text, "n_tokens": 1},
                      ensure_ascii=False).encode() + b"\n"


def _peak(fn):
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _grow(path: Path, asked_at_end: bytes) -> None:
    """Append one huge row, ~BIG bytes of small rows, then a row of a text asked about."""
    with open(path, "ab") as f:
        f.write(_row(1, "x" * BIG))  # one line longer than any text asked about could take
        row = _row(2, "y" * 200)
        for i in range(BIG // len(row)):
            f.write(_row(3 + i, "y" * 200))
        f.write(asked_at_end)


def test_another_index_with_a_huge_chunk_table_is_read_in_bounded_memory(other) -> None:
    root, texts, table = other
    index_references(root, texts)  # once before it grows: what the first call imports is not counted
    _grow(table, _row(0, "a text appended last"))
    asked = {next(iter(texts)), "a text appended last", "a text nobody holds"}
    refs, peak = _peak(lambda: index_references(root, asked))
    assert set(refs.texts) == asked - {"a text nobody holds"} and refs.signature == ""
    assert peak < PEAK, f"reading another index's {table.stat().st_size} byte table allocated {peak} bytes"


def test_another_index_with_a_huge_intent_log_is_read_in_bounded_memory(other) -> None:
    root, texts, _ = other
    index_references(root, texts)  # once before it grows: what the first call imports is not counted
    with open(root / INTENT_FILE, "wb") as f:
        f.write(json.dumps({"a" * 64: "z" * BIG}).encode() + b"\n")
        for i in range(BIG // 300):
            f.write(json.dumps({f"{i:064x}": "w" * 200}).encode() + b"\n")
        f.write(json.dumps({"b" * 64: "a text being written"}, ensure_ascii=False).encode() + b"\n")
    asked = {"a text being written", "a text nobody holds"}
    refs, peak = _peak(lambda: index_references(root, asked))
    assert set(refs.intended) == {"a text being written"} and refs.signature == ""
    assert peak < PEAK, f"reading another index's intent log allocated {peak} bytes"


def test_a_corrupt_row_past_the_rows_asked_about_still_keeps_every_text(other) -> None:
    root, texts, table = other
    with open(table, "ab") as f:
        f.write(b'{"chunk_id": "broken\n')
    asked = set(texts) | {"a text nobody holds"}
    refs = index_references(root, asked)
    assert (refs.signature, set(refs.texts), set(refs.intended)) == ("", asked, asked)


@pytest.mark.parametrize("which", ["table", "intent"])
def test_a_file_over_its_cap_still_keeps_every_text(other, monkeypatch, which) -> None:
    root, texts, table = other
    if which == "table":
        monkeypatch.setattr(index_files, "MAX_INDEX_FILE_BYTES", table.stat().st_size - 1)
    else:
        (root / INTENT_FILE).write_text(json.dumps({"c" * 64: "noted"}) + "\n")
        monkeypatch.setattr(kv_intent, "MAX_INTENT_BYTES", 10)
    asked = set(texts) | {"noted"}
    refs = index_references(root, asked)
    assert (refs.signature, set(refs.texts), set(refs.intended)) == ("", asked, asked)


def test_bounded_lines(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"one\n" + b"x" * 100 + b"\n\ntwo\r\n" + b"y" * 11 + b"\nlast")
    assert list(bounded_lines(path, 1000, 10)) == [(1, b"one"), (2, None), (3, b""), (4, b"two\r"), (5, None),
                                                   (6, b"last")]
    assert list(bounded_lines(path, 1000, 11)) [4] == (5, b"y" * 11)
    with pytest.raises(safeio.FileTooLargeError):
        list(bounded_lines(path, 20, 10))
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(safeio.NotRegularFileError):
        list(bounded_lines(tmp_path / "fifo", 1000, 10))
    assert row_bound(["é", "ab"]) == 6 * 2 + row_bound([])
