"""Ingest: idempotence, changed files, bad input, interruption, persistence."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

from blend.retrieval.catalog import Catalog
from blend.retrieval.chunker import ChunkerConfig
from blend.retrieval.corpus import IssueKind, RetrievalError
from blend.retrieval.ingest import ingest
from blend.retrieval.ingest_options import IngestOptions, KVSync
from blend.retrieval.testing import FakeKV, HashEmbedder, word_tokenizer

DOCS = {
    "a.txt": "Anna keeps bees on the hill. The hives face south.\n\nHoney is sold on Fridays. Jars cost two crowns.",
    "b.md": "# Ferry\n\nThe ferry leaves at noon. It carries forty people.\n\nThe captain is named Bruno.",
    "c.txt": "The library opens at nine. Children read on Saturdays. The librarian is Clara.",
}
CFG = ChunkerConfig(target_tokens=14)


@pytest.fixture()
def corpus(tmp_path: Path) -> Path:
    d = tmp_path / "corpus"
    d.mkdir()
    for name, text in DOCS.items():
        (d / name).write_text(text)
    rows = [{"text": "The baker starts at four. Bread is ready at seven."}, {"text": "The mill grinds rye. It runs on water."}]
    (d / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return d


@pytest.fixture(scope="module")
def tok():
    return word_tokenizer(list(DOCS.values()) + ["The baker starts at four. Bread is ready at seven. The mill grinds rye."])


def _run(paths, index, tok, kv=None, emb=None, signature=None, refresh=False, **options):
    return ingest(paths, index, tokenizer=tok, embedder=emb or HashEmbedder(),
                  kv=KVSync(writer=kv.write if kv else None, deleter=kv.delete if kv else None, signature=signature,
                            refresh=refresh),
                  options=IngestOptions(**{"config": CFG, "stream": io.StringIO(), **options}))


def test_reingest_unchanged_adds_nothing(corpus, tmp_path, tok) -> None:
    kv, emb = FakeKV(), HashEmbedder()
    s1 = _run([corpus], tmp_path / "idx", tok, kv, emb)
    assert s1.files_ingested == 4 and s1.chunks_added == s1.chunks_total > 4 and s1.kv_bytes > 0
    calls, batches = len(kv.calls), len(emb.batches)
    s2 = _run([corpus], tmp_path / "idx", tok, kv, emb)
    assert (s2.files_unchanged, s2.files_ingested, s2.chunks_added, s2.chunks_removed) == (4, 0, 0, 0)
    assert s2.chunks_total == s1.chunks_total and s2.kv_bytes == 0
    assert len(kv.calls) == calls and len(emb.batches) == batches  # neither KV nor embeddings recomputed
    cat = Catalog.open(tmp_path / "idx")
    assert cat.vectors.ntotal == len(cat.records) == s1.chunks_total


def test_changed_file_replaces_only_its_chunks(corpus, tmp_path, tok) -> None:
    kv = FakeKV()
    _run([corpus], tmp_path / "idx", tok, kv)
    before = Catalog.open(tmp_path / "idx")
    a_path = str((corpus / "a.txt").resolve())
    a_old = {c.chunk_id for c in before.files[a_path].chunks}
    others = {p: fe.chunks for p, fe in before.files.items() if p != a_path}
    (corpus / "a.txt").write_text(DOCS["a.txt"].replace("Jars cost two crowns.", "Jars cost three crowns."))
    s = _run([corpus], tmp_path / "idx", tok, kv)
    assert s.files_ingested == 1 and s.files_unchanged == 3
    after = Catalog.open(tmp_path / "idx")
    a_new = {c.chunk_id for c in after.files[a_path].chunks}
    assert set(s.removed_ids) == a_old - a_new and s.chunks_removed == 1 and s.chunks_added == 1
    assert a_old & a_new  # the unchanged paragraph kept its chunk (and KV)
    assert {p: fe.chunks for p, fe in after.files.items() if p != a_path} == others
    assert not set(s.removed_ids) & set(after.records)
    # the removed chunk's KV became unreachable and was collected
    assert set(kv.deleted) == set(s.removed_ids) and s.gc_collected == 1 and not after.pending_gc
    assert not any("two crowns" in t for t in kv.entries)
    hits = after.search(HashEmbedder().embed(["Jars cost two crowns"]), k=len(after.records))[0]
    assert all(h.chunk_id not in s.removed_ids for h in hits)


def test_removed_kv_waits_without_deleter(corpus, tmp_path, tok) -> None:
    _run([corpus], tmp_path / "idx", tok)
    (corpus / "c.txt").write_text("The library is closed.")
    s = _run([corpus], tmp_path / "idx", tok)
    assert s.gc_pending == s.chunks_removed >= 1
    cat = Catalog.open(tmp_path / "idx")
    assert set(cat.pending_gc) == set(s.removed_ids)
    kv = FakeKV()
    assert cat.collect_garbage(kv.delete) == len(s.removed_ids)
    cat.commit()
    assert not Catalog.open(tmp_path / "idx").pending_gc


def test_bad_inputs_reported_rest_ingested(corpus, tmp_path, tok) -> None:
    (corpus / "empty.txt").write_text("")
    (corpus / "binary.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    (corpus / "latin.md").write_bytes("ok line\nna\xefve caf\xe9\n".encode("latin-1"))
    with open(corpus / "d.jsonl", "a") as f:
        f.write(json.dumps({"title": "x"}) + "\n")
    s = _run([corpus, tmp_path / "missing.txt"], tmp_path / "idx", tok)
    msgs = [str(i) for i in s.issues]
    assert any("missing.txt" in m and "missing" in m for m in msgs)
    assert any("empty.txt" in m and i.kind is IssueKind.EMPTY for m, i in zip(msgs, s.issues))
    assert any("binary.txt:" in m and i.kind is IssueKind.BINARY for m, i in zip(msgs, s.issues))
    assert any("latin.md:2:" in m and i.kind is IssueKind.NOT_UTF8 for m, i in zip(msgs, s.issues))
    assert any("d.jsonl:3:" in m and i.kind is IssueKind.NO_TEXT for m, i in zip(msgs, s.issues))
    assert s.files_ingested == 4 and s.files_failed == 3
    cat = Catalog.open(tmp_path / "idx")
    assert {Path(p).name for p in cat.files} == {"a.txt", "b.md", "c.txt", "d.jsonl"}


def test_interrupted_ingest_resumes_without_duplicates(corpus, tmp_path, tok) -> None:
    clean = _run([corpus], tmp_path / "clean", tok, FakeKV())
    kv = FakeKV(fail_on_call=3)
    with pytest.raises(RuntimeError, match="simulated crash"):
        _run([corpus], tmp_path / "idx", tok, kv, commit_every=1)
    partial = Catalog.open(tmp_path / "idx")
    assert 0 < len(partial.files) < 4
    kv.fail_on_call = None
    s = _run([corpus], tmp_path / "idx", tok, kv)
    assert s.files_unchanged == len(partial.files) and s.files_ingested == 4 - len(partial.files)
    cat = Catalog.open(tmp_path / "idx")
    assert set(cat.records) == set(Catalog.open(tmp_path / "clean").records)
    assert cat.vectors.ntotal == len(cat.records) == clean.chunks_total
    assert len(set(cat.vectors.ids.tolist())) == cat.vectors.ntotal


def test_persist_and_reload_identical_search(corpus, tmp_path, tok) -> None:
    emb = HashEmbedder()
    _run([corpus], tmp_path / "idx", tok, emb=emb)
    cat = Catalog.open(tmp_path / "idx")
    q = emb.embed(["who is the captain of the ferry", "when does the library open", "bread"])  # (3, D)
    first = cat.search(q, 3)
    again = Catalog.open(tmp_path / "idx").search(q, 3)
    assert first == again
    assert "Bruno" in first[0][0].text and first[0][0].source.endswith("b.md")
    assert [h.score for h in first[0]] == sorted((h.score for h in first[0]), reverse=True)
    assert first[2][0].line == 1 and first[2][0].source.endswith("d.jsonl")


def test_shared_chunk_survives_until_last_reference(tmp_path, tok) -> None:
    d = tmp_path / "c"
    d.mkdir()
    (d / "x.txt").write_text(DOCS["c.txt"])
    (d / "y.txt").write_text(DOCS["c.txt"])
    s = _run([d], tmp_path / "idx", tok)
    n = s.chunks_total
    (d / "x.txt").write_text("Something else entirely.")
    s2 = _run([d], tmp_path / "idx", tok)
    assert s2.chunks_removed == 0 and s2.chunks_total == n + 1
    hit = Catalog.open(tmp_path / "idx").search(HashEmbedder().embed(["librarian Clara"]), 1)[0][0]
    assert hit.source.endswith("y.txt")


def test_open_missing_index_is_clear(tmp_path, tok) -> None:
    with pytest.raises(RetrievalError, match="no index here"):
        Catalog.open(tmp_path / "nothing")
    with pytest.raises(RetrievalError, match="nothing to ingest.*gone.txt"):
        _run([tmp_path / "gone.txt"], tmp_path / "idx", tok)
    assert not Catalog.exists(tmp_path / "idx")


def test_real_embedder_finds_the_right_document(corpus, tmp_path, tok) -> None:
    from blend.retrieval.embedder import Embedder

    emb = Embedder.load()
    _run([corpus], tmp_path / "idx", tok, emb=emb)
    cat = Catalog.open(tmp_path / "idx")
    hits = cat.search(emb.embed(["Who is the captain of the ferry?"]), 2)[0]
    assert hits[0].source.endswith("b.md") and any("Bruno" in h.text for h in hits)


def test_progress_bar_reports_rate_and_eta(corpus, tmp_path, tok) -> None:
    from blend.progress import Progress

    out = io.StringIO()
    ingest([corpus], tmp_path / "idx", tokenizer=tok, embedder=HashEmbedder(),
           options=IngestOptions(config=CFG, stream=out))
    last = out.getvalue().strip().splitlines()[-1]
    assert "4/4 files" in last and "left" in last and "/s" in last
    bar = Progress(10, desc="x", unit="chunks", stream=io.StringIO(), min_interval_s=0)
    bar.update(5)
    assert "5/10 chunks" in bar.line() and "[" + "#" * 12 in bar.line()


def test_changed_kv_signature_rewrites_every_indexed_chunk(corpus, tmp_path, tok) -> None:
    """A new engine provenance (model revision, dtype, GEMM backend...) keys chunk KV anew: unchanged
    files must not leave their chunks without KV under the new keys."""
    kv = FakeKV()
    s1 = _run([corpus], tmp_path / "idx", tok, kv, signature="engine-a")
    assert s1.kv_checked == 0  # everything was written as it was indexed
    assert Catalog.open(tmp_path / "idx").meta.kv_signature == "engine-a"
    texts = {r.text for r in Catalog.open(tmp_path / "idx").records.values()}
    calls = len(kv.calls)
    s2 = _run([corpus], tmp_path / "idx", tok, kv, signature="engine-a")
    assert len(kv.calls) == calls and s2.kv_checked == 0  # same keys: nothing to check

    kv_b = FakeKV()  # the new engine's keys: nothing of its own stored yet
    s3 = _run([corpus], tmp_path / "idx", tok, kv_b, signature="engine-b")
    assert s3.files_unchanged == 4 and s3.chunks_added == 0
    assert set(kv_b.entries) == texts and s3.kv_checked == len(texts) and s3.kv_bytes == sum(kv_b.entries.values())
    assert "checked for the current engine" in s3.format()
    assert Catalog.open(tmp_path / "idx").meta.kv_signature == "engine-b"
    calls = len(kv_b.calls)
    _run([corpus], tmp_path / "idx", tok, kv_b, signature="engine-b")
    assert len(kv_b.calls) == calls


def test_refresh_kv_refills_an_emptied_store_and_new_chunks_are_written_once(corpus, tmp_path, tok) -> None:
    kv = FakeKV()
    _run([corpus], tmp_path / "idx", tok, kv, signature="engine-a")
    texts = {r.text for r in Catalog.open(tmp_path / "idx").records.values()}
    kv.entries.clear()  # the store was emptied; the signature still matches
    before = len(kv.calls)
    (corpus / "e.txt").write_text("The bell rings at dusk. Nobody knows who rings it.")
    s = _run([corpus], tmp_path / "idx", tok, kv, signature="engine-a", refresh=True)
    records = Catalog.open(tmp_path / "idx").records
    assert s.chunks_added >= 1 and len(records) == len(texts) + s.chunks_added
    assert s.kv_checked == len(texts)  # the new file's chunks, written as indexed, are not passed twice
    assert set(kv.entries) == {r.text for r in records.values()}
    passed = [t for call in kv.calls[before:] for t in call]
    assert sorted(passed) == sorted(r.text for r in records.values())  # each chunk through the writer once


def test_no_kv_writer_records_no_signature_and_a_failed_refresh_is_retried(corpus, tmp_path, tok) -> None:
    _run([corpus], tmp_path / "idx", tok, None, signature="engine-a")
    assert Catalog.open(tmp_path / "idx").meta.kv_signature == ""  # nothing was made sure of
    kv = FakeKV(fail_on_call=1)
    with pytest.raises(RuntimeError):
        _run([corpus], tmp_path / "idx", tok, kv, signature="engine-a")
    assert Catalog.open(tmp_path / "idx").meta.kv_signature == ""  # not recorded: the next run tries again
    kv.fail_on_call = None
    s = _run([corpus], tmp_path / "idx", tok, kv, signature="engine-a")
    assert s.kv_checked == len(Catalog.open(tmp_path / "idx").records)
    assert set(kv.entries) == {r.text for r in Catalog.open(tmp_path / "idx").records.values()}


def test_index_written_before_the_kv_signature_opens_and_is_refreshed(corpus, tmp_path, tok) -> None:
    kv = FakeKV()
    _run([corpus], tmp_path / "idx", tok, kv, signature="engine-a")
    gen = tmp_path / "idx" / (tmp_path / "idx" / "CURRENT").read_text()
    meta = json.loads((gen / "meta.json").read_text())
    del meta["kv_signature"]  # meta.json as older releases wrote it
    (gen / "meta.json").write_text(json.dumps(meta))
    assert Catalog.open(tmp_path / "idx").meta.kv_signature == ""
    s = _run([corpus], tmp_path / "idx", tok, FakeKV(), signature="engine-a")
    assert s.kv_checked == s.chunks_total > 0
    meta["kv_signature"] = 7  # a wrong type is still a clear error
    (gen.parent / (tmp_path / "idx" / "CURRENT").read_text() / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(RetrievalError, match="kv_signature must be a string"):
        Catalog.open(tmp_path / "idx")


def test_a_file_deleted_from_an_ingested_folder_leaves_the_index(corpus, tmp_path, tok) -> None:
    kv = FakeKV()
    _run([corpus], tmp_path / "idx", tok, kv)
    c_path = str((corpus / "c.txt").resolve())
    c_ids = {c.chunk_id for c in Catalog.open(tmp_path / "idx").files[c_path].chunks}
    (corpus / "c.txt").unlink()
    s = _run([corpus], tmp_path / "idx", tok, kv)
    cat = Catalog.open(tmp_path / "idx")
    assert c_path not in cat.files and not c_ids & set(cat.records)
    assert set(s.removed_ids) == c_ids and s.files_removed == 1 and s.gc_collected == len(c_ids)
    assert not any("librarian" in t for t in kv.entries)  # its KV was deleted too
    hits = cat.search(HashEmbedder().embed(["The librarian is Clara"]), k=len(cat.records))[0]
    assert all(h.chunk_id not in c_ids for h in hits)


def test_a_missing_file_named_again_leaves_the_index_and_other_files_stay(corpus, tmp_path, tok) -> None:
    a, b = corpus / "a.txt", corpus / "b.md"
    _run([a, b], tmp_path / "idx", tok)
    _run([corpus / "c.txt"], tmp_path / "idx", tok)  # a later run over other paths adds, removes nothing
    assert len(Catalog.open(tmp_path / "idx").files) == 3
    a.unlink()
    s = _run([a, b], tmp_path / "idx", tok)
    assert any(i.kind is IssueKind.MISSING for i in s.issues) and s.files_removed == 1
    assert {Path(p).name for p in Catalog.open(tmp_path / "idx").files} == {"b.md", "c.txt"}


def test_a_reader_opening_while_a_commit_swaps_generations_sees_one_whole_generation(corpus, tmp_path, tok,
                                                                                    monkeypatch) -> None:
    import blend.retrieval.catalog as catalog_mod

    _run([corpus], tmp_path / "idx", tok)
    writer = Catalog.open(tmp_path / "idx")
    writer.remove_file(str((corpus / "c.txt").resolve()))
    real, swapped = catalog_mod.read_chunk_table, []

    def commit_midway(path):  # the writer swaps CURRENT (and removes the old generation) mid-open
        if not swapped:
            swapped.append(path.parent.name)
            writer.commit()
        return real(path)

    monkeypatch.setattr(catalog_mod, "read_chunk_table", commit_midway)
    cat = Catalog.open(tmp_path / "idx")
    assert swapped and set(cat.files) == set(writer.files) and set(cat.records) == set(writer.records)


def test_reingest_applies_a_new_approx_threshold(corpus, tmp_path, tok) -> None:
    # the stored threshold used to win unless --index-kind changed too: --approx-threshold did nothing
    _run([corpus], tmp_path / "idx", tok)
    assert Catalog.open(tmp_path / "idx").meta.threshold != 2
    _run([corpus], tmp_path / "idx", tok, threshold=2)
    cat = Catalog.open(tmp_path / "idx")
    assert cat.meta.threshold == 2 and cat.vectors.params.threshold == 2


@pytest.mark.parametrize("where, at_call", [("add", 2), ("remove", 1)])
def test_an_interrupt_inside_a_files_change_keeps_the_last_commit_and_the_rerun_heals(corpus, tmp_path, tok,
                                                                                    monkeypatch, where, at_call) -> None:
    """Ctrl-C after the chunk table changed and before the vectors did: the finally-commit wrote that
    half-applied state, and the index never opened again ("vector ids disagree with the chunk slots")."""
    from blend.retrieval.index import VectorIndex
    _run([corpus], tmp_path / "idx", tok)
    # a new file first (it completes: there is something to commit), then a changed one, cut half-way
    (corpus / "0new.txt").write_text("The tower clock strikes noon. The keeper winds it on Mondays.")
    (corpus / "c.txt").write_text("Totally new first sentence. " + DOCS["c.txt"] + " Extra words here.")
    real, calls = getattr(VectorIndex, where), []

    def interrupted(self, *a, **kw):
        calls.append(1)
        if len(calls) == at_call:
            raise KeyboardInterrupt
        return real(self, *a, **kw)

    monkeypatch.setattr(VectorIndex, where, interrupted)
    with pytest.raises(KeyboardInterrupt):
        _run([corpus], tmp_path / "idx", tok)
    monkeypatch.setattr(VectorIndex, where, real)
    cat = Catalog.open(tmp_path / "idx")  # opens: the last commit
    assert cat.vectors.ntotal == len(cat.records)
    _run([corpus], tmp_path / "idx", tok)
    cat = Catalog.open(tmp_path / "idx")
    assert cat.vectors.ntotal == len(cat.records) and any(p.endswith("0new.txt") for p in cat.files)


def test_an_index_inside_its_corpus_folder_is_not_ingested_as_corpus(corpus, tmp_path, tok) -> None:
    """`kvblend ingest . --index ./idx` read idx/gen-N/chunks.jsonl back in as documents, every run."""
    first = _run([corpus], corpus / "idx", tok)
    again = _run([corpus], corpus / "idx", tok)
    assert again.files_seen == first.files_seen == len(DOCS) + 1 and again.files_ingested == 0


def test_a_symlinked_corpus_file_leaves_the_index_with_its_link(corpus, tmp_path, tok) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "b.txt").write_text("The lantern is lit at dusk by the keeper's daughter.")
    (corpus / "link.txt").symlink_to(elsewhere / "b.txt")
    _run([corpus], tmp_path / "idx", tok)
    assert any(p.endswith("link.txt") for p in Catalog.open(tmp_path / "idx").files)
    (corpus / "link.txt").unlink()
    s = _run([corpus], tmp_path / "idx", tok)
    names = {Path(p).name for p in Catalog.open(tmp_path / "idx").files}
    assert s.files_removed == 1 and "link.txt" not in names and "b.txt" not in names


def _texts(index: Path) -> set[str]:
    return {r.text for r in Catalog.open(index).records.values()}


def test_a_file_replaced_by_a_folder_or_a_link_whose_target_went_is_removed(corpus, tmp_path, tok) -> None:
    """A path that still existed as something else (a folder, a dangling link) was never "vanished": the
    deleted file's chunks stayed retrievable, and their KV was never collected."""
    kv = FakeKV()
    (tmp_path / "target.txt").write_text(DOCS["c.txt"])
    (corpus / "c.txt").unlink()
    (corpus / "link.txt").symlink_to(tmp_path / "target.txt")
    _run([corpus], tmp_path / "idx", tok, kv)
    anna = {t for t in _texts(tmp_path / "idx") if "Anna" in t}
    assert anna and any("library" in t for t in _texts(tmp_path / "idx"))
    (corpus / "a.txt").unlink()
    (corpus / "a.txt").mkdir()  # a folder under the old file's name
    (corpus / "a.txt" / "x.txt").write_text(DOCS["b.md"])
    (tmp_path / "target.txt").unlink()  # the link now dangles
    s = _run([corpus], tmp_path / "idx", tok, kv)
    left = _texts(tmp_path / "idx")
    assert not anna & left and not any("library" in t for t in left) and s.files_removed == 2
    assert not any("Anna" in t or "library" in t for t in kv.entries)  # their KV collected


