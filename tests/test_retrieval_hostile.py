"""Hostile input to ingest and to an index folder: every case is one clear
RetrievalError naming the path (or a listed issue), never a traceback, a hang or
an unbounded read."""

from __future__ import annotations

import argparse
import io
import json
import os
import threading
import tracemalloc
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

from blend.retrieval.catalog import Catalog
from blend.retrieval.chunker import ChunkerConfig
from blend.retrieval.corpus import IssueKind, RetrievalError, expand_paths, read_file
from blend.retrieval.index import IndexKind, VectorIndex
from blend.retrieval.ingest import ingest
from blend.retrieval.ingest_options import IngestOptions
from blend.retrieval.testing import HashEmbedder, word_tokenizer

TEXT = "The ferry leaves at noon. It carries forty people. The captain is named Bruno."
HANG_S = 10.0


@pytest.fixture(scope="module")
def tok():
    return word_tokenizer([TEXT])


def _run(paths: list[Any], index: Path, tok: Any) -> Any:
    return ingest(paths, index, tokenizer=tok, embedder=HashEmbedder(),
                  options=IngestOptions(config=ChunkerConfig(target_tokens=8), stream=io.StringIO()))


def _within(fn: Callable[[], Any], fifo: Path) -> Any:
    """``fn()``, failing (and releasing a reader blocked on ``fifo``) if it hangs."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(HANG_S)
    hung = t.is_alive()
    if hung:
        for _ in range(3):  # a writer that opens and closes the FIFO ends the reader's wait
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        t.join(5)
    assert not hung, "hung on a FIFO"
    if "error" in box:
        raise box["error"]
    return box.get("value")


@pytest.fixture()
def index(tmp_path: Path, tok: Any) -> Path:
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "a.txt").write_text(TEXT)
    (d / "b.txt").write_text("The library opens at nine. The librarian is Clara.")
    _run([d], tmp_path / "idx", tok)
    return tmp_path / "idx"


def _gen(index: Path) -> Path:
    return index / (index / "CURRENT").read_text().strip()


# ---- issue 15, failure 4: nothing to ingest -----------------------------------------------


@pytest.mark.parametrize("what", ["missing", "empty_dir", "no_ingestible_files"])
def test_nothing_to_ingest_is_a_clear_error_before_any_model(tmp_path: Path, what: str) -> None:
    target = tmp_path / "in"
    if what != "missing":
        target.mkdir()
    if what == "no_ingestible_files":
        (target / "notes.pdf").write_bytes(b"%PDF-1.4")
        (target / ".hidden.txt").write_text("hidden")
    with pytest.raises(RetrievalError, match=r"nothing to ingest.*" + str(target)) as err:
        ingest([target], tmp_path / "idx", tokenizer=None, embedder=None)  # type: ignore[arg-type]  # as the CLI does
    assert ("no such file" if what == "missing" else "no .txt, .md or .jsonl files") in str(err.value)
    assert not (tmp_path / "idx").exists()


def _cli(argv: list[str]) -> argparse.Namespace:
    from blend.cli import build_parser

    if argv[0] == "ask":  # the tiny model and a memory store unless the test says otherwise
        argv = [*argv, "--model", "tiny-llama", "--store", "memory"]
    return build_parser(argv[0]).parse_args(argv)


@pytest.mark.parametrize("what", ["missing", "empty_dir"])
def test_cli_ingest_of_nothing_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], what: str) -> None:
    from blend.retrieval.cli import run_ingest

    target = tmp_path / "in"
    if what == "empty_dir":
        target.mkdir()
    rc = run_ingest(_cli(["ingest", str(target), "--index", str(tmp_path / "idx"), "--quiet"]))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("kvblend: error: nothing to ingest"), err


# ---- failure 5: a FIFO in a corpus ------------------------------------------------------------


def test_fifo_inside_a_corpus_is_an_issue_not_a_hang(tmp_path: Path, tok: Any) -> None:
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "a.txt").write_text(TEXT)
    fifo = d / "pipe.txt"
    os.mkfifo(fifo)
    files, issues = _within(lambda: expand_paths([d]), fifo)
    assert files == [str((d / "a.txt").resolve())]
    assert [(Path(i.path).name, i.kind) for i in issues] == [("pipe.txt", IssueKind.NOT_REGULAR)]
    assert "FIFO" in str(issues[0])
    s = _within(lambda: _run([d], tmp_path / "idx", tok), fifo)
    assert s.files_ingested == 1 and any(i.kind is IssueKind.NOT_REGULAR for i in s.issues)
    s = _within(lambda: _run([fifo, d / "a.txt"], tmp_path / "idx2", tok), fifo)  # named explicitly
    assert s.files_ingested == 1 and any(i.kind is IssueKind.NOT_REGULAR and "FIFO" in i.message for i in s.issues)
    fr = _within(lambda: read_file(fifo), fifo)  # the reader refuses it on its own too
    assert fr.documents == () and fr.issues[0].kind is IssueKind.NOT_REGULAR


def test_oversized_corpus_file_is_an_issue_without_reading_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from blend.retrieval import corpus

    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.truncate(1 << 40)  # sparse
    tracemalloc.start()
    fr = read_file(big)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert fr.issues[0].kind is IssueKind.TOO_LARGE and peak < 1 << 20
    assert corpus.MAX_FILE_BYTES < 1 << 40


def test_deeply_nested_jsonl_line_is_an_issue(tmp_path: Path) -> None:
    p = tmp_path / "deep.jsonl"
    p.write_text('{"text": "fine"}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    fr = read_file(p)
    assert len(fr.documents) == 1 and [(i.line, i.kind) for i in fr.issues] == [(2, IssueKind.BAD_JSON)]


# ---- failure 6 and the minor ones: a damaged index folder ----------------------------------


def _write(path: Path, data: Any) -> None:
    path.write_bytes(data if isinstance(data, bytes) else json.dumps(data).encode())


def _files(index: Path) -> dict[str, Any]:
    return json.loads((_gen(index) / "files.json").read_text())


DAMAGE: dict[str, tuple[str, Callable[[Path], Any]]] = {
    # name: (file named in the error, what is written into it)
    "files_json_without_files": ("files.json", lambda ix: {"next_slot": 3}),
    "files_json_chunks_is_a_number": (
        "files.json", lambda ix: {**_files(ix), "files": {p: {**fe, "chunks": 5} for p, fe in _files(ix)["files"].items()}}),
    "files_json_short_chunk_ref": (
        "files.json", lambda ix: {**_files(ix), "files": {p: {**fe, "chunks": [["x", 1]]} for p, fe in _files(ix)["files"].items()}}),
    "files_json_next_slot_is_text": ("files.json", lambda ix: {**_files(ix), "next_slot": "3"}),
    "files_json_next_slot_reuses_a_slot": ("files.json", lambda ix: {**_files(ix), "next_slot": 0}),
    # past int64 faiss ids: the next ingest overflowed after recording a chunk, and its commit left an index
    # that never opened again
    "files_json_next_slot_past_the_ids": ("files.json", lambda ix: {**_files(ix), "next_slot": 2**63}),
    "files_json_is_a_list": ("files.json", lambda ix: [1, 2]),
    "files_json_garbage": ("files.json", lambda ix: b"\xff\xfe{garbage"),
    "files_json_deeply_nested": ("files.json", lambda ix: b"[" * 100_000 + b"]" * 100_000),
    "gc_json_garbage": ("gc.json", lambda ix: b"{not json"),
    "gc_json_is_a_list": ("gc.json", lambda ix: ["a"]),
    "meta_json_garbage": ("meta.json", lambda ix: b"\x00\x01"),
    "meta_json_dim_is_text": ("meta.json", lambda ix: {**json.loads((_gen(ix) / "meta.json").read_text()), "dim": "64"}),
    "meta_json_unknown_kind": ("meta.json", lambda ix: {**json.loads((_gen(ix) / "meta.json").read_text()), "kind": "magic"}),
    "chunks_jsonl_slot_is_text": ("chunks.jsonl", lambda ix: b'{"chunk_id": "a", "slot": "0", "text": "t", "n_tokens": 1}\n'),
    "chunks_jsonl_garbage": ("chunks.jsonl", lambda ix: b"\xff\n"),
    # valid JSON whose text is a lone surrogate: the tokenizer raised TypeError when the chunk was asked
    "chunks_jsonl_lone_surrogate": ("chunks.jsonl", lambda ix: _with_surrogate(_gen(ix) / "chunks.jsonl")),
    "vectors_npy_garbage": ("vectors.npy", lambda ix: b"garbage"),
    "vectors_npy_pickle": ("vectors.npy", lambda ix: _npy(np.array([{"a": 1}], dtype=object))),
    "vectors_npy_wrong_dtype": ("vectors.npy", lambda ix: _npy(np.zeros((2, 64), dtype=np.int8))),
    "vectors_npy_wrong_dim": ("vectors.npy", lambda ix: _npy(np.zeros((2, 7), dtype=np.float32))),
    "vectors_npy_claims_a_terabyte": ("vectors.npy", lambda ix: _huge_npy_header()),
    "ids_npy_garbage": ("ids.npy", lambda ix: b"\x93NUMPY\x01\x00\xff\xff" + b"x" * 64),
    "ids_npy_do_not_match_slots": ("ids.npy", lambda ix: _npy(np.arange(100, 100 + _n_ids(ix), dtype=np.int64))),
}


def _with_surrogate(path: Path) -> bytes:
    """The chunk table with its first chunk's text ending in a lone surrogate (valid JSON, every other field
    consistent): the tokenizer raised TypeError when the chunk was asked."""
    lines = path.read_text().splitlines()
    row = json.loads(lines[0])
    row["text"] += "\ud800"
    return "\n".join([json.dumps(row), *lines[1:]]).encode() + b"\n"


def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=True)
    return buf.getvalue()


def _huge_npy_header() -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<f4", "fortran_order": False, "shape": (1 << 34, 64)})
    return buf.getvalue()


def _n_ids(index: Path) -> int:
    return len(np.load(_gen(index) / "ids.npy"))


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damaged_index_file_is_one_error_naming_it(index: Path, tok: Any, case: str) -> None:
    name, content = DAMAGE[case]
    _write(_gen(index) / name, content(index))
    tracemalloc.start()
    try:
        with pytest.raises(RetrievalError) as err:
            Catalog.open(index)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert name in str(err.value), err.value
    assert peak < 64 << 20  # nothing allocated from a claim
    with pytest.raises(RetrievalError, match=name.replace(".", r"\.")):  # ingest into it: the same error
        _run([index.parent / "corpus"], index, tok)


def test_cli_ask_over_a_damaged_index_is_one_line(index: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from blend.retrieval.cli import ask_over_index

    _write(_gen(index) / "files.json", {"next_slot": 3})
    rc = ask_over_index(_cli(["ask", "who?", "--index", str(index)]))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "files.json" in err[0], err


@pytest.mark.parametrize("current", ["/etc", "../../etc", "gen-000001/../../x", "", "\xff", "gen-abc", "gen-1\ngen-2"])
def test_current_must_name_a_generation_inside_the_index(index: Path, current: str) -> None:
    (index / "CURRENT").write_bytes(current.encode("utf-8", "surrogateescape"))
    with pytest.raises(RetrievalError, match="CURRENT"):
        Catalog.open(index)


def test_current_that_is_a_fifo_or_leads_outside_is_refused(index: Path, tmp_path: Path) -> None:
    gen = _gen(index)
    outside = tmp_path / "outside"
    gen.rename(outside)
    (index / gen.name).symlink_to(outside)  # the generation folder is a link out of the index
    with pytest.raises(RetrievalError, match="outside"):
        Catalog.open(index)
    (index / "CURRENT").unlink()
    os.mkfifo(index / "CURRENT")
    with pytest.raises(RetrievalError, match="CURRENT.*FIFO"):
        _within(lambda: Catalog.open(index), index / "CURRENT")


def test_fifo_inside_a_generation_is_refused(index: Path) -> None:
    p = _gen(index) / "files.json"
    p.unlink()
    os.mkfifo(p)
    with pytest.raises(RetrievalError, match="files.json.*FIFO"):
        _within(lambda: Catalog.open(index), p)


def test_damaged_faiss_file_is_never_parsed_and_is_rebuilt(index: Path) -> None:
    cat = Catalog.open(index)
    assert cat.vectors.faiss_loaded  # the intact file is used (so the checks below can tell)
    q = HashEmbedder().embed(["who is the captain"])  # (1, D)
    want = cat.search(q, 2)
    faiss_file = _gen(index) / "faiss.index"
    data = bytearray(faiss_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    faiss_file.write_bytes(bytes(data))
    flipped = Catalog.open(index)
    assert not flipped.vectors.faiss_loaded  # refused by its digest, rebuilt from the vectors
    assert flipped.search(q, 2) == want
    faiss_file.write_bytes(b"\xff" * 64)
    garbage = Catalog.open(index)
    assert not garbage.vectors.faiss_loaded
    assert garbage.search(q, 2) == want


def test_vector_index_load_checks_the_digest(tmp_path: Path) -> None:
    vi = VectorIndex(4, IndexKind.EXACT)
    vi.add(np.arange(3, dtype=np.int64), np.eye(3, 4, dtype=np.float32))
    vi.save(tmp_path)
    assert VectorIndex.load(tmp_path, 4, IndexKind.EXACT).faiss_loaded
    (tmp_path / "faiss.index").write_bytes((tmp_path / "faiss.index").read_bytes() + b"\0")
    again = VectorIndex.load(tmp_path, 4, IndexKind.EXACT)
    assert not again.faiss_loaded and again.search(np.eye(1, 4, dtype=np.float32), 1)[1].tolist() == [[0]]


def test_a_faiss_file_of_another_index_type_under_a_matching_digest_is_rebuilt(tmp_path: Path) -> None:
    """The digest beside the file only detects damage: whoever writes the folder can write both. A flat
    index saved under "hnsw" opened, then search raised AttributeError; it is now rebuilt."""
    import hashlib

    import faiss
    vecs = np.eye(3, 4, dtype=np.float32)  # (3, 4)
    vi = VectorIndex(4, IndexKind.HNSW)
    vi.add(np.arange(3, dtype=np.int64), vecs)
    vi.save(tmp_path)
    flat = faiss.IndexIDMap2(faiss.IndexFlatIP(4))
    flat.add_with_ids(vecs, np.arange(3, dtype=np.int64))
    data = faiss.serialize_index(flat).tobytes()
    (tmp_path / "faiss.index").write_bytes(data)
    (tmp_path / "faiss.kind").write_text(f"hnsw {hashlib.sha256(data).hexdigest()}")
    again = VectorIndex.load(tmp_path, 4, IndexKind.HNSW)
    assert not again.faiss_loaded and again.search(np.eye(1, 4, dtype=np.float32), 1)[1].tolist() == [[0]]


def test_a_commit_after_generation_999999_999_opens_again(index: Path) -> None:
    """The writer counts up without a digit limit; the reader took 6-9 digits, so the commit after
    gen-999999999 wrote a generation its own reader refused."""
    gen = _gen(index)
    gen.rename(index / "gen-999999999")
    (index / "CURRENT").write_text("gen-999999999")
    cat = Catalog.open(index)
    cat.commit()
    assert (index / "CURRENT").read_text().strip() == "gen-1000000000"
    Catalog.open(index)
