"""Property: a conversation's turn ends are where its earlier turns' prompts ended, for any turns.

Random conversations (user and assistant turns in any order, any text) on the tiny model's
tokenizer with its chat template and on the byte tokenizer without one: every turn end cuts the
question segment exactly where the prompt that produced that turn's answer ended, the parts
put together are the question segment, and a build never fails for any other reason than its
own error type.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from blend.errors import InvalidRequestError
from blend.prompt import Role, Turn, build_prompt
from blend.tiny import TinyModel, build_tiny, byte_tokenizer

CHAT_TOKENIZER = build_tiny(TinyModel.LLAMA)[1]  # the tiny model's tokenizer, with a ChatML template

DOCS = ["The harbor lies north of the river.", "The bridge was built in 1890."]
TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=30)
TURNS = st.lists(st.tuples(st.sampled_from([Role.USER, Role.ASSISTANT]), TEXT), max_size=6)


def _check(tok, raw_turns, question) -> None:
    history = tuple(Turn(r, t) for r, t in raw_turns)
    try:
        prompt = build_prompt(tok, question, DOCS, None, history)
    except InvalidRequestError:
        return
    q = prompt.question
    parts = q.parts()
    assert [t for p in parts for t in p.token_ids] == list(q.token_ids)
    assert list(q.turn_ends) == sorted(set(q.turn_ends)) and all(0 < e < len(q) for e in q.turn_ends)
    for end in q.turn_ends:  # each end is an earlier turn's whole prompt
        i = next(i for i in range(1, len(history)) if history[i].role is Role.ASSISTANT
                 and history[i - 1].role is Role.USER
                 and len(build_prompt(tok, history[i - 1].text, DOCS, None, history[:i - 1]).question) == end)
        earlier = build_prompt(tok, history[i - 1].text, DOCS, None, history[:i - 1])
        assert prompt.token_ids[:len(earlier)] == earlier.token_ids


@settings(max_examples=60, deadline=None, derandomize=True)
@given(turns=TURNS, question=TEXT)
def test_turn_ends_are_earlier_prompts_with_a_chat_template(turns, question):
    _check(CHAT_TOKENIZER, turns, question)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(turns=TURNS, question=TEXT)
def test_turn_ends_are_earlier_prompts_without_a_chat_template(turns, question):
    _check(byte_tokenizer(), turns, question)
