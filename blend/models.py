"""Model loading.

Names the engine understands:

- ``smollm2-135m``, ``qwen2.5-coder-0.5b``: GGUF models shipped in PyPI packages, converted once
  (dequantized) to a safetensors copy under ``$KVBLEND_HOME/models`` (:mod:`blend.conversion`).
- ``tiny-llama``, ``tiny-qwen2``, ``tiny-llama-rope-llama3``,
  ``tiny-llama-rope-linear``: tiny random models for tests.
- any local directory holding a Llama/Qwen2/Mistral-family checkpoint.

A checkpoint folder is read through :mod:`blend.checkpoint` (a damaged or incomplete one is a
:class:`~blend.errors.CheckpointError`, never weights filled at random); a converted copy found damaged is
discarded and converted again. The weights fingerprint (:mod:`blend.fingerprints`) is computed once and
cached.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from blend import checkpoint
from blend.conversion import QWEN_CODER, SMOLLM2, checked_fingerprint, convert_gguf, discard
from blend.errors import CheckpointError, UnknownModelError
from blend.fingerprints import (CHECK_DIGEST_FIELD, FINGERPRINT_FILE, cached_digest, files_stamp, read_record,
                                tokenizer_fingerprint, weights_check_digest, weights_fingerprint)
from blend.tiny import TinyModel, build_tiny

__all__ = ["FINGERPRINT_FILE", "QWEN_CODER", "SMOLLM2", "SUPPORTED_ARCHS", "LoadedModel", "convert_gguf",
           "load_model", "tokenizer_fingerprint", "weights_fingerprint"]

SUPPORTED_ARCHS = ("llama", "qwen2", "mistral")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    """A transformers causal LM plus what provenance needs to know about it."""

    name: str
    model: torch.nn.Module  # a transformers *ForCausalLM in eval mode
    tokenizer: object  # a transformers tokenizer
    weights_sha256: str
    tokenizer_sha256: str


def _quiet_transformers() -> None:
    """No hub access, no progress bars: the engine prints its own progress."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _dir_fingerprint(path: Path, model: torch.nn.Module) -> str:
    """Weights fingerprint of a local checkpoint, cached by the folder and its files' names, sizes, inodes,
    mtimes and ctimes (a copy that keeps the mtimes, ``cp -p`` or ``rsync -a`` of same-size files, still
    changes the ctimes: the cached value of the old weights is not taken for the new ones).

    A cached value that is not a sha256 (a corrupt or hand-edited file) is a miss: the fingerprint
    is computed again and the cache rewritten atomically. The folder's own fingerprint file (what
    :func:`convert_gguf` writes) is taken only while its recorded stamp still matches the folder's files:
    ``save_pretrained`` of other weights into the folder leaves that file behind, and the old value
    would have keyed the new weights' KV as the old ones'. Either cached value is taken only while the
    weights' XXH3 (computed on every load) equals the one recorded with it: bytes changed at rest without
    changing the files' stamp are fingerprinted again, not keyed as the weights they were. Weights
    fingerprinted here are checked finite first (the pass over them is paid then; a cached fingerprint is
    of files already checked).

    Raises:
        CheckpointError: a weight holds NaN or infinity.
    """
    files = files_stamp(path)
    check = weights_check_digest(model)  # every load: the bytes a cached fingerprint was computed from
    own = read_record(path / FINGERPRINT_FILE)
    if own is not None and own.get("stamp") == files and own.get(CHECK_DIGEST_FIELD) == check:
        return own["weights_sha256"]
    stamp = hashlib.sha256(f"{path.resolve()}|{files}".encode()).hexdigest()

    def compute() -> str:
        checkpoint.check_finite(model, path)
        return weights_fingerprint(model)

    return cached_digest(stamp, path, compute, check)


def _read_dir(path: Path) -> tuple[torch.nn.Module, object]:
    """A checkpoint folder's model (fp32, eval mode) and tokenizer, each file checked as it is read.

    Raises:
        UnknownModelError: an architecture or a quantization the engine does not run.
        CheckpointError: a file is damaged, or the weights lack what the config describes.
    """
    cfg = checkpoint.load_config(path)
    if cfg.model_type not in SUPPORTED_ARCHS:
        raise UnknownModelError(
            f"{path}: architecture {cfg.model_type!r} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})"
        )
    if getattr(cfg, "quantization_config", None):  # transformers quantizes at forward time: the raw weights
        raise UnknownModelError(f"{path}: quantized checkpoints are not supported "  # would be read as they are
                                f"({dict(cfg.quantization_config).get('quant_method', 'quantization_config')})")
    checkpoint.check_layers(path, cfg)  # before transformers builds what the config declares
    model = checkpoint.load_weights(path)
    if getattr(model, "hf_quantizer", None) is not None:
        raise UnknownModelError(f"{path}: quantized checkpoints are not supported")
    return model, checkpoint.load_tokenizer(path)


def _load_dir(path: Path, name: str) -> LoadedModel:
    model, tok = _read_dir(path)
    return LoadedModel(name, model, tok, _dir_fingerprint(path, model), tokenizer_fingerprint(tok))


def _load_conversion(path: Path, name: str) -> LoadedModel:
    model, tok = _read_dir(path)
    tok_fp = tokenizer_fingerprint(tok)
    return LoadedModel(name, model, tok, checked_fingerprint(path, model, tok_fp), tok_fp)


def _load_converted(name: str) -> LoadedModel:
    """A named GGUF model from its converted copy; a copy found damaged (a file truncated, zeroed or replaced
    since the conversion) is discarded and converted again, once."""
    out = convert_gguf(name)
    try:
        return _load_conversion(out, name)
    except CheckpointError as e:
        log.warning("kvblend: the converted copy of %s is damaged (%s); converting it again", name, e)
        discard(out)
    return _load_conversion(convert_gguf(name), name)


def load_model(name: str) -> LoadedModel:
    """Load a model by name or local path, in fp32 (the engine casts).

    Args:
        name: a known name (see module docstring) or a checkpoint directory.

    Returns:
        The model, its tokenizer and fingerprints.

    Raises:
        UnknownModelError: an unknown name, or a folder that is not a checkpoint the engine runs.
        CheckpointError: a checkpoint folder whose files are damaged or incomplete (a named model's
            converted copy is converted again first).
    """
    _quiet_transformers()
    tiny = {m.value: m for m in TinyModel}
    if name in tiny:
        model, tok = build_tiny(tiny[name])
        return LoadedModel(name, model, tok, weights_fingerprint(model), tokenizer_fingerprint(tok))
    if name in (SMOLLM2, QWEN_CODER):
        return _load_converted(name)
    path = Path(name).expanduser()
    if path.is_dir():
        return _load_dir(path, str(path.resolve()))
    known = ", ".join([SMOLLM2, QWEN_CODER, *tiny])
    raise UnknownModelError(f"unknown model {name!r}: use one of {known} or a checkpoint directory")
