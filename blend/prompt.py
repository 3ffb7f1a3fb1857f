"""Prompt assembly: segments tokenized separately, then concatenated.

    [ preamble | doc 1 | doc 2 | ... | doc k | question + suffix ]
      chat head   "text\\n\\n" each          "Question: ...<|im_end|>\\n<|im_start|>assistant\\n"
      + system

A conversation (earlier user and assistant turns before the question) keeps
that layout: the documents open the first user turn, as context for the whole
conversation (where RAG chat engines put retrieved context), and the question
segment carries the rest of the conversation, rendered by the chat template::

    [ preamble | doc 1 | ... | doc k | Question: u1 <end> assistant: a1 <end> user: q <end> assistant: ]

so the preamble is the same for every conversation with the same system
prompt, the documents' KV is keyed and reused as in a single question, and
the first turn reads exactly as it did when it was asked alone: each turn's
prompt is the previous turn's prompt, its answer and the new question
(append-only, what a token-level prefix cache such as vLLM's reuses). The
question segment records where each earlier turn's prompt ended
(``turn_ends``); the exact path computes and stores those parts as their own
segments, so a follow-up reuses every earlier turn's KV and computes only
the last answer and the new question::

    question segment  [ Question: u1 <end> assistant: | a1 <end> user: q2 <end> assistant: | a2 ... ]
                        turn 1's prompt ended here ---^   turn 2's ---------------------------^

Each segment is tokenized on its own (no special tokens added), so a
document's token ids never depend on its neighbours and its KV can be keyed
by its own tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Sequence

from blend.control_text import OPEN, control_tokens, encode_marked, encode_user_text, holds_control, mark, unmark
from blend.errors import InvalidRequestError

DEFAULT_SYSTEM = (
    "You are a helpful assistant. Answer the question using the documents. "
    "Reply with a short answer only."
)
_SENTINEL = "\u2063KVBLEND_SPLIT\u2063"


class SegmentKind(Enum):
    PREAMBLE = "preamble"
    DOCUMENT = "document"
    QUESTION = "question"
    TURN = "turn"  # an earlier turn's part of a conversation's question segment (see Segment.parts)


class Role(Enum):
    """Who spoke an earlier turn of a conversation."""

    USER = "user"
    ASSISTANT = "assistant"


@dataclass(frozen=True)
class Turn:
    """One earlier turn of a conversation (before the question)."""

    role: Role
    text: str


@dataclass(frozen=True)
class Segment:
    kind: SegmentKind
    token_ids: tuple[int, ...]
    text: str
    # a conversation's question segment: token offsets where earlier turns' prompts ended
    # (increasing, each inside the segment); () for any other segment
    turn_ends: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.token_ids)

    def parts(self) -> tuple["Segment", ...]:
        """The segment cut at its ``turn_ends``: one TURN segment per earlier turn, then the rest
        (this segment's kind); just this segment when it has no turn ends."""
        if not self.turn_ends:
            return (self,)
        bounds = (0, *self.turn_ends, len(self.token_ids))
        out = [Segment(SegmentKind.TURN, self.token_ids[a:b], "") for a, b in zip(bounds[:-2], bounds[1:-1])]
        return (*out, Segment(self.kind, self.token_ids[bounds[-2]:], ""))


@dataclass(frozen=True)
class Prompt:
    """A prompt as ordered segments: one preamble, documents, one question."""

    segments: tuple[Segment, ...]

    @property
    def token_ids(self) -> list[int]:
        return [t for s in self.segments for t in s.token_ids]

    @property
    def preamble(self) -> Segment:
        return self.segments[0]

    @property
    def documents(self) -> tuple[Segment, ...]:
        return self.segments[1:-1]

    @property
    def question(self) -> Segment:
        return self.segments[-1]

    def __len__(self) -> int:
        return sum(len(s) for s in self.segments)


def _template_parts(tokenizer, system: str) -> tuple[str, str]:
    """Split the chat template around the user message: (head incl. system, tail)."""
    if not getattr(tokenizer, "chat_template", None):
        return f"{system}\n\n", "\nAnswer:"
    for messages in (
        [{"role": "system", "content": system}, {"role": "user", "content": _SENTINEL}],
        [{"role": "user", "content": f"{system}\n\n{_SENTINEL}"}],  # templates without a system role
    ):
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template may reject the system role
            continue
        if _SENTINEL in text:
            head, tail = text.split(_SENTINEL, 1)
            return head, tail
    raise InvalidRequestError("the tokenizer's chat template cannot be split around a user message")


def _conversation_parts(tokenizer, system: str, history: Sequence[Turn], question: str) -> tuple[str, str]:
    """Split a rendered conversation where the documents go: (head incl. system, the rest).

    The documents open the first user turn (the history's, or the question's when the
    history holds only assistant turns), which reads "Question: ..." as a single question
    does; the question is the last user turn.
    """
    turns = [{"role": t.role.value, "content": t.text} for t in history]
    turns.append({"role": Role.USER.value, "content": question})
    first = next(i for i, t in enumerate(turns) if t["role"] == Role.USER.value)
    turns[first]["content"] = f"Question: {turns[first]['content']}"  # as the turn read when asked alone
    if not getattr(tokenizer, "chat_template", None):  # a plain transcript: every user turn a "Question: "
        lines = [(t["content"] if i == first else f"Question: {t['content']}") if t["role"] == Role.USER.value
                 else f"Answer: {t['content']}" for i, t in enumerate(turns)]
        return f"{system}\n\n", "".join(f"{line}\n" for line in lines) + "Answer:"
    turns[first]["content"] = _SENTINEL + turns[first]["content"]
    with_system = [{"role": "system", "content": system}, *turns]
    inline = [dict(t) for t in turns]  # templates without a system role: it opens the first user turn
    inline[first]["content"] = f"{system}\n\n{inline[first]['content']}"
    for messages in (with_system, inline):
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template may reject the system role or the turn order
            continue
        if text.count(_SENTINEL) == 1:
            head, rest = text.split(_SENTINEL, 1)
            return head, rest
    raise InvalidRequestError("the tokenizer's chat template cannot render this conversation "
                              "(check the order of its user and assistant turns)")


def tokenize_segment(tokenizer, text: str) -> tuple[int, ...]:
    """Token ids of one segment, with no special tokens added.

    Args:
        tokenizer: a transformers tokenizer.
        text: the segment's text, as rendered.

    Returns:
        Its token ids.
    """
    return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])