def test_a_corpus_emptied_of_files_removes_them_from_its_index(corpus, tmp_path, tok) -> None:
    """A run that found no file was refused before anything was removed: once every file of a folder was
    deleted, no ingest could ever drop them, and `ask --index` kept answering from them."""
    kv = FakeKV()
    _run([corpus], tmp_path / "idx", tok, kv)
    for p in corpus.iterdir():
        p.unlink()
    s = _run([corpus], tmp_path / "idx", tok, kv)
    assert s.files_removed == 4 and _texts(tmp_path / "idx") == set() and kv.entries == {}
    with pytest.raises(RetrievalError, match="nothing to ingest"):  # nothing left to remove: the error again
        _run([corpus], tmp_path / "idx", tok, kv)
    with pytest.raises(RetrievalError, match="nothing to ingest"):  # a new index of nothing: as before
        _run([corpus], tmp_path / "fresh", tok, kv)


def test_a_file_rewritten_into_unusable_bytes_loses_its_old_chunks(corpus, tmp_path, tok) -> None:
    """A file re-saved in another encoding (or a JSONL whose lines all broke) was "failed" but kept its
    previous content's chunks: the edited file's old text kept being retrieved."""
    _run([corpus], tmp_path / "idx", tok)
    (corpus / "a.txt").write_bytes("Ann\u00e9 keeps bees.".encode("latin-1"))
    (corpus / "d.jsonl").write_text("{not json\n")
    s = _run([corpus], tmp_path / "idx", tok)
    left = _texts(tmp_path / "idx")
    assert s.files_failed == 2 and not any("Anna" in t or "baker" in t for t in left)
    assert any("ferry" in t for t in left)  # the others stay


