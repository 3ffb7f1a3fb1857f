"""Prompt assembly: segments tokenized separately, then concatenated.

    [ preamble | doc 1 | doc 2 | ... | doc k | question + suffix ]
      chat head   "text\\n\\n" each          "Question: ...<|im_end|>\\n<|im_start|>assistant\\n"
      + system

Each segment is tokenized on its own (no special tokens added), so a
document's token ids never depend on its neighbours and its KV can be keyed
by its own tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Sequence

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


@dataclass(frozen=True)
class Segment:
    kind: SegmentKind
    token_ids: tuple[int, ...]
    text: str

    def __len__(self) -> int:
        return len(self.token_ids)


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


def tokenize_segment(tokenizer, text: str) -> tuple[int, ...]:
    """Token ids of one segment, with no special tokens added."""
    return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])


def document_text(doc: str) -> str:
    """How a document is laid into the prompt."""
    return doc.strip() + "\n\n"


def preamble_segment(tokenizer, system: str | None) -> Segment:
    """The preamble: chat head with the system prompt and the user turn's opening."""
    head, _ = _template_parts(tokenizer, system or DEFAULT_SYSTEM)
    return Segment(SegmentKind.PREAMBLE, tokenize_segment(tokenizer, head), head)


def build_prompt(tokenizer, question: str, documents: Sequence[str], system: str | None = None) -> Prompt:
    """Assemble a prompt from a question and documents.

    Args:
        tokenizer: the model's tokenizer (with a chat template, ideally).
        question: the user's question (non-empty).
        documents: document texts in prompt order (may be empty).
        system: system prompt; default :data:`DEFAULT_SYSTEM`.

    Returns:
        The segmented prompt.
    """
    if not question or not question.strip():
        raise InvalidRequestError("the question is empty")
    system = system or DEFAULT_SYSTEM
    _, tail = _template_parts(tokenizer, system)
    segs = [preamble_segment(tokenizer, system)]
    for i, doc in enumerate(documents):
        if not doc or not doc.strip():
            raise InvalidRequestError(f"document {i + 1} is empty")
        text = document_text(doc)
        segs.append(Segment(SegmentKind.DOCUMENT, tokenize_segment(tokenizer, text), text))
    qtext = f"Question: {question.strip()}{tail}"
    segs.append(Segment(SegmentKind.QUESTION, tokenize_segment(tokenizer, qtext), qtext))
    return Prompt(tuple(segs))
