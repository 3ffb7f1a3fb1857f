"""Fuzz and hostile files: the store's index registry (``kv-indexes``), an index's intent log, and what one
index's collection reads of another index's folder.

Properties: the registry log of any lines gives registrations (absolute, UTF-8-writable roots, finite
times) and never raises; an intent log of any bytes is read as ids -> texts by ``read_kv_intent`` (never
raises) and by ``read_kv_intent_strict`` (or its own RetrievalError); another index whose files are
rewritten, truncated, swapped for a FIFO, a link or a folder, is read as it is, or, when it cannot be read,
references every text being collected (its KV stays: fail safe), within the per-example bounds."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from blend.retrieval.catalog import Catalog
from blend.retrieval.corpus import RetrievalError
from blend.retrieval.index_files import read_chunk_table, read_generation, read_meta
from blend.retrieval.ingest import ingest
from blend.retrieval.kv_intent import INTENT_FILE, read_kv_intent, read_kv_intent_strict
from blend.retrieval.registry import REGISTRY_LOG, IndexRegistry, index_references
from blend.retrieval.testing import HashEmbedder, tiny_index
from blend.store.disk import DiskStore
from _fuzz_util import FUZZ, bounded, json_texts_of, json_values, mutate_bytes

DOCS = {"a.txt": "Anna keeps bees on the hill. The hives face south.", "b.txt": "The ferry leaves at noon."}
HEAVY = settings(FUZZ, max_examples=min(FUZZ.max_examples, 100))  # a folder copied per example


class ListLog:
    """A compactable record log over a list (what a store tier's read_records returns)."""

    def __init__(self, lines: list[bytes]) -> None:
        self.lines = list(lines)

    def append_record(self, log: str, line: bytes) -> None:
        self.lines.append(line)

    def read_records(self, log: str) -> list[bytes]:
        return list(self.lines)

    def rewrite_records(self, log: str, expected: list[bytes], lines: list[bytes]) -> bool:
        if self.lines != expected:
            return False
        self.lines = list(lines)
        return True


def _line(root: Any, seen: Any) -> bytes:
    return json.dumps({"root": root, "seen": seen}).encode()


registry_lines = st.lists(
    st.binary(max_size=80)
    | json_values.map(lambda v: json.dumps(v).encode())
    | json_texts_of({"root": "/tmp", "seen": 1.5e9})  # too many digits, NaN, nesting, a key twice...
    | st.builds(_line, st.sampled_from(["/tmp", "/nonexistent/x", "rel", "/a\ud800b", "/a\x00b", "", 7]),
                st.sampled_from([0, 1.5, time.time(), 10**400, -(10**400), True, None, "1", [1]])),
    max_size=12,
)


@FUZZ
@given(lines=registry_lines)
@example(lines=[b"[" * 100_000])  # nested past json's recursion limit: RecursionError
@example(lines=[b'{"root": "/tmp", "seen": 1' + b"0" * 400 + b"}"])  # a whole number no float holds
@example(lines=[_line("/tmp/\ud800", 2e9)])  # a root that cannot be written back as UTF-8
def test_a_registry_log_of_any_lines_gives_registrations(lines: list[bytes]) -> None:
    log = ListLog(lines)
    with bounded():
        regs = IndexRegistry([log], clock=lambda: 2e9).registered()
        again = IndexRegistry([log], clock=lambda: 2e9).registered()  # over the compacted log
    assert regs == again
    for r in regs:
        assert os.path.isabs(r.root) and os.fsencode(r.root) and isinstance(r.seen, float)


@FUZZ
@given(content=st.binary(max_size=300) | st.lists(json_values, max_size=6).map(
    lambda rows: b"\n".join(json.dumps(r, ensure_ascii=False).encode("utf-8", "surrogatepass") for r in rows)))
@example(content=b"[" * 100_000 + b"\n")
@example(content=b'{"":""}')
def test_an_intent_log_of_any_bytes_is_read_or_skipped(tmp_path_factory: pytest.TempPathFactory,
                                                       content: bytes) -> None:
    root = tmp_path_factory.mktemp("intent")
    (root / INTENT_FILE).write_bytes(content)
    with bounded():
        got = read_kv_intent(root)
        strict = read_kv_intent_strict(root)
    assert got == strict
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in got.items())
    for k, v in got.items():  # no lone surrogate (an empty text, b"", is falsy: the old check failed on {"": ""})
        k.encode("utf-8"), v.encode("utf-8")


def test_intent_texts_holding_unicode_line_breaks_are_read_back(tmp_path: Path) -> None:
    # str.splitlines cut a line at U+2028, U+2029, U+0085 (JSON leaves them unescaped): the chunk was lost,
    # so a killed ingest's KV of it was never queued for collection, and another index's collection
    # deleted the KV of a text this index was writing
    texts = {"a" * 64: "one\u2028two", "b" * 64: "three\u2029four", "c" * 64: "five\x85six", "d" * 64: "plain"}
    cat = Catalog.open(tmp_path / "idx", _meta())
    cat.note_kv_intent(texts)
    assert read_kv_intent(tmp_path / "idx") == texts
    assert Catalog.open(tmp_path / "idx", _meta()).pending_gc == texts  # a killed run's: all queued