def adds_special_tokens(tokenizer) -> bool:
    """Whether the tokenizer adds tokens of its own to a text it encodes with special tokens (a BOS in front, as
    Llama's and Mistral's do; SmolLM2's and Qwen2's add none). The layout never asks for them: its special
    tokens are the chat template's (see :func:`tokenize_segment`). Probed once per tokenizer, with its other
    derived state (:func:`blend.control_text.control_tokens`), not on every request that asks.

    Args:
        tokenizer: a transformers tokenizer.

    Returns:
        True if ``tokenizer(text)`` differs from ``tokenizer(text, add_special_tokens=False)``.
    """
    return control_tokens(tokenizer).adds_special


def document_ids(tokenizer, doc: str) -> tuple[int, ...]:
    """Token ids of a document as :func:`build_prompt` lays it out (a control token's string in it is
    text, see :mod:`blend.control_text`).

    Args:
        tokenizer: the model's tokenizer.
        doc: the document's text (as given to ``build_prompt``, or already laid out).

    Returns:
        The ids of ``document_text(doc)``.

    Raises:
        InvalidRequestError: the text is not valid Unicode (a lone surrogate: the tokenizer cannot read it).
    """
    if not isinstance(doc, str):
        raise InvalidRequestError("a document is not a string")
    if not is_unicode(doc):
        raise InvalidRequestError("a document is not valid Unicode text (it holds a lone surrogate)")
    return encode_user_text(tokenizer, document_text(doc))


def _user(tokenizer, text: str) -> str:
    """User text as the layout renders it: marked where it spells a control token (else unchanged)."""
    return mark(tokenizer, text) if holds_control(tokenizer, text) else text


def _segment(tokenizer, kind: SegmentKind, rendered: str, turn_ends: tuple[int, ...] = ()) -> Segment:
    """A segment of rendered text whose user parts went through :func:`_user`."""
    return Segment(kind, _ids(tokenizer, rendered), unmark(rendered), turn_ends)


