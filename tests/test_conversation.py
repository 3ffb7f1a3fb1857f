"""Conversations: earlier user and assistant turns before the question.

The documents open the first user turn and the question segment carries the rest of the
conversation, so (1) the prompt is exactly what the chat template renders for that
conversation, (2) its preamble and the documents' keys are those of a single question, and
(3) a follow-up turn over the same documents is an exact hit on their KV.
"""

from __future__ import annotations

import copy

import pytest
import torch

from blend.errors import InvalidRequestError
from blend.policy import ReusePolicy
from blend.prompt import DEFAULT_SYSTEM, Role, SegmentKind, Turn, build_prompt, document_text
from blend.report import ReuseClass
from conftest import make_docs, unguarded_blend

DOCS = make_docs(3, words=25, seed=11)
HISTORY = (Turn(Role.USER, "Where is the harbor?"), Turn(Role.ASSISTANT, "North of the river."))


def rendered(tok, system: str, turns: list[dict]) -> str:
    return tok.apply_chat_template([{"role": "system", "content": system}, *turns], tokenize=False,
                                   add_generation_prompt=True)


def test_a_conversation_is_the_chat_templates_rendering_with_the_documents_in_its_first_user_turn(tiny_engine):
    tok = tiny_engine.tokenizer
    prompt = build_prompt(tok, "And the bridge?", DOCS, None, HISTORY)
    docs = "".join(document_text(d) for d in DOCS)
    want = rendered(tok, DEFAULT_SYSTEM, [{"role": "user", "content": docs + "Question: Where is the harbor?"},
                                          {"role": "assistant", "content": "North of the river."},
                                          {"role": "user", "content": "And the bridge?"}])
    assert "".join(s.text for s in prompt.segments) == want
    assert [s.kind for s in prompt.segments] == [SegmentKind.PREAMBLE] + [SegmentKind.DOCUMENT] * 3 + [
        SegmentKind.QUESTION]
    assert prompt.token_ids == [t for s in prompt.segments for t in s.token_ids]
    assert prompt.question.text.startswith("Question: Where is the harbor?")
    assert "North of the river." in prompt.question.text


def test_each_turn_extends_the_previous_turns_prompt(tiny_engine):
    """Append-only: the first turn reads as it did when asked alone, so a token-level prefix
    cache (vLLM's) reuses the whole conversation so far."""
    first = tiny_engine.build_prompt("Where is the harbor?", DOCS)
    talk = tiny_engine.build_prompt("And the bridge?", DOCS, history=HISTORY)
    assert talk.token_ids[:len(first)] == first.token_ids
    third = tiny_engine.build_prompt("And the tower?", DOCS, history=(
        *HISTORY, Turn(Role.USER, "And the bridge?"), Turn(Role.ASSISTANT, "South.")))
    assert third.token_ids[:len(talk)] == talk.token_ids


def test_its_preamble_and_documents_are_a_single_questions(tiny_engine):
    single = tiny_engine.build_prompt("And the bridge?", DOCS)
    talk = tiny_engine.build_prompt("And the bridge?", DOCS, history=HISTORY)
    assert talk.preamble == single.preamble and talk.documents == single.documents
    keys = [tiny_engine.segments.canonical_key(p.preamble.token_ids, d.token_ids)
            for p in (single, talk) for d in p.documents]
    assert keys[:3] == keys[3:]
    assert talk.question != single.question


def test_no_history_is_the_single_question_layout(tiny_engine):
    tok = tiny_engine.tokenizer
    prompt = build_prompt(tok, "Why?", DOCS, "Be brief.", ())
    docs = "".join(document_text(d) for d in DOCS)
    assert "".join(s.text for s in prompt.segments) == rendered(tok, "Be brief.", [
        {"role": "user", "content": docs + "Question: Why?"}])


def test_a_conversation_opening_with_the_assistant_gets_its_own_preamble(tiny_engine):
    tok = tiny_engine.tokenizer
    prompt = build_prompt(tok, "Why?", DOCS, None, (Turn(Role.ASSISTANT, "Hello, ask me anything."),))
    docs = "".join(document_text(d) for d in DOCS)
    assert "".join(s.text for s in prompt.segments) == rendered(tok, DEFAULT_SYSTEM, [
        {"role": "assistant", "content": "Hello, ask me anything."}, {"role": "user", "content": docs + "Question: Why?"}])
    assert prompt.preamble != tiny_engine.build_prompt("Why?", DOCS).preamble
    assert "Hello, ask me anything." in prompt.preamble.text