def test_an_intent_line_nested_too_deep_does_not_stop_the_index_opening(tmp_path: Path) -> None:
    root = tmp_path / "idx"
    root.mkdir()
    (root / INTENT_FILE).write_bytes(b"[" * 100_000 + b"\n" + json.dumps({"e" * 64: "kept"}).encode() + b"\n")
    assert Catalog.open(root, _meta()).pending_gc == {"e" * 64: "kept"}  # RecursionError escaped before


def _meta():
    from blend.retrieval.index_files import IndexMeta

    return IndexMeta("hash", "fp", HashEmbedder().dim, "exact", 1000)


# ---- another index's folder, as a collection reads it ------------------------------------------------

SIGNATURE = "sig-b"


@pytest.fixture(scope="module")
def other(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, set[str]]:
    """An index with a recorded KV signature and an intent log; the texts of its chunks."""
    root = tmp_path_factory.mktemp("other")
    tiny_index(root, DOCS)
    cat = Catalog.open(root / "idx")
    cat.record_kv_signature(SIGNATURE)
    cat.commit()
    texts = {r.text for r in Catalog.open(root / "idx").records.values()}
    Catalog.open(root / "idx").note_kv_intent({"f" * 64: "an intended text"})
    return root / "idx", texts


def _readable(root: Path) -> tuple[str, set[str], set[str]] | None:
    """(signature, table texts, intended texts) of ``root`` read by the strict readers one by one; None when
    any refuses."""
    try:
        intended = set(read_kv_intent_strict(root).values())
        if not os.path.lexists(root / "CURRENT"):
            return "", set(), intended
        gen = read_generation(root)
        return (read_meta(gen / "meta.json").kv_signature,
                {r.text for r in read_chunk_table(gen / "chunks.jsonl").values()}, intended)
    except RetrievalError:
        return None


def _damage(path: Path, how: str, data: st.DataObject) -> None:
    blob = path.read_bytes() if path.is_file() else b""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()
    if how == "bytes":
        path.write_bytes(mutate_bytes(blob, data))
    elif how == "fifo":
        os.mkfifo(path)
    elif how == "link":
        path.symlink_to("/dev/zero")
    elif how == "folder":
        path.mkdir()


@HEAVY
@given(data=st.data(), name=st.sampled_from(["CURRENT", "meta.json", "chunks.jsonl", INTENT_FILE, "gen"]),
       how=st.sampled_from(["bytes", "bytes", "bytes", "fifo", "link", "folder", "absent"]))
def test_another_index_is_read_as_it_is_or_keeps_every_text(other: tuple[Path, set[str]],
                                                             tmp_path_factory: pytest.TempPathFactory,
                                                             data: st.DataObject, name: str, how: str) -> None:
    base, texts = other
    root = tmp_path_factory.mktemp("copy") / "idx"
    shutil.copytree(base, root, symlinks=True)
    gen = root / (root / "CURRENT").read_text().strip()
    target = {"CURRENT": root / "CURRENT", INTENT_FILE: root / INTENT_FILE, "gen": gen}.get(name, gen / name)
    _damage(target, how, data)
    asked = texts | {"an intended text", "a text nobody holds"}
    with bounded():
        refs = index_references(root, asked)
        held = IndexRegistry([ListLog([_line(str(root), time.time())])]).held_elsewhere(
            root.parent / "collector", SIGNATURE, asked)
    read = _readable(root)
    if read is None:  # cannot be read: every text keeps its KV
        assert (refs.signature, refs.texts, refs.intended) == ("", asked, asked) and held == asked
    else:
        assert (refs.signature, set(refs.texts), set(refs.intended)) == (read[0], read[1] & asked, read[2] & asked)
        assert held == set(refs.intended) | (set(refs.texts) if refs.signature in ("", SIGNATURE) else set())


def test_a_text_another_index_is_writing_under_another_signature_keeps_its_kv(tmp_path: Path) -> None:
    # the intent log counted only under the other index's committed signature: a run of B under A's engine
    # (B's meta still naming its earlier one) wrote a new chunk's KV under A's keys, and A's collection
    # deleted it before B's commit
    other = tmp_path / "idx-b"
    cat = Catalog.open(other, _meta())
    cat.record_kv_signature("sig-earlier")
    cat.commit()
    Catalog.open(other).note_kv_intent({"a" * 64: "a text B is adding"})
    reg = IndexRegistry([ListLog([])])
    reg.register(other)
    assert reg.held_elsewhere(tmp_path / "idx-a", "sig-a", {"a text B is adding", "x"}) == {"a text B is adding"}


@FUZZ
@given(content=st.binary(max_size=400) | registry_lines.map(lambda lines: b"\n".join(lines)))
def test_a_disk_registry_file_of_any_bytes(tmp_path_factory: pytest.TempPathFactory, content: bytes) -> None:
    disk = DiskStore(tmp_path_factory.mktemp("store"), fsync=False)
    (disk.root / "logs").mkdir()
    (disk.root / "logs" / f"{REGISTRY_LOG}.jsonl").write_bytes(content)
    with bounded():
        regs = IndexRegistry([disk], clock=lambda: 2e9).registered()
        held = IndexRegistry([disk], clock=lambda: 2e9).held_elsewhere(disk.root / "idx", None, {"t"})
    assert all(os.path.isabs(r.root) for r in regs) and held <= {"t"}
    IndexRegistry([disk]).register(disk.root / "idx")  # the log stays appendable and readable
    assert str((disk.root / "idx").resolve()) in {r.root for r in IndexRegistry([disk]).registered()}
