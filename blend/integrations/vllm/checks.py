"""What the connector checks before it touches KV: whether a request's KV is its token ids' own, and whether a
stored block may be injected. No vLLM import."""

from __future__ import annotations

from typing import Any

import torch

from blend.store.base import Lookup, LookupStatus


def skip_reason(request: Any) -> str:
    """Why a request's KV is not a function of its token ids under the base model ('' if it is): the store's keys
    name tokens only, so such a request neither claims stored blocks nor blends nor saves.

    Args:
        request: vLLM's ``Request`` (read: ``lora_request``, ``prompt_embeds``, ``mm_features``).

    Returns:
        The reason, as the request's report says it; '' for a plain text request.
    """
    if getattr(request, "lora_request", None) is not None:  # the store holds the base model's KV
        return "LoRA request: kvblend neither loads nor saves its KV"
    if getattr(request, "prompt_embeds", None) is not None:  # rows from embeddings, not from their token ids
        return "prompt embeddings: kvblend neither loads nor saves their KV"
    if getattr(request, "mm_features", None):  # placeholder token ids stand for the media
        return "multimodal request: kvblend neither loads nor saves its KV"
    return ""


def unusable(got: Lookup, want: tuple[int, ...]) -> str:
    """Why a stored block cannot be injected ('' if it can): not a hit, the wrong (L, Hkv, B, D) shape,
    or non-finite values (the store's own checks cover provenance and dtype).

    Args:
        got: the store's lookup of the block.
        want: the (L, Hkv, B, D) shape vLLM's cache holds per block.

    Returns:
        The reason, for the load's report; '' for a block that may be written into vLLM's cache.
    """
    entry = got.entry
    if got.status is not LookupStatus.HIT or entry is None:
        return f"{got.status.value} {got.reason}".strip()
    if tuple(entry.k.shape) != want:
        return f"shape {tuple(entry.k.shape)}, want {want}"
    if not bool(torch.isfinite(entry.k).all() and torch.isfinite(entry.v).all()):
        return "non-finite values"
    return ""
