"""Chunker: token budget, sentence/paragraph cuts, overlap, stable ids; corpus readers."""

from __future__ import annotations

import json

import pytest

from blend.retrieval.chunker import ChunkerConfig, chunk_id, chunk_text, count_tokens, tokenizer_fingerprint
from blend.retrieval.corpus import IssueKind, expand_paths, read_file
from blend.retrieval.testing import word_tokenizer

PARA1 = "The harbour opens at six. Boats leave every hour. Tickets cost four crowns."
PARA2 = "The museum holds old maps. It closes on Mondays. Guides speak three languages."
LONG = " ".join(f"w{i}" for i in range(50))  # one 50-token sentence, no punctuation
TEXT = f"{PARA1}\n\n{PARA2}\n\n{LONG}."


@pytest.fixture(scope="module")
def tok():
    return word_tokenizer([TEXT])


@pytest.fixture(scope="module")
def fp(tok):
    return tokenizer_fingerprint(tok)


def test_chunks_respect_budget_and_offsets(tok, fp) -> None:
    cfg = ChunkerConfig(target_tokens=12)
    chunks = chunk_text(TEXT, tok, fp, cfg)
    assert chunks
    for c in chunks:
        assert c.n_tokens <= cfg.target_tokens
        assert TEXT[c.start : c.end] == c.text
        assert c.n_tokens == count_tokens(tok, [c.text])[0]
    assert [c.ordinal for c in chunks] == list(range(len(chunks)))
    # every word of the document is covered, in order, without overlap
    assert " ".join(c.text for c in chunks).split() == TEXT.split()


def test_cuts_at_sentence_and_paragraph_boundaries(tok, fp) -> None:
    chunks = chunk_text(TEXT, tok, fp, ChunkerConfig(target_tokens=20))
    for c in chunks:
        if c.text.startswith("w"):
            continue  # pieces of the over-long sentence
        assert c.text.rstrip().endswith((".", "!", "?")), c.text
    # the first paragraph (17 tokens) fits and the paragraph break is preferred
    assert chunks[0].text == PARA1
    assert chunks[1].text == PARA2


def test_overlap_repeats_whole_trailing_sentences(tok, fp) -> None:
    chunks = chunk_text(PARA1 + " " + PARA2, tok, fp, ChunkerConfig(target_tokens=12, overlap_tokens=6))
    assert len(chunks) >= 3
    for a, b in zip(chunks, chunks[1:]):
        assert b.start <= a.end  # overlapping or adjacent
        if b.start < a.end:
            shared = a.text[b.start - a.start :]
            assert b.text.startswith(shared) and count_tokens(tok, [shared])[0] <= 6
            assert shared[0].isupper()  # begins at a sentence


def test_ids_stable_and_depend_on_tokenizer(tok, fp) -> None:
    a = chunk_text(TEXT, tok, fp, ChunkerConfig(target_tokens=16))
    b = chunk_text(TEXT, word_tokenizer([TEXT]), tokenizer_fingerprint(word_tokenizer([TEXT])), ChunkerConfig(target_tokens=16))
    assert [c.chunk_id for c in a] == [c.chunk_id for c in b]
    assert a[0].chunk_id == chunk_id(fp, a[0].text)
    other = word_tokenizer([TEXT + " extra words"])
    assert tokenizer_fingerprint(other) != fp
    assert chunk_id(tokenizer_fingerprint(other), a[0].text) != a[0].chunk_id


def test_unbreakable_word_is_split(tok, fp) -> None:
    blob = "x" * 500
    chunks = chunk_text(blob, tok, fp, ChunkerConfig(target_tokens=8))
    assert "".join(c.text for c in chunks) == blob


def test_real_tokenizer_minilm() -> None:
    from transformers import AutoTokenizer

    from blend.retrieval.embedder import default_model_dir

    t = AutoTokenizer.from_pretrained(str(default_model_dir()), local_files_only=True)
    f = tokenizer_fingerprint(t)
    chunks = chunk_text(TEXT * 3, t, f, ChunkerConfig(target_tokens=32, overlap_tokens=8))
    assert all(c.n_tokens <= 34 for c in chunks)
    assert len({c.chunk_id for c in chunks}) >= 4


def test_readers_name_file_and_line(tmp_path) -> None:
    (tmp_path / "ok.md").write_text("# Title\n\nHello there.")
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "bin.txt").write_bytes(b"abc\n\x00\x01\x02")
    (tmp_path / "latin.txt").write_bytes("line one\ncaf\xe9\n".encode("latin-1"))
    rows = [json.dumps({"text": "first doc"}), json.dumps({"title": "no text"}), "{bad json", json.dumps({"text": "third"})]
    (tmp_path / "docs.jsonl").write_text("\n".join(rows) + "\n")
    (tmp_path / "skip.pdf").write_bytes(b"%PDF")
    files, issues = expand_paths([tmp_path, tmp_path / "nope.txt", tmp_path / "skip.pdf"])
    assert [i.kind for i in issues] == [IssueKind.MISSING, IssueKind.UNSUPPORTED]
    assert "nope.txt" in str(issues[0])
    by_name = {p.rsplit("/", 1)[-1]: read_file(p) for p in files}
    assert set(by_name) == {"ok.md", "empty.txt", "bin.txt", "latin.txt", "docs.jsonl"}
    assert by_name["ok.md"].documents[0].text == "# Title\n\nHello there."
    assert by_name["empty.txt"].issues[0].kind is IssueKind.EMPTY
    assert by_name["bin.txt"].issues[0].kind is IssueKind.BINARY
    latin = by_name["latin.txt"].issues[0]
    assert latin.kind is IssueKind.NOT_UTF8 and latin.line == 2 and "latin.txt:2" in str(latin)
    j = by_name["docs.jsonl"]
    assert [d.line for d in j.documents] == [1, 4]
    assert [(i.line, i.kind) for i in j.issues] == [(2, IssueKind.NO_TEXT), (3, IssueKind.BAD_JSON)]
    assert "docs.jsonl:2: no text field" in str(j.issues[0])


def test_closing_quotes_and_brackets_after_a_sentence_stay_in_the_chunk() -> None:
    text = 'He said "Stop." Then he left. She asked (why?) and "Who?" Nobody knew. [Done.] End.'
    tok = word_tokenizer([text])
    chunks = chunk_text(text, tok, tokenizer_fingerprint(tok), ChunkerConfig(target_tokens=8))
    assert len(chunks) > 2  # cut between sentences
    assert "".join(c.text for c in chunks).replace(" ", "") == text.replace(" ", "")  # no character lost
    assert any(c.text.endswith('"Stop."') for c in chunks)


def test_with_overlap_every_chunk_reaches_past_the_previous_one() -> None:
    """The paragraph-break preference could cut a chunk right at the previous chunk's end: a chunk of
    repeated text only (embedded, indexed, its KV computed), and the next chunk with no overlap."""
    from blend.retrieval.chunker import ChunkerConfig, chunk_text, tokenizer_fingerprint
    from blend.retrieval.testing import word_tokenizer
    text = "Anna keeps bees. The hives face south hill.\n\nHoney is sold on Fridays.\n\nJars cost. Bees sting."
    tok = word_tokenizer([text])
    chunks = chunk_text(text, tok, tokenizer_fingerprint(tok), ChunkerConfig(target_tokens=12, overlap_tokens=6))
    assert len(chunks) > 1 and all(b.end > a.end for a, b in zip(chunks, chunks[1:]))
    assert chunks[-1].end == len(text)
