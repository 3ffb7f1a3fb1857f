"""The RAG pipeline API: open an index, ask, read the answer and its report.

    rag = RAG.open("my-index")                       # engine loaded on first ask
    ans = rag.ask("Who keeps the lighthouse?", top_k=3, policy=ReusePolicy.blend())
    print(ans.answer, ans.retrieved, ans.reuse)

A caller that retrieved documents itself passes them as ``documents=``
(texts, or :class:`Retrieved` rows with scores); nothing is searched then.
Documents enter the prompt by score descending, then chunk id (caller texts
without scores keep the caller's order).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from blend.defaults import DEFAULT_DTYPE, DEFAULT_MAX_NEW_TOKENS, DEFAULT_MODEL, DEFAULT_TOP_K
from blend.options import load_engine
from blend.retrieval.catalog import Catalog
from blend.retrieval.chunker import chunk_id
from blend.retrieval.corpus import RetrievalError
from blend.retrieval.embedder import Embedder
from blend.retrieval.engine_kv import engine_kv_signature

if TYPE_CHECKING:  # the engine is imported lazily: retrieval works without it
    from blend.engine import Engine
    from blend.generation import Generation
    from blend.policy import ReusePolicy
    from blend.sampling import GenerationConfig


@dataclass(frozen=True)
class Retrieved:
    """A document that went into the prompt.

    Attributes:
        chunk_id: the chunk's id (for caller documents: the id its text would have).
        score: cosine similarity to the question (NaN for caller texts without a score).
        source: file (``path`` or ``path:line``) or "caller".
        text: the chunk text.
    """

    chunk_id: str
    score: float
    source: str
    text: str


@dataclass(frozen=True)
class ChunkReuse:
    """How one retrieved chunk's KV was produced for this answer.

    Attributes:
        chunk_id: the chunk.
        reuse_class: exact | blended | semantic | computed | rejected | fallback.
        tokens: tokens of the chunk's prompt segment.
        recomputed: of which recomputed above the check layer.
    """

    chunk_id: str
    reuse_class: str
    tokens: int
    recomputed: int


@dataclass(frozen=True)
class RagAnswer:
    """An answer with everything that produced it.

    Attributes:
        answer: the generated text.
        retrieved: documents in prompt order.
        reuse: per-document reuse, aligned with ``retrieved``.
        report: the engine's full reuse report (``ReuseReport.to_dict()``).
        ttft_s: time to first token.
        policy: the policy's description.
        finish_reason: why decoding ended (stop, length; OpenAI's words).
        seed: the sampling seed (the one drawn when the config gave none): the same seed, documents
            and settings give the same answer.
    """

    answer: str
    retrieved: tuple[Retrieved, ...]
    reuse: tuple[ChunkReuse, ...]
    report: dict
    ttft_s: float
    policy: str
    finish_reason: str = "stop"
    seed: int | None = None


def greedy_config(max_tokens: int) -> "GenerationConfig":
    """The pipeline's default decoding: greedy, up to the first newline (what ``Engine.generate`` does).

    Args:
        max_tokens: the budget (>= 1).

    Returns:
        The config.
    """
    from blend.sampling import GenerationConfig

    return GenerationConfig(max_tokens=max_tokens, stop_at_newline=True)


class RagGeneration:
    """A streamed :meth:`RAG.ask`: iterate for the answer's text as it is decided; :meth:`result` runs
    to the end and gives the :class:`RagAnswer`.

    Args:
        generation: the engine's stream over the assembled prompt.
        docs: the documents in prompt order.
    """

    def __init__(self, generation: "Generation", docs: tuple[Retrieved, ...]) -> None:
        self._gen = generation
        self.retrieved = docs

    def __iter__(self) -> "RagGeneration":
        return self

    def __next__(self) -> str:
        return next(self._gen)

    def result(self) -> RagAnswer:
        """Decode to the end (if not yet) and return the answer with its retrieval and reuse."""
        done = self._gen.result()
        report = done.report.to_dict()
        segs = [s for s in report["segments"] if s.get("kind") == "document"]
        reuse = tuple(ChunkReuse(d.chunk_id, s["class"], int(s["tokens"]), int(s.get("recomputed", 0)))
                      for d, s in zip(self.retrieved, segs))
        return RagAnswer(done.text.strip(), self.retrieved, reuse, report, float(done.ttft_s),
                         str(report.get("policy", "")), done.finish_reason.value, done.seed)


def order_documents(docs: Sequence[Retrieved]) -> list[Retrieved]:
    """Deterministic prompt order: score descending, then chunk id; unscored keep their order.

    Args:
        docs: retrieved documents.

    Returns:
        The documents in prompt order.
    """
    if all(math.isnan(d.score) for d in docs):
        return list(docs)
    return sorted(docs, key=lambda d: (-(d.score if not math.isnan(d.score) else -math.inf), d.chunk_id))


class RAG:
    """Questions over an index, answered by the engine with chunk KV reuse.

    Args:
        catalog: the opened index.
        embedder: the sentence embedder the index was built with.
        engine: an engine, or None to load one on first :meth:`ask`.
        engine_args: model, dtype and store for that lazy load.
        system: system prompt for every question.
    """

    def __init__(self, catalog: Catalog | None, embedder: Embedder | None, engine: "Engine | None" = None,
                 engine_args: dict[str, Any] | None = None, system: str | None = None) -> None:
        self.catalog = catalog
        self._embedder = embedder
        self._engine = engine
        self._engine_args = engine_args or {}
        self.system = system

    @classmethod
    def open(cls, index_dir: str | os.PathLike[str] | None, engine: "Engine | None" = None,
             model: str = DEFAULT_MODEL, store: Any = None, dtype: str = DEFAULT_DTYPE,
             embedder: Embedder | None = None, system: str | None = None) -> "RAG":
        """Open an index folder for asking.

        Args:
            index_dir: folder written by ``kvblend ingest`` (None: caller documents only).
            engine: an engine to use; default: load ``model`` with ``store`` on first ask.
            model: model name or path for the lazy load.
            store: ``--store`` spec string or store object for the lazy load.
            dtype: compute dtype for the lazy load.
            embedder: a loaded embedder (default: loaded on first search).
            system: system prompt.

        Returns:
            The pipeline.
        """
        catalog = Catalog.open(index_dir) if index_dir is not None else None
        if catalog is not None and embedder is not None and embedder.info.fingerprint != catalog.meta.embedder_fingerprint:
            raise RetrievalError(f"{index_dir}: index was built with another embedder ({catalog.meta.embedder})")
        return cls(catalog, embedder, engine, dict(model=model, dtype=dtype, store=store), system)

    def kv_stale(self) -> bool:
        """Whether the index's chunk KV was precomputed under other keys than this engine's and this
        system prompt's (another model revision, dtype, GEMM backend, torch...): its chunks are then
        computed per request until ``kvblend ingest`` runs again with this engine.

        Returns:
            False when the index recorded nothing (or there is no index).
        """
        recorded = self.catalog.meta.kv_signature if self.catalog is not None else ""
        return bool(recorded) and recorded != engine_kv_signature(self.engine, self.system)

    @property
    def engine(self) -> "Engine":
        """The engine, loaded on first use."""
        if self._engine is None:
            self._engine = load_engine(**self._engine_args)
        return self._engine

    @property
    def embedder(self) -> Embedder:
        """The embedder, loaded on first use."""
        if self._embedder is None:
            emb = Embedder.load()
            if self.catalog is not None and emb.info.fingerprint != self.catalog.meta.embedder_fingerprint:
                raise RetrievalError(f"{self.catalog.root}: index was built with another embedder ({self.catalog.meta.embedder})")
            self._embedder = emb
        return self._embedder

    def retrieve(self, question: str, top_k: int = DEFAULT_TOP_K) -> list[Retrieved]:
        """Search the index.

        Args:
            question: the query text.
            top_k: chunks wanted (>= 1).

        Returns:
            Up to ``top_k`` documents in prompt order.
        """
        if self.catalog is None:
            raise RetrievalError("no index is open: pass documents= or open an index")
        if top_k < 1:
            raise RetrievalError(f"--top-k must be >= 1, got {top_k}")
        if not self.catalog.records:
            raise RetrievalError(f"{self.catalog.root}: the index is empty")
        q = self.embedder.embed([question])  # (1, D)
        hits = self.catalog.search(q, top_k)[0]
        rows = [Retrieved(h.chunk_id, h.score, f"{h.source}:{h.line}" if h.line is not None else h.source, h.text)
                for h in hits]
        return order_documents(rows)

    def _caller_documents(self, documents: Sequence[str | Retrieved]) -> list[Retrieved]:
        fp = self.engine.provenance.tokenizer_sha256
        rows = [d if isinstance(d, Retrieved) else Retrieved(chunk_id(fp, d), float("nan"), "caller", d) for d in documents]
        return order_documents(rows)

    def ask(self, question: str, top_k: int = DEFAULT_TOP_K, policy: "ReusePolicy | None" = None,
            documents: Sequence[str | Retrieved] | None = None,
            max_new_tokens: int | None = None, extra_documents: Sequence[str] = (),
            config: "GenerationConfig | None" = None) -> RagAnswer:
        """Retrieve (unless ``documents`` are given), assemble the prompt, answer.

        Args:
            question: the question.
            top_k: chunks to retrieve.
            policy: reuse policy (default: the engine's default, exact reuse).
            documents: the caller's own retrieved documents (texts or :class:`Retrieved`).
            max_new_tokens: decoding budget of the default decoding (greedy, single line; default
                :data:`~blend.defaults.DEFAULT_MAX_NEW_TOKENS`); with ``config``, its ``max_tokens`` is the
                budget and this must be left out.
            extra_documents: texts placed after the retrieved (or given) documents, in this
                order (``kvblend ask --index DIR --doc FILE``).
            config: sampling and stop settings (:class:`~blend.sampling.GenerationConfig`: temperature,
                top-p, seed, stop strings, multi-line...); None: greedy up to the first newline.

        Returns:
            The answer with retrieved chunks, per-chunk reuse and the full report.

        Raises:
            RetrievalError: no index and no documents, a bad ``top_k``, an empty index.
            ValueError: both ``config`` and ``max_new_tokens``.
        """
        if config is None:
            config = greedy_config(DEFAULT_MAX_NEW_TOKENS if max_new_tokens is None else max_new_tokens)
        elif max_new_tokens is not None:
            raise ValueError("give the budget as config.max_tokens, not max_new_tokens, with a config")
        return self.stream(question, top_k, policy, documents, extra_documents, config).result()

    def stream(self, question: str, top_k: int = DEFAULT_TOP_K, policy: "ReusePolicy | None" = None,
               documents: Sequence[str | Retrieved] | None = None, extra_documents: Sequence[str] = (),
               config: "GenerationConfig | None" = None) -> "RagGeneration":
        """:meth:`ask`, streamed: retrieval runs now, decoding as the result is iterated.

            g = rag.stream("Who keeps the lighthouse?", config=GenerationConfig(temperature=0.7, seed=1))
            for text in g:
                print(text, end="")
            ans = g.result()  # the RagAnswer

        Args:
            question, top_k, policy, documents, extra_documents: as :meth:`ask`.
            config: sampling and stop settings (None: greedy up to the first newline, the default budget).

        Returns:
            A :class:`RagGeneration` (iterate for text; ``result()`` for the :class:`RagAnswer`).
        """
        from blend.generation import stream

        docs = self._caller_documents(documents) if documents is not None else self.retrieve(question, top_k)
        if extra_documents:
            fp = self.engine.provenance.tokenizer_sha256
            docs = [*docs, *(Retrieved(chunk_id(fp, t), float("nan"), "caller", t) for t in extra_documents)]
        engine = self.engine
        prompt = engine.build_prompt(question, [d.text for d in docs], system=self.system)
        return RagGeneration(stream(engine, prompt, policy, config or greedy_config(DEFAULT_MAX_NEW_TOKENS)),
                             tuple(docs))