def _ids(tokenizer, rendered: str) -> tuple[int, ...]:
    """Token ids of rendered text: the tokenizer's own unless a user part in it was marked."""
    return encode_marked(tokenizer, rendered) if OPEN in rendered else tokenize_segment(tokenizer, rendered)


def document_text(doc: str) -> str:
    """How a document is laid into the prompt.

    Args:
        doc: the document's text (laying out a laid-out text changes nothing).

    Returns:
        The text stripped (a :mod:`blend.control_text` marker in it dropped first), then a blank line.
    """
    return unmark(doc).strip() + "\n\n"


def preamble_segment(tokenizer, system: str | None) -> Segment:
    """The preamble: chat head with the system prompt and the user turn's opening.

    Args:
        tokenizer: a transformers tokenizer (without a chat template: the system prompt and a blank line).
        system: the system prompt; None: :data:`DEFAULT_SYSTEM`.

    Returns:
        The :attr:`SegmentKind.PREAMBLE` segment.

    Raises:
        InvalidRequestError: the preamble holds no token (an empty system prompt under a template that puts
            nothing before the user's turn).
    """
    head, _ = _template_parts(tokenizer, _user(tokenizer, DEFAULT_SYSTEM if system is None else system))
    return _preamble(tokenizer, head)


def _preamble(tokenizer, head: str) -> Segment:
    """The preamble segment of ``head``, refused when it holds no token (an empty system prompt under a chat
    template that puts nothing before the user's turn): every request's KV starts from it."""
    segment = _segment(tokenizer, SegmentKind.PREAMBLE, head)
    if not segment.token_ids:
        raise InvalidRequestError("the system prompt is empty and the chat template puts nothing before the "
                                  "user's turn: give a non-empty system prompt (or none, for the default)")
    return segment


def build_prompt(tokenizer, question: str, documents: Sequence[str], system: str | None = None,
                 history: Sequence[Turn] = ()) -> Prompt:
    """Assemble a prompt from a question and documents.

    Args:
        tokenizer: the model's tokenizer (with a chat template, ideally).
        question: the user's question (non-empty).
        documents: document texts in prompt order (may be empty).
        system: system prompt; None: :data:`DEFAULT_SYSTEM` ("" is an empty system prompt, not the default).
        history: earlier turns of the conversation, oldest first (may be empty); the
            documents open its first user turn (which reads "Question: ..." as a single
            question does) and the question segment carries the rest.

    Returns:
        The segmented prompt.

    Raises:
        InvalidRequestError: an empty question, document or turn, a conversation the
            chat template cannot render, or an empty system prompt that leaves the preamble
            without a token.
    """
    if not isinstance(question, str) or not question:
        raise InvalidRequestError("the question is empty")
    for i, turn in enumerate(history):
        if not isinstance(turn, Turn) or not isinstance(turn.role, Role) or not isinstance(turn.text, str):
            raise InvalidRequestError(f"history turn {i + 1} is not a Turn(Role, text)")
    for what, text in (("the question", question), ("the system prompt", system or ""),
                       *((f"history turn {i + 1}", t.text) for i, t in enumerate(history))):
        if not is_unicode(text):
            raise InvalidRequestError(f"{what} is not valid Unicode text (it holds a lone surrogate)")
        if _SENTINEL in text:  # the layout splits the rendered template there: it would move the turns
            raise InvalidRequestError(f"{what} holds kvblend's internal split marker ({_SENTINEL!r})")
    # Unicode noncharacter markers dropped first (blend.control_text), then every turn stripped as it was
    # asked or answered, as the question is (a client echoing "q?\n" back would otherwise read another
    # prompt than the one that produced the answer, and lose its turn's reuse)
    question, system = unmark(question).strip(), unmark(system) if system else system
    history = tuple(Turn(t.role, unmark(t.text).strip()) for t in history)
    if not question:
        raise InvalidRequestError("the question is empty")
    for i, turn in enumerate(history):
        if turn.role is not Role.ASSISTANT and not turn.text:  # an answer may be empty (EOS at once)
            raise InvalidRequestError(f"history turn {i + 1} ({turn.role.value}) is empty")
    # (user text spelling a control token is marked, so it reads as text: see blend.control_text)
    history = tuple(Turn(t.role, _user(tokenizer, t.text)) for t in history)
    system = _user(tokenizer, DEFAULT_SYSTEM if system is None else system)  # "": an empty one, as asked
    question = _user(tokenizer, question)
    if history:
        # head: the single-question preamble, or a conversation opening with assistant turns' own
        head, rest = _conversation_parts(tokenizer, system, history, question)
        ids = _ids(tokenizer, rest)
        ends = _turn_ends(tokenizer, system, history, head, ids)
        return Prompt((_preamble(tokenizer, head), *_document_segments(tokenizer, documents),
                       Segment(SegmentKind.QUESTION, ids, unmark(rest), ends)))
    head, tail = _template_parts(tokenizer, system)
    segs = [_preamble(tokenizer, head), *_document_segments(tokenizer, documents)]
    segs.append(_segment(tokenizer, SegmentKind.QUESTION, f"Question: {question}{tail}"))
    return Prompt(tuple(segs))


