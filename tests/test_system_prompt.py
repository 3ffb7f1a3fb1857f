"""An explicit empty system prompt is empty; only a missing one gets the default instructions."""

from blend.prompt import DEFAULT_SYSTEM
from blend.serve.schemas import ChatMessage, conversation


def test_an_empty_system_message_is_not_the_default(tiny_engine):
    default = tiny_engine.build_prompt("Which?", ["A doc."])
    named = tiny_engine.build_prompt("Which?", ["A doc."], system=DEFAULT_SYSTEM)
    empty = tiny_engine.build_prompt("Which?", ["A doc."], system="")
    assert default.preamble.token_ids == named.preamble.token_ids
    assert empty.preamble.token_ids != default.preamble.token_ids
    assert "helpful assistant" not in tiny_engine.tokenizer.decode(list(empty.preamble.token_ids))
    assert empty.documents[0].token_ids == default.documents[0].token_ids  # only the preamble moves


def test_the_server_reads_an_empty_system_message_as_asked():
    user = ChatMessage(role="user", content="q?")
    assert conversation([user])[0] is None  # no system message: the engine's default
    assert conversation([ChatMessage(role="system", content=""), user])[0] == ""
    assert conversation([ChatMessage(role="system", content="a"), ChatMessage(role="developer", content="b"),
                         user])[0] == "a\n\nb"


def test_an_empty_preamble_is_refused_not_crashed_on(tiny_engine, monkeypatch):
    """A template that renders nothing before the user's turn leaves an empty system prompt's preamble
    without a token: a clear request error (400 on the server), not a crash in attention; precompute with
    such a preamble is not silently given the default one."""
    import pytest

    from blend.errors import InvalidRequestError
    from blend.prompt import preamble_segment

    monkeypatch.setattr(tiny_engine.tokenizer, "chat_template", "{% for m in messages %}{{ m['content'] }}{% endfor %}",
                        raising=False)
    with pytest.raises(InvalidRequestError, match="system prompt is empty"):
        tiny_engine.build_prompt("Which?", ["A doc."], system="")
    with pytest.raises(InvalidRequestError, match="system prompt is empty"):
        preamble_segment(tiny_engine.tokenizer, "")
    with pytest.raises(InvalidRequestError, match="system prompt is empty"):
        tiny_engine.precompute_chunks(["A doc."], system="")
    assert len(tiny_engine.build_prompt("Which?", ["A doc."]).preamble) > 0  # the default still works