def test_chunks_added_without_their_kv_are_stored_by_the_next_run_that_can(corpus, tmp_path, tok) -> None:
    """An index that had recorded its KV signature never stored KV for chunks a --no-kv run added later (or a
    run whose store writes failed): every request computed them, and "run again" did nothing."""
    kv = FakeKV()
    (corpus / "c.txt").unlink()
    _run([corpus], tmp_path / "idx", tok, kv, signature="engine-a")
    (corpus / "c.txt").write_text(DOCS["c.txt"])
    _run([corpus], tmp_path / "idx", tok, None, signature="engine-a")  # --no-kv
    assert not any("library" in t for t in kv.entries)
    _run([corpus], tmp_path / "idx", tok, kv, signature="engine-a")  # a normal run
    assert any("library" in t for t in kv.entries)


def test_a_first_ingest_draws_no_empty_chunk_kv_bar(corpus, tmp_path, tok) -> None:
    """Every fresh index drew "chunk KV [####] 0/0 chunks": the refresh had nothing this run had not written."""
    out = io.StringIO()
    ingest([corpus], tmp_path / "idx", tokenizer=tok, embedder=HashEmbedder(),
           kv=KVSync(writer=FakeKV().write, signature="engine-a"),
           options=IngestOptions(config=CFG, stream=out, progress=True))
    assert "ingest" in out.getvalue() and "chunk KV" not in out.getvalue()