def bos_prompt(tokenizer) -> Prompt:
    """The prompt of an empty completions prompt (``"prompt": ""``): the BOS token alone, as one
    question segment, which OpenAI-compatible servers generate from. Nothing in it is reused (a
    blend of it is refused: there is no document to blend).

    Args:
        tokenizer: the model's tokenizer.

    Returns:
        A one-segment prompt of the BOS token.

    Raises:
        InvalidRequestError: the tokenizer has no BOS token (nothing to generate from).
    """
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        raise InvalidRequestError("the prompt is empty and this model's tokenizer has no BOS token to generate "
                                  "from: give a non-empty prompt")
    return Prompt((Segment(SegmentKind.QUESTION, (int(bos),), ""),))


def is_unicode(text: str) -> bool:
    """Whether ``text`` encodes to UTF-8.

    Args:
        text: any string.

    Returns:
        False if it holds a lone surrogate (a tokenizer raises TypeError on one), else True.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _turn_ends(tokenizer, system: str, history: Sequence[Turn], head: str, ids: tuple[int, ...]
               ) -> tuple[int, ...]:
    """Where the earlier turns' prompts end inside a conversation's question segment.

    The prompt that produced each assistant turn (the history before it, its user turn as the
    question) is rendered again; where it has this conversation's head and its rest tokenizes
    to a proper prefix of ``ids``, its length is a turn end. A turn whose prompt is not such a
    prefix (a template or tokenizer that is not append-only there) adds no end.

    Returns:
        Increasing token offsets inside ``ids``.
    """
    ends: list[int] = []
    for i, turn in enumerate(history):
        if turn.role is not Role.ASSISTANT or i == 0 or history[i - 1].role is not Role.USER:
            continue
        try:
            prev_head, prev_rest = _conversation_parts(tokenizer, system, history[:i - 1], history[i - 1].text.strip())
        except InvalidRequestError:
            continue
        prev = _ids(tokenizer, prev_rest)
        if prev_head == head and (ends[-1] if ends else 0) < len(prev) < len(ids) and ids[:len(prev)] == prev:
            ends.append(len(prev))
    return tuple(ends)


def _document_segments(tokenizer, documents: Sequence[str]) -> list[Segment]:
    """One segment per document, in order.

    Raises:
        InvalidRequestError: an empty document, or one that is not valid Unicode text.
    """
    if isinstance(documents, (str, bytes)):  # would read as one document per character
        raise InvalidRequestError("documents must be a sequence of texts, not one string")
    segs = []
    for i, doc in enumerate(documents):
        if not isinstance(doc, str):
            raise InvalidRequestError(f"document {i + 1} is not a string")
        if not is_unicode(doc):
            raise InvalidRequestError(f"document {i + 1} is not valid Unicode text (it holds a lone surrogate)")
        if not doc or not unmark(doc).strip():
            raise InvalidRequestError(f"document {i + 1} is empty")
        segs.append(Segment(SegmentKind.DOCUMENT, document_ids(tokenizer, doc), document_text(doc)))
    return segs
