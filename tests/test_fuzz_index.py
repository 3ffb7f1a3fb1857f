"""Fuzz: index folders and corpus files through the real readers.

Property: ``Catalog.open`` of an index with any one file rewritten returns a
catalog that searches, or raises ``RetrievalError`` naming a file of the index;
a damaged faiss file is rebuilt and searches exactly as before; ``read_file``
of any bytes returns documents and issues, never raises; all within the
per-example bounds."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from blend.retrieval.catalog import Catalog
from blend.retrieval.corpus import RetrievalError, read_file
from blend.retrieval.testing import HashEmbedder, tiny_index
from _fuzz_util import FUZZ, bounded, dumps_mutated, json_values, mutate_bytes, mutate_json

DOCS = {
    "a.txt": "Anna keeps bees on the hill. The hives face south. Honey is sold on Fridays.",
    "b.md": "# Ferry\n\nThe ferry leaves at noon. The captain is named Bruno.",
    "c.jsonl": '{"text": "The mill grinds rye."}\n{"text": "The baker starts at four."}\n',
}
JSON_FILES = ("meta.json", "files.json", "gc.json")
QUERY = HashEmbedder().embed(["who is the captain of the ferry", "honey"])  # (2, D)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    root = tmp_path_factory.mktemp("base")
    tiny_index(root, DOCS)
    cat = Catalog.open(root / "idx")
    gen = cat.root / (cat.root / "CURRENT").read_text().strip()
    (gen / "gc.json").write_text(json.dumps({"0" * 64: "an unreachable chunk"}))  # something to mutate
    return root / "idx", Catalog.open(root / "idx").search(QUERY, 3)


def _copy(base: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    idx = tmp_path_factory.mktemp("idx") / "idx"
    shutil.copytree(base, idx)
    return idx, idx / (idx / "CURRENT").read_text().strip()


def _open_or_declared(idx: Path) -> Catalog | None:
    try:
        cat = Catalog.open(idx)
    except RetrievalError as e:
        assert str(idx) in str(e), e  # the error names a file of the index
        return None
    cat.search(QUERY, 3)  # a catalog that opened answers queries
    return cat


@FUZZ
@given(data=st.data(), name=st.sampled_from(JSON_FILES), random=st.booleans())
def test_json_files_of_the_index(base: tuple[Path, list], tmp_path_factory: pytest.TempPathFactory,
                                 data: st.DataObject, name: str, random: bool) -> None:
    idx, gen = _copy(base[0], tmp_path_factory)
    value = json.loads((gen / name).read_text())
    if not random and data.draw(st.booleans()):
        raw = dumps_mutated(value, data)  # too many digits, NaN, nesting, a key twice...
    else:
        raw = json.dumps(data.draw(json_values) if random else mutate_json(value, data)).encode()
    if data.draw(st.booleans()):
        raw = mutate_bytes(raw, data)
    (gen / name).write_bytes(raw)
    with bounded():
        _open_or_declared(idx)


@FUZZ
@given(data=st.data())
def test_chunk_table(base: tuple[Path, list], tmp_path_factory: pytest.TempPathFactory, data: st.DataObject) -> None:
    idx, gen = _copy(base[0], tmp_path_factory)
    lines = (gen / "chunks.jsonl").read_bytes().splitlines()
    i = data.draw(st.integers(0, len(lines) - 1))
    how = data.draw(st.sampled_from(["json", "text", "bytes", "drop", "duplicate"]))
    if how == "json":
        lines[i] = json.dumps(mutate_json(json.loads(lines[i]), data)).encode()
    elif how == "text":
        lines[i] = dumps_mutated(json.loads(lines[i]), data)
    elif how == "bytes":
        lines[i] = mutate_bytes(lines[i], data)
    elif how == "drop":
        del lines[i]
    else:
        lines.append(lines[i])
    (gen / "chunks.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    with bounded():
        _open_or_declared(idx)


@FUZZ
@given(data=st.data())
def test_current(base: tuple[Path, list], tmp_path_factory: pytest.TempPathFactory, data: st.DataObject) -> None:
    idx, gen = _copy(base[0], tmp_path_factory)
    raw = data.draw(st.binary(max_size=40) | st.sampled_from([b"/etc", b"../idx", gen.name.encode() + b"/..",
                                                             b"gen-999999", gen.name.encode() + b"\n"]))
    (idx / "CURRENT").write_bytes(mutate_bytes(raw, data) if data.draw(st.booleans()) else raw)
    with bounded():
        cat = _open_or_declared(idx)
    if cat is not None:
        assert cat.search(QUERY, 3) == base[1]  # only the real generation opens


@FUZZ
@given(data=st.data(), name=st.sampled_from(["ids.npy", "vectors.npy"]))
def test_npy_files(base: tuple[Path, list], tmp_path_factory: pytest.TempPathFactory, data: st.DataObject,
                   name: str) -> None:
    idx, gen = _copy(base[0], tmp_path_factory)
    raw = (gen / name).read_bytes()
    if data.draw(st.booleans()):
        raw = mutate_bytes(raw, data, header_end=128)
    else:  # a well-formed header with another shape or dtype, over data of any length
        buf = io.BytesIO()
        shape = tuple(data.draw(st.lists(st.integers(0, 1 << 40), max_size=3)))
        descr = data.draw(st.sampled_from(["<f4", "<i8", "<f8", "|u1", "<i4"]))
        np.lib.format.write_array_header_1_0(buf, {"descr": descr, "fortran_order": data.draw(st.booleans()),
                                                   "shape": shape})
        raw = buf.getvalue() + data.draw(st.binary(max_size=256))
    (gen / name).write_bytes(raw)
    with bounded():
        _open_or_declared(idx)


@FUZZ
@given(data=st.data())
def test_faiss_file_is_rebuilt_not_trusted(base: tuple[Path, list], tmp_path_factory: pytest.TempPathFactory,
                                           data: st.DataObject) -> None:
    idx, gen = _copy(base[0], tmp_path_factory)
    name = data.draw(st.sampled_from(["faiss.index", "faiss.kind"]))
    raw = (gen / name).read_bytes()
    raw = mutate_bytes(raw, data) if data.draw(st.booleans()) else data.draw(st.binary(max_size=512))
    (gen / name).write_bytes(raw)
    with bounded():
        cat = Catalog.open(idx)
        assert cat.search(QUERY, 3) == base[1]


@FUZZ
@given(blob=st.binary(max_size=1024), suffix=st.sampled_from([".txt", ".md", ".jsonl"]))
def test_corpus_files_of_any_bytes(tmp_path_factory: pytest.TempPathFactory, blob: bytes, suffix: str) -> None:
    path = tmp_path_factory.mktemp("corpus") / f"f{suffix}"
    path.write_bytes(blob)
    with bounded():
        fr = read_file(path)
    assert fr.documents or fr.issues
    assert all(d.text.strip() and isinstance(d.text, str) for d in fr.documents)


@FUZZ
@given(value=json_values)
def test_jsonl_lines_of_any_json(tmp_path_factory: pytest.TempPathFactory, value: Any) -> None:
    path = tmp_path_factory.mktemp("corpus") / "f.jsonl"
    path.write_text(json.dumps(value) + "\n" + json.dumps({"text": "a fine line"}) + "\n")
    with bounded():
        fr = read_file(path)
    assert [d.line for d in fr.documents][-1:] == [2]
