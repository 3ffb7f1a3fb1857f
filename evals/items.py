"""The evaluation item types, shared by data files (:mod:`blend.evals.data`) and the
synthetic sets (:mod:`blend.evals.synthetic`)."""

from __future__ import annotations

from dataclasses import dataclass


class DataError(ValueError):
    """A data file or record that does not follow the record format."""


@dataclass(frozen=True)
class Document:
    """One retrieved passage."""

    title: str
    text: str

    def prompt_text(self) -> str:
        """The document as it goes into the prompt: "{title}\\n{text}", or the text alone."""
        return f"{self.title}\n{self.text}" if self.title else self.text


@dataclass(frozen=True)
class Item:
    """One question with its passages and gold answers (none for a user's own questions)."""

    id: str
    question: str
    documents: tuple[Document, ...]
    answers: tuple[str, ...]

    def document_texts(self) -> list[str]:
        """Prompt texts of the documents, in retrieval order."""
        return [d.prompt_text() for d in self.documents]
