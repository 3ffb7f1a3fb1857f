"""Data loading, validation errors naming the item, synthetic sets."""

import json
import os

import pytest

from blend.evals.data import DataError, Document, load_file, load_items
from blend.evals.synthetic import generate

GOOD = {"ctxs": [{"title": "T", "text": "body"}, {"title": "", "text": "other"}], "question": "q?", "answers": ["a"]}
MUSIQUE = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "musique_dev.json")


def _write(tmp_path, obj, name="d.json"):
    p = tmp_path / name
    p.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return p


def test_document_text_with_and_without_title():
    assert Document("Title", "text").prompt_text() == "Title\ntext"
    assert Document("", "text").prompt_text() == "text"


def test_json_and_jsonl_load_the_same(tmp_path):
    recs = [GOOD, dict(GOOD, question="q2?", answers=["b", "c"])]
    a = load_file(_write(tmp_path, recs))
    b = load_file(_write(tmp_path, "\n".join(json.dumps(r) for r in recs) + "\n", "d.jsonl"))
    assert a == b
    assert a[1].answers == ("b", "c") and a[0].document_texts() == ["T\nbody", "other"]


@pytest.mark.parametrize("sep", ["\u2028", "\u2029", "\x85"])
def test_a_jsonl_passage_holding_a_unicode_line_break_loads(tmp_path, sep):
    # str.splitlines cut the line at the separator (json.dumps(ensure_ascii=False) leaves it unescaped): a
    # valid file was refused as invalid JSON
    rec = dict(GOOD, ctxs=[{"title": "T", "text": f"one{sep}two"}], question=f"q{sep}?")
    text = json.dumps(rec, ensure_ascii=False) + "\r\n" + json.dumps(GOOD, ensure_ascii=False) + "\n"
    items = load_file(_write(tmp_path, text, "u.jsonl"))
    assert items[0].question == f"q{sep}?" and items[0].document_texts() == [f"T\none{sep}two"]
    assert (items[1].question, items[1].documents) == (GOOD["question"], load_file(_write(tmp_path, [GOOD]))[0].documents)


@pytest.mark.parametrize(
    "bad, needle",
    [
        ({"ctxs": GOOD["ctxs"], "answers": ["a"]}, "item 1: missing field 'question'"),
        ({"question": "q"}, "item 1: needs exactly one of 'ctxs' and 'documents'"),
        (dict(GOOD, documents=["x"]), "item 1: needs exactly one of 'ctxs' and 'documents'"),
        ({"question": "q", "documents": [" "]}, "item 1: field 'documents[0].text'"),
        ({"question": "q", "documents": [3]}, "item 1: field 'documents[0]'"),
        ({"question": "q", "documents": "a b"}, "item 1: field 'documents'"),
        (dict(GOOD, answers="a"), "item 1: field 'answers'"),
        (dict(GOOD, answers=[3]), "item 1: field 'answers[0]'"),
        (dict(GOOD, question=7), "item 1: field 'question'"),
        (dict(GOOD, ctxs=[]), "item 1: field 'ctxs'"),
        (dict(GOOD, ctxs=[{"title": "x"}]), "item 1: missing field 'ctxs[0].text'"),
        (dict(GOOD, ctxs=[{"title": 3, "text": "x"}]), "item 1: field 'ctxs[0].title'"),
        ("nope", "item 1: must be an object"),
    ],
)
def test_malformed_record_names_item_and_field(tmp_path, bad, needle):
    with pytest.raises(DataError) as e:
        load_file(_write(tmp_path, [GOOD, bad]))
    assert needle in str(e.value)


def test_empty_list_and_bad_jsonl_line(tmp_path):
    with pytest.raises(DataError, match="empty list"):
        load_file(_write(tmp_path, []))
    p = _write(tmp_path, json.dumps(GOOD) + "\n{oops\n", "x.jsonl")
    with pytest.raises(DataError, match=r"item 1 \(line 2\): invalid JSON"):
        load_file(p)
    p = _write(tmp_path, json.dumps(GOOD) + "\n" + json.dumps(dict(GOOD, answers={"a": 1})) + "\n", "y.jsonl")
    with pytest.raises(DataError, match=r"item 1 \(line 2\): field 'answers'"):
        load_file(p)
    with pytest.raises(DataError, match="no such data file"):
        load_file(tmp_path / "missing.json")


def test_a_users_own_questions_need_no_gold_answers(tmp_path):
    recs = [{"question": "q?", "documents": ["plain text", {"title": "T", "text": "body"}]},
            dict(GOOD, answers=[]), dict(GOOD, answers=None)]
    items = load_file(_write(tmp_path, recs, "mine.jsonl"))
    assert items[0].answers == () and items[0].document_texts() == ["plain text", "T\nbody"]
    assert items[1].answers == () == items[2].answers


def test_limit_and_passages(tmp_path):
    recs = [dict(GOOD, question=f"q{i}?") for i in range(5)]
    items = load_items(str(_write(tmp_path, recs)), limit=3, passages=1)
    assert [it.question for it in items] == ["q0?", "q1?", "q2?"]
    assert all(len(it.documents) == 1 and it.documents[0].title == "T" for it in items)


@pytest.mark.skipif(not os.path.exists(MUSIQUE), reason="shared musique data absent")
def test_musique_file_loads():
    items = load_items(MUSIQUE, limit=100, passages=5)
    assert len(items) == 100 and all(len(it.documents) == 5 and it.answers for it in items)


def test_synthetic_single_is_seeded_and_answerable():
    a, b = generate("single", 6, 4, seed=1), generate("single", 6, 4, seed=1)
    assert a == b
    assert generate("single", 3, 4, seed=1) == a[:3]  # --limit is a prefix
    assert generate("single", 6, 4, seed=2) != a
    for it in a:
        assert len(it.documents) == 4 and len(it.answers) == 1
        ans = it.answers[0]
        holders = [d for d in it.documents if ans in d.text]
        assert len(holders) == 1  # exactly one document states the answer
        words = len(holders[0].text.split())
        assert 150 <= words <= 400  # a few hundred tokens


def test_synthetic_two_hop_needs_two_documents():
    for it in generate("two-hop", 8, 5, seed=0):
        person = it.question[len("In which city does "):-len(" work?")]
        city = it.answers[0]
        a = [d for d in it.documents if f"{person} works at the " in d.text]
        assert len(a) == 1
        org = a[0].text.split(f"{person} works at the ")[1].split(".")[0]
        b = [d for d in it.documents if f"The {org} is located in {city}." in d.text]
        assert len(b) == 1 and b[0] is not a[0]
        assert city not in a[0].text  # neither document alone answers the question
        assert person not in b[0].text
        assert sum(city in d.text for d in it.documents) == 1


def test_synthetic_errors():
    with pytest.raises(DataError, match="unknown synthetic set"):
        load_items("synthetic:nope", 3, 3)
    with pytest.raises(DataError, match="passages >= 2"):
        generate("two-hop", 2, 1)