def test_chunks_added_without_kv_clear_the_signature_in_their_own_commit(corpus, tmp_path, tok) -> None:
    """An interrupted --no-kv ingest committed its chunks (the finally's commit, or a commit_every commit
    before a kill) but cleared the KV signature only after its loop: the next ingest with a writer found
    the signature current and left those chunks without KV for good."""
    kv = FakeKV()
    _run([corpus], tmp_path / "idx", tok, kv, signature="engine-a")
    assert Catalog.open(tmp_path / "idx").meta.kv_signature == "engine-a"
    (corpus / "e.txt").write_text("The bell tower has nine bells.")
    (corpus / "f.txt").write_text("The harbour freezes in January.")

    class Interrupting(HashEmbedder):
        def embed(self, texts):
            if self.batches:  # the second new file: a Ctrl-C mid-run
                raise KeyboardInterrupt
            return super().embed(texts)

    with pytest.raises(KeyboardInterrupt):
        _run([corpus], tmp_path / "idx", tok, None, Interrupting(), signature="engine-a", commit_every=1)
    cat = Catalog.open(tmp_path / "idx")
    without = [r.text for r in cat.records.values() if r.text not in kv.entries]
    assert without and cat.meta.kv_signature == ""  # committed chunks without KV: nothing made sure of
    _run([corpus], tmp_path / "idx", tok, kv, signature="engine-a")
    assert all(t in kv.entries for t in without)  # the next run with a writer gave them their KV
    assert Catalog.open(tmp_path / "idx").meta.kv_signature == "engine-a"