def test_without_a_chat_template_turns_are_question_and_answer_lines(tiny_engine):
    tok = copy.copy(tiny_engine.tokenizer)
    tok.chat_template = None
    prompt = build_prompt(tok, "And the bridge?", ["Doc one."], "Sys.", HISTORY)
    assert "".join(s.text for s in prompt.segments) == (
        "Sys.\n\nDoc one.\n\nQuestion: Where is the harbor?\nAnswer: North of the river.\n"
        "Question: And the bridge?\nAnswer:")


@pytest.mark.parametrize("history, needle", [
    ((Turn(Role.USER, "  "),), "history turn 1 (user) is empty"),
    ((("user", "a"),), "not a Turn"),
    ((Turn(Role.USER, "a\ud800"),), "lone surrogate"),
])
def test_a_bad_turn_is_refused(tiny_engine, history, needle):
    with pytest.raises(InvalidRequestError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        tiny_engine.build_prompt("Why?", DOCS, history=history)


def test_a_follow_up_over_the_same_documents_is_an_exact_hit_on_their_kv(tiny_engine_factory):
    eng = tiny_engine_factory()
    first = eng.generate(eng.build_prompt("Where is the harbor?", DOCS), ReusePolicy.exact(), max_new_tokens=4)
    follow = eng.build_prompt("And the bridge?", DOCS, history=HISTORY)
    warm = eng.generate(follow, ReusePolicy.exact(), max_new_tokens=4)
    assert [s.reuse_class for s in first.report.segments][:4] == [ReuseClass.COMPUTED] * 4
    # the first turn stored no turn of its own (a single question stores nothing): its part is computed
    assert [(s.kind, s.reuse_class) for s in warm.report.segments[4:]] == [
        (SegmentKind.TURN, ReuseClass.COMPUTED), (SegmentKind.QUESTION, ReuseClass.COMPUTED)]
    assert [s.reuse_class for s in warm.report.segments[:4]] == [ReuseClass.EXACT] * 4
    cold = tiny_engine_factory().generate(follow, ReusePolicy.none(), max_new_tokens=4)
    assert torch.equal(warm.first_logits, cold.first_logits) and warm.token_ids == cold.token_ids


THIRD = (*HISTORY, Turn(Role.USER, "And the bridge?"), Turn(Role.ASSISTANT, "South of the old mill."))


def test_the_question_segment_knows_where_each_earlier_turns_prompt_ended(tiny_engine):
    first = tiny_engine.build_prompt("Where is the harbor?", DOCS)
    second = tiny_engine.build_prompt("And the bridge?", DOCS, history=HISTORY)
    third = tiny_engine.build_prompt("And the tower?", DOCS, history=THIRD)
    assert first.question.turn_ends == () and len(first.question.parts()) == 1
    assert second.question.turn_ends == (len(first.question),)
    assert third.question.turn_ends == (len(first.question), len(second.question))
    parts = third.question.parts()
    assert [p.kind for p in parts] == [SegmentKind.TURN, SegmentKind.TURN, SegmentKind.QUESTION]
    assert [t for p in parts for t in p.token_ids] == list(third.question.token_ids)
    assert parts[0].token_ids == first.question.token_ids  # each turn's part ends where its prompt ended
    assert parts[0].token_ids + parts[1].token_ids == second.question.token_ids


def test_a_follow_up_reuses_every_earlier_turn_bit_for_bit(tiny_engine_factory):
    """Turn 2 stores its question part; turn 3 loads both earlier turns and computes only the last
    answer and its question, bit-identical to computing the conversation from scratch."""
    eng = tiny_engine_factory()
    eng.generate(eng.build_prompt("Where is the harbor?", DOCS), ReusePolicy.exact(), max_new_tokens=1)
    eng.generate(eng.build_prompt("And the bridge?", DOCS, history=HISTORY), ReusePolicy.exact(), max_new_tokens=1)
    third = eng.build_prompt("And the tower?", DOCS, history=THIRD)
    warm = eng.generate(third, ReusePolicy.exact(), max_new_tokens=4)
    rows = warm.report.segments
    assert [(s.kind, s.reuse_class) for s in rows[4:]] == [
        (SegmentKind.TURN, ReuseClass.EXACT), (SegmentKind.TURN, ReuseClass.EXACT),
        (SegmentKind.QUESTION, ReuseClass.COMPUTED)]
    assert warm.report.reused_tokens == len(third) - len(third.question.parts()[-1])
    assert [s.start for s in rows] == [sum(r.tokens for r in rows[:i]) for i in range(len(rows))]
    cold = tiny_engine_factory().generate(third, ReusePolicy.exact(), max_new_tokens=4)  # computes every turn
    none = tiny_engine_factory().generate(third, ReusePolicy.none(), max_new_tokens=4)
    assert torch.equal(warm.first_logits, cold.first_logits) and torch.equal(warm.first_logits, none.first_logits)
    assert warm.token_ids == cold.token_ids == none.token_ids
    # a take_exact blend over the same documents in the same order takes the exact path, turns included
    blend = eng.generate(third, unguarded_blend(ratio=0.15, take_exact=True), max_new_tokens=4)
    assert [s.reuse_class for s in blend.report.segments[4:6]] == [ReuseClass.EXACT] * 2
    assert torch.equal(blend.first_logits, none.first_logits)


def test_another_salt_or_another_answer_never_reuses_a_turn(tiny_engine_factory):
    eng = tiny_engine_factory()
    eng.generate(eng.build_prompt("And the bridge?", DOCS, history=HISTORY), ReusePolicy.exact(), max_new_tokens=1)
    salted = eng.generate(eng.build_prompt("And the tower?", DOCS, history=THIRD),
                          ReusePolicy.exact(cache_salt="tenant-b"), max_new_tokens=1)
    assert {s.reuse_class for s in salted.report.segments} == {ReuseClass.COMPUTED}
    other = (HISTORY[0], Turn(Role.ASSISTANT, "Somewhere else."), *THIRD[2:])  # another first answer
    got = eng.generate(eng.build_prompt("And the tower?", DOCS, history=other), ReusePolicy.exact(),
                       max_new_tokens=1)
    assert [s.reuse_class for s in got.report.segments[4:]] == [ReuseClass.EXACT, ReuseClass.COMPUTED,
                                                                 ReuseClass.COMPUTED]


def test_a_follow_up_over_reordered_documents_blends_them(tiny_engine_factory):
    eng = tiny_engine_factory()
    eng.generate(eng.build_prompt("Where is the harbor?", DOCS), ReusePolicy.exact(), max_new_tokens=1)
    follow = eng.build_prompt("And the bridge?", DOCS[::-1], history=HISTORY)
    full = eng.generate(follow, ReusePolicy.none(), max_new_tokens=1)
    whole = eng.generate(follow, unguarded_blend(ratio=1.0), max_new_tokens=1)
    assert (whole.first_logits - full.first_logits).abs().max() <= 1e-4  # ratio 1.0 == full prefill
    part = eng.generate(follow, unguarded_blend(ratio=0.15), max_new_tokens=1)
    docs = [s.reuse_class for s in part.report.segments[1:4]]
    assert set(docs) <= {ReuseClass.BLENDED, ReuseClass.EXACT} and ReuseClass.BLENDED in docs
    assert part.report.reused_tokens > 0


def test_an_empty_answer_and_turns_with_surrounding_whitespace_keep_the_conversation_going(tiny_engine_factory):
    """An answer that was EOS at once is an empty assistant turn (the server returned it; the follow-up
    was a 400), and a turn echoed back with its newline reads the prompt that produced the answer."""
    eng = tiny_engine_factory()
    first = eng.build_prompt("Where is the harbor?", DOCS)
    follow = eng.build_prompt("And the bridge?", DOCS, history=(Turn(Role.USER, "Where is the harbor?\n"),
                                                                   Turn(Role.ASSISTANT, " North. ")))
    asked = list(first.question.token_ids)
    assert list(follow.question.token_ids[:len(asked)]) == asked and follow.question.turn_ends == (len(asked),)
    empty = eng.build_prompt("And?", DOCS, history=(Turn(Role.USER, "Where?"), Turn(Role.ASSISTANT, "")))
    assert "And?" in empty.question.text


@pytest.mark.parametrize("documents, needle", [
    (["fine", "bad \ud800 text"], "document 2 is not valid Unicode text"),
    (["fine", 7], "document 2 is not a string"),
    ("one string", "not one string"),
])
def test_a_bad_document_is_a_clear_invalid_request(tiny_engine, documents, needle):
    """A lone surrogate in a document reached the tokenizer (an undeclared TypeError); a plain string as the
    documents read as one document per character."""
    with pytest.raises(InvalidRequestError, match=needle):
        tiny_engine.build_prompt("Why?", documents)


def test_precomputing_a_document_with_a_lone_surrogate_is_a_clear_invalid_request(tiny_engine):
    with pytest.raises(InvalidRequestError, match="not valid Unicode text"):
        tiny_engine.precompute_chunks(["bad \ud800 text"])


@pytest.mark.parametrize("n", [2.5, "3", True, 0])
def test_max_new_tokens_must_be_a_positive_integer(tiny_engine, n):
    with pytest.raises(InvalidRequestError, match="max_new_tokens must be an integer >= 1"):
        tiny_engine.generate(tiny_engine.build_prompt("Why?", DOCS), max_new_tokens=n)
