"""Small in-process helpers for tests and benchmarks (no model downloads).

``word_tokenizer()`` is a byte-level BPE-free tokenizer built with the
``tokenizers`` library: whitespace/punctuation pre-tokenization and a
word-level model whose vocabulary is learned from a given text, so token
counts are predictable (one word or punctuation mark = one token).
``FakeKV`` stands in for the engine's chunk KV store.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

from blend.retrieval.chunker import ChunkerConfig
from blend.retrieval.ingest import ingest
from blend.retrieval.ingest_options import IngestOptions


def word_tokenizer(corpus: Iterable[str] = ()) -> object:
    """A ``transformers`` fast tokenizer with one token per word or punctuation mark.

    Args:
        corpus: texts whose words form the vocabulary (others map to ``[UNK]``,
            still one token each).

    Returns:
        A ``PreTrainedTokenizerFast``.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]", "[PAD]"], min_frequency=1)
    tok.train_from_iterator(list(corpus) or ["a"], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")


@dataclass
class FakeKV:
    """A dict standing in for the engine's canonical chunk KV store.

    Attributes:
        entries: chunk text -> bytes stored.
        calls: texts passed to each ``write`` call.
        fail_on_call: raise RuntimeError on this (1-based) write call.
    """

    entries: dict[str, int] = field(default_factory=dict)
    calls: list[list[str]] = field(default_factory=list)
    fail_on_call: int | None = None
    deleted: list[str] = field(default_factory=list)

    def write(self, texts: list[str]) -> int:
        """Store texts not yet stored; returns bytes 'written' (100 per token-ish char)."""
        self.calls.append(list(texts))
        if self.fail_on_call is not None and len(self.calls) == self.fail_on_call:
            raise RuntimeError("simulated crash while writing KV")
        n = 0
        for t in texts:
            if t not in self.entries:
                self.entries[t] = 100 * len(t)
                n += self.entries[t]
        return n

    def delete(self, chunk_id: str, text: str) -> bool:
        """Delete a chunk's KV; True when it is gone."""
        self.deleted.append(chunk_id)
        self.entries.pop(text, None)
        return True


class HashEmbedder:
    """A deterministic stand-in for :class:`~blend.retrieval.embedder.Embedder`.

    Bag-of-words vectors hashed into ``dim`` buckets, L2-normalized: texts that
    share words are closer. Records every batch it embeds.
    """

    def __init__(self, dim: int = 64) -> None:
        from blend.retrieval.embedder import EmbedderInfo

        self.info = EmbedderInfo("hash-bow", dim, 0, "0" * 64)
        self.batches: list[list[str]] = []

    @property
    def dim(self) -> int:
        return self.info.dim

    def embed(self, texts: list[str], batch_size: int | None = None) -> "object":
        import hashlib

        import numpy as np

        self.batches.append(list(texts))
        out = np.zeros((len(texts), self.dim), dtype=np.float32)  # (N, D)
        for r, t in enumerate(texts):
            for w in t.lower().split():
                out[r, int.from_bytes(hashlib.sha256(w.strip(".,!?").encode()).digest()[:4], "little") % self.dim] += 1.0
        norms = np.linalg.norm(out, axis=1, keepdims=True)  # (N, 1)
        return out / np.maximum(norms, 1e-9)


def tiny_index(root: Path, docs: Mapping[str, str], target_tokens: int = 8) -> Path:
    """Write ``docs`` as files under ``root/corpus`` and ingest them into the index ``root/idx`` with the
    word tokenizer and :class:`HashEmbedder` (no model), quietly.

    Args:
        root: an empty folder.
        docs: file name -> text.
        target_tokens: the chunker's target chunk length.

    Returns:
        The index folder.
    """
    corpus = root / "corpus"
    corpus.mkdir()
    for name, text in docs.items():
        (corpus / name).write_text(text)
    ingest([corpus], root / "idx", tokenizer=word_tokenizer(docs.values()), embedder=HashEmbedder(),
           options=IngestOptions(config=ChunkerConfig(target_tokens=target_tokens), stream=io.StringIO()))
    return root / "idx"