def test_kv_a_killed_ingest_wrote_is_collected_even_when_its_files_changed(corpus, tmp_path, tok, monkeypatch):
    """KV is written before the commit that adds its chunks. A run killed in between left KV no generation
    named; when the files changed before the rerun nothing ever collected it (orphans for good)."""
    kv = FakeKV()
    _run([corpus], tmp_path / "idx", tok, kv)
    before = dict(kv.entries)
    doomed = corpus / "e.txt"
    doomed.write_text("The bell tower has nine bells. The harbour freezes in January.")
    with monkeypatch.context() as m:
        m.setattr(Catalog, "commit", lambda self: None)  # killed before any commit of this run
        _run([corpus], tmp_path / "idx", tok, kv)
    orphans = set(kv.entries) - set(before)
    assert orphans  # its chunks' KV is in the store, no generation names them
    doomed.unlink()  # the corpus changes before the rerun
    s = _run([corpus], tmp_path / "idx", tok, kv)
    assert s.gc_collected >= len(orphans) and not orphans & set(kv.entries)
    assert kv.entries == before  # everything the index holds keeps its KV
    assert not (tmp_path / "idx" / "kv-intent.jsonl").exists()


def test_the_intent_log_is_read_leniently(tmp_path) -> None:
    from blend.retrieval.kv_intent import INTENT_FILE, read_kv_intent

    (tmp_path / INTENT_FILE).write_text('{"a": "text a"}\n{"b": 3}\nnot json\n{"c": "t", "d": "u"}\n{"e": "cut')
    assert read_kv_intent(tmp_path) == {"a": "text a"}
    (tmp_path / INTENT_FILE).unlink()
    (tmp_path / INTENT_FILE).mkdir()  # not a regular file: ignored, never raised
    assert read_kv_intent(tmp_path) == {}


