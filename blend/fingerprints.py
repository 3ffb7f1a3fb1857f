"""Fingerprints of what a model's KV depends on: its weights, its tokenizer, the files it came from.

A weights fingerprint (sha256 over every tensor's name, dtype, shape and bytes) costs a pass over the
weights (~1.7 s for SmolLM2 here), so it is cached: in a checkpoint folder's own ``FINGERPRINT_FILE``
(what a GGUF conversion writes, valid while the folder's files are as the file's stamp recorded them) or
under ``$KVBLEND_HOME/fingerprints``. Every cache file is read bounded and checked; one that is not a
sha256 is a miss, computed again and rewritten atomically.

A cached fingerprint is trusted only for the bytes it was computed from. A file's names, sizes and times
say nothing about bytes the disk (or a tool that restores timestamps) changed underneath, so beside the
sha256 each record keeps the weights' XXH3-128 (:func:`weights_check_digest`, ~30-90 ms for SmolLM2's
650 MB against ~0.5 s for the sha256), recomputed on every load and compared: a mismatch is a miss, and
the sha256 is computed again from the weights as loaded. Without this a weight flipped at rest kept its
old fingerprint, and the KV computed with the changed weights was stored and served under the key of the
weights converted.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Callable

import torch
import xxhash

from blend import safeio
from blend.defaults import kvblend_home

FINGERPRINT_FILE = "kvblend-fingerprint.json"

log = logging.getLogger(__name__)


CHECK_DIGEST_FIELD = "weights_xxh3"  # a record's XXH3-128 of the weights it fingerprints


def _hash_weights(model: torch.nn.Module, h) -> str:
    """Feed (name, dtype, shape, bytes) of every parameter and buffer, sorted by name, to ``h``; its hex digest."""
    state = model.state_dict()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(memoryview(t.view(torch.uint8).numpy()))  # the tensor's bytes, no copy
    return h.hexdigest()


def weights_fingerprint(model: torch.nn.Module) -> str:
    """sha256 over (name, dtype, shape, bytes) of every parameter and buffer, sorted by name: the weights'
    identity in every provenance key.

    Args:
        model: the loaded model.

    Returns:
        The digest, 64 lowercase hex digits.
    """
    return _hash_weights(model, hashlib.sha256())


def weights_check_digest(model: torch.nn.Module) -> str:
    """XXH3-128 over the same bytes as :func:`weights_fingerprint`: not an identity (not collision resistant),
    the fast check on every load that the weights are still the ones a cached fingerprint was computed from.

    Args:
        model: the loaded weights.

    Returns:
        32 lowercase hex digits.
    """
    return _hash_weights(model, xxhash.xxh3_128())


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 over the tokenizer's full serialized rules, specials and chat template.

    Args:
        tokenizer: a transformers tokenizer (a slow one is hashed by its vocabulary).

    Returns:
        The digest, 64 lowercase hex digits.
    """
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:  # slow tokenizer: the vocabulary is the best we have
        h.update(json.dumps(tokenizer.get_vocab(), sort_keys=True).encode())
    h.update(json.dumps(sorted(map(str, tokenizer.all_special_tokens))).encode())
    h.update((getattr(tokenizer, "chat_template", None) or "").encode())
    return h.hexdigest()


MAX_FINGERPRINT_BYTES = 1 << 16  # a fingerprint file is ~100 bytes
_HEX = frozenset("0123456789abcdef")


def read_record(path: Path) -> dict | None:
    """A fingerprint file's row: a JSON object whose ``weights_sha256`` is 64 lowercase hex digits, or None
    when the file is absent, not a regular file, oversized, not JSON or anything else (logged).

    Args:
        path: the fingerprint file (a symbolic link is followed).

    Returns:
        The row as read, or None.
    """
    try:
        data = safeio.read_regular(path, MAX_FINGERPRINT_BYTES, follow_symlinks=True)
    except FileNotFoundError:
        return None
    except OSError as e:  # safeio.UnsafeFileError too
        log.warning("ignoring the weights fingerprint %s (%s); computing it again", path, e)
        return None
    try:
        row = json.loads(data)
    except (ValueError, RecursionError):  # not JSON (UnicodeDecodeError too); nesting
        row = None
    fp = row.get("weights_sha256") if isinstance(row, dict) else None
    if isinstance(fp, str) and len(fp) == 64 and set(fp) <= _HEX:
        return row
    log.warning("ignoring the malformed weights fingerprint %s; computing it again", path)
    return None


def files_stamp(path: Path) -> str:
    """A checkpoint folder's weight and config files as they are on disk: names, sizes, inodes, mtimes and
    ctimes (the fingerprint file itself left out). Saving new weights into the folder, or copying the
    folder, changes it.

    Args:
        path: the checkpoint folder.

    Returns:
        A sha256 of the files' stamps, 64 lowercase hex digits.
    """
    files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".json")
                   and p.name != FINGERPRINT_FILE)
    return hashlib.sha256("|".join(
        f"{p.name}:{st.st_size}:{st.st_ino}:{st.st_mtime_ns}:{st.st_ctime_ns}"
        for p, st in ((p, p.stat()) for p in files)).encode()).hexdigest()


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes, cached under KVBLEND_HOME by its path, size, inode, mtime and ctime.

    Args:
        path: the file.

    Returns:
        The digest, 64 lowercase hex digits.
    """
    st = path.stat()
    stamp = hashlib.sha256(f"{path.resolve()}|{st.st_size}:{st.st_ino}:{st.st_mtime_ns}:{st.st_ctime_ns}"
                           .encode()).hexdigest()

    def compute() -> str:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        return h.hexdigest()

    return cached_digest(f"file-{stamp}", path, compute)


def cached_digest(name: str, path: Path, compute: Callable[[], str], check: str | None = None) -> str:
    """A sha256 cached under ``$KVBLEND_HOME/fingerprints/<name>.json``: read if the cache holds a valid one,
    else computed and written atomically (a corrupt or hand-edited cache file is a miss).

    Args:
        name: the cache file's name, a stamp of what the digest is of.
        path: what it is the digest of (recorded beside it, for people).
        compute: makes the digest on a miss.
        check: the :func:`weights_check_digest` of what is being fingerprinted now: a cached digest
            recorded with another check digest (or none) is a miss. None: no such check.

    Returns:
        64 lowercase hex digits.
    """
    cache = kvblend_home() / "fingerprints" / f"{name}.json"
    row = read_record(cache)
    if row is not None and (check is None or row.get(CHECK_DIGEST_FIELD) == check):
        return row["weights_sha256"]
    if row is not None:
        log.warning("kvblend: the weights of %s changed since their fingerprint was cached (their files' "
                    "names, sizes and times did not); fingerprinting them again", path)
    digest = compute()
    cache.parent.mkdir(parents=True, exist_ok=True)
    fresh = {"weights_sha256": digest, "path": str(path)}
    if check is not None:
        fresh[CHECK_DIGEST_FIELD] = check
    safeio.atomic_write_text(cache, json.dumps(fresh))
    return digest
