"""Index commits and reads under hostile or unlucky conditions: a named dangling link, the open race, a torn
intent line, lone surrogates, a foreign entry at the next generation's name."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

import blend.retrieval.index_files as index_files
from blend.retrieval.catalog import Catalog
from blend.retrieval.kv_intent import INTENT_FILE, read_kv_intent
from blend.retrieval.chunker import ChunkerConfig
from blend.retrieval.corpus import RetrievalError
from blend.retrieval.ingest import ingest
from blend.retrieval.ingest_options import IngestOptions, KVSync
from blend.retrieval.testing import FakeKV, HashEmbedder, word_tokenizer

CFG = ChunkerConfig(target_tokens=14)
A, B = "Anna keeps bees on the hill.", "The bell tower has nine bells."


@pytest.fixture(scope="module")
def tok():
    return word_tokenizer([A, B])


def _run(paths, index, tok, kv=None):
    return ingest(paths, index, tokenizer=tok, embedder=HashEmbedder(),
                  kv=KVSync(writer=kv.write if kv else None, deleter=kv.delete if kv else None),
                  options=IngestOptions(config=CFG, stream=io.StringIO()))


def _corpus(tmp_path: Path) -> Path:
    c = tmp_path / "c"
    c.mkdir()
    (c / "a.txt").write_text(A)
    return c


def test_a_named_link_whose_target_went_leaves_the_index(tmp_path, tok) -> None:
    (tmp_path / "target.txt").write_text(A)
    (tmp_path / "link.txt").symlink_to(tmp_path / "target.txt")
    _run([tmp_path / "link.txt"], tmp_path / "idx", tok)
    (tmp_path / "target.txt").unlink()
    s = _run([tmp_path / "link.txt"], tmp_path / "idx", tok)
    assert s.files_removed == 1 and not Catalog.open(tmp_path / "idx").records


def test_a_reader_whose_generation_goes_before_it_is_checked_reads_the_new_one(tmp_path, tok, monkeypatch) -> None:
    c = _corpus(tmp_path)
    (c / "b.txt").write_text(B)
    _run([c], tmp_path / "idx", tok)
    writer = Catalog.open(tmp_path / "idx")
    writer.remove_file(str((c / "b.txt").resolve()))
    real, done = index_files._read, []

    def read(path):
        data = real(path)
        if path.name == "CURRENT" and not done:  # CURRENT read; a commit lands before its folder is checked
            done.append(1)
            writer.commit()
        return data

    monkeypatch.setattr(index_files, "_read", read)
    assert set(Catalog.open(tmp_path / "idx").files) == set(writer.files) and done


def test_a_torn_intent_line_does_not_swallow_the_next_runs_first(tmp_path, tok, monkeypatch) -> None:
    c, kv = _corpus(tmp_path), FakeKV()
    _run([c], tmp_path / "idx", tok, kv)
    (tmp_path / "idx" / INTENT_FILE).write_text('{"aaaa": "noted"}\n{"bbbb": "cut sho')
    (c / "b.txt").write_text(B)
    with monkeypatch.context() as m:
        m.setattr(Catalog, "commit", lambda self: None)  # killed before its commit
        _run([c], tmp_path / "idx", tok, kv)
    assert B in read_kv_intent(tmp_path / "idx").values()
    (c / "b.txt").unlink()
    _run([c], tmp_path / "idx", tok, kv)
    assert B not in kv.entries  # collected, not orphaned


@pytest.mark.parametrize("where", ["files.json", "gc.json", INTENT_FILE])
def test_a_lone_surrogate_in_the_index_is_refused_or_skipped(tmp_path, tok, where) -> None:
    c = _corpus(tmp_path)
    _run([c], tmp_path / "idx", tok)
    gen = tmp_path / "idx" / (tmp_path / "idx" / "CURRENT").read_text().strip()
    if where == "files.json":
        d = json.loads((gen / "files.json").read_text())
        (entry,) = d["files"].values()
        (gen / "files.json").write_text(json.dumps(d)[:-2] + ', "/nowhere/x\\ud800.txt": ' + json.dumps(entry) + "}}")
    elif where == "gc.json":
        (gen / "gc.json").write_text('{"deadbeef": "x\\ud800"}')
    else:
        (tmp_path / "idx" / INTENT_FILE).write_text('{"deadbeef": "x\\ud800"}\n')
    (c / "b.txt").write_text(B)
    if where == INTENT_FILE:  # the lenient log skips the line; the ingest commits
        assert _run([c], tmp_path / "idx", tok).files_ingested == 1
    else:  # was: opened, then every commit raised UnicodeEncodeError naming no file
        with pytest.raises(RetrievalError, match=where):
            _run([c], tmp_path / "idx", tok)


@pytest.mark.parametrize("kind", ["file", "link"])
def test_a_foreign_entry_at_the_next_generations_name_does_not_stop_commits(tmp_path, tok, kind) -> None:
    c = _corpus(tmp_path)
    _run([c], tmp_path / "idx", tok)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "keep").write_text("x")
    nxt = tmp_path / "idx" / "gen-000002"
    nxt.write_text("x") if kind == "file" else nxt.symlink_to(tmp_path / "elsewhere")
    (c / "b.txt").write_text(B)
    assert _run([c], tmp_path / "idx", tok).files_ingested == 1
    assert (tmp_path / "elsewhere" / "keep").exists() and len(Catalog.open(tmp_path / "idx").records) == 2