def test_an_index_path_that_is_a_file_and_a_negative_threshold_are_clear_errors(corpus, tmp_path, tok) -> None:
    a_file = corpus / "a.txt"
    with pytest.raises(RetrievalError, match="is a file, not an index folder"):  # was "cannot lock the index"
        _run([corpus], a_file, tok)
    with pytest.raises(RetrievalError, match="threshold must be >= 0"):  # was accepted
        _run([corpus], tmp_path / "idx", tok, threshold=-1)


def test_a_killed_runs_collection_never_takes_kv_it_did_not_write(corpus, tmp_path, tok, monkeypatch):
    """The intent log noted every new chunk, stored or not: after a kill, the rerun collected a chunk whose
    KV another index over the same store had written (and still used). A writer that says which chunks
    are missing keeps those out of the log."""

    class SharedKV(FakeKV):
        def __call__(self, texts):
            return self.write(texts)

        def missing(self, texts):
            return [t not in self.entries for t in texts]

    kv = SharedKV()
    shared = "The bell tower has nine bells."
    other = tmp_path / "other"
    other.mkdir()
    (other / "b.txt").write_text(shared)
    ingest([other], tmp_path / "idx-b", tokenizer=tok, embedder=HashEmbedder(),  # index B stores the chunk's KV
           kv=KVSync(writer=kv, deleter=kv.delete), options=IngestOptions(config=CFG, stream=io.StringIO()))
    assert shared in kv.entries
    (corpus / "e.txt").write_text(shared)
    with monkeypatch.context() as m:
        m.setattr(Catalog, "commit", lambda self: None)  # index A's run, killed before its commit
        ingest([corpus], tmp_path / "idx-a", tokenizer=tok, embedder=HashEmbedder(),
               kv=KVSync(writer=kv, deleter=kv.delete), options=IngestOptions(config=CFG, stream=io.StringIO()))
    (corpus / "e.txt").unlink()
    ingest([corpus], tmp_path / "idx-a", tokenizer=tok, embedder=HashEmbedder(),
           kv=KVSync(writer=kv, deleter=kv.delete), options=IngestOptions(config=CFG, stream=io.StringIO()))
    assert shared in kv.entries  # B's chunk keeps its KV


def test_commit_every_zero_commits_after_ingested_files_only(corpus, tmp_path, tok, monkeypatch) -> None:
    """commit_every <= 0 commits after every ingested file; an unchanged or failed file commits nothing
    (the refactor into _Run once checked after every file: an unchanged re-run rewrote the index per file)."""
    kv = FakeKV()
    _run([corpus], tmp_path / "idx", tok, kv, commit_every=0)
    generation = (tmp_path / "idx" / "CURRENT").read_text()
    commits = []
    real = Catalog.commit
    monkeypatch.setattr(Catalog, "commit", lambda self: commits.append(1) or real(self))
    s = _run([corpus], tmp_path / "idx", tok, kv, commit_every=0)
    assert s.files_unchanged == s.files_seen > 1
    assert commits == [] and (tmp_path / "idx" / "CURRENT").read_text() == generation
