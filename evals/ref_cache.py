"""The sweep's cache of full prefill's first-token logits: one file per (engine provenance, prompt tokens).

A file is a ``torch.save`` record ``{"logits": (V,) float tensor, "sha256": its digest}``, read back with
``weights_only`` and used only if it is exactly such a record for this engine's vocabulary with finite values
its digest agrees with; anything else (absent, a FIFO, oversized, another format, a flipped bit) is computed
again and the file overwritten atomically.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import torch

from blend import safeio
from blend.engine import Engine
from blend.policy import ReusePolicy


def ref_key(engine: Engine, token_ids: list[int]) -> str:
    """Cache key of a full-prefill reference: the engine's provenance and the prompt's tokens."""
    h = hashlib.sha256(engine.provenance_json.encode())
    h.update(json.dumps(token_ids).encode())
    return h.hexdigest()[:32]


REF_FILE_SLACK = 1 << 16  # a saved record's bytes beyond its (V,) values (torch.save's zip: names, pickle, digest)


def _logits_digest(t: torch.Tensor) -> str:
    """sha256 of a (V,) tensor's dtype and bytes: what a cached reference is checked against."""
    return hashlib.sha256(str(t.dtype).encode() + t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _cached_reference(path: Path, vocab: int) -> torch.Tensor | None:
    """The logits saved at ``path`` if the file is a record ``{"logits": a finite float (V,) tensor, "sha256":
    its digest}``, else None (absent; not a regular file; larger than such a record saves to; not what torch.load
    reads with ``weights_only``; a bare tensor, as files before the digest held; another shape or dtype,
    non-finite values, or values the digest disagrees with: a flipped bit in the tensor's bytes loads without
    complaint otherwise): the caller computes them again and overwrites the file."""
    try:
        data = safeio.read_regular(path, vocab * 8 + REF_FILE_SLACK, follow_symlinks=True)
        rec = torch.load(io.BytesIO(data), weights_only=True)
    except Exception:  # noqa: BLE001 - OSError (absent, a FIFO, oversized), and whatever torch.load raises on bad bytes
        return None
    t = rec.get("logits") if isinstance(rec, dict) else None
    ok = (isinstance(t, torch.Tensor) and t.shape == (vocab,) and t.is_floating_point()
          and bool(torch.isfinite(t).all()) and rec.get("sha256") == _logits_digest(t))
    return t if ok else None


def reference_logits(engine: Engine, prompt, cache_dir: Path) -> torch.Tensor:
    """Full prefill's first-token logits (V,), from ``cache_dir`` or computed and saved atomically with their
    digest (a cached file that is not such a record is computed again: see ``_cached_reference``)."""
    path = cache_dir / f"{ref_key(engine, list(prompt.token_ids))}.pt"
    cached = _cached_reference(path, engine.runner.dims.vocab)
    if cached is not None:
        return cached
    logits, _, _ = engine.prefill(prompt, ReusePolicy.one_pass())
    cache_dir.mkdir(parents=True, exist_ok=True)
    saved = logits.detach().cpu().clone()  # (V,)
    with safeio.atomic_file(path) as f:
        torch.save({"logits": saved, "sha256": _logits_digest(saved)}, f)
    return logits
