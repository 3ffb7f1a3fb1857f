"""What the connector checks before it touches KV: whether a request's KV is its token ids' own, and whether a
stored block may be injected, and whether vLLM's KV cache is one the connector can address. No vLLM import at
module level."""

from __future__ import annotations

from typing import Any

from blend.store.base import Lookup, LookupStatus
from blend.store.codec import all_finite


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
    if not (all_finite(entry.k) and all_finite(entry.v)):  # from the memory tier (a persistent one rejects them)
        return "non-finite values"
    return ""


def kv_cache_refusal(kv_cache_config: Any) -> str:
    """Why the connector cannot serve vLLM's KV cache ('' if it can). It keeps one block table per request and
    writes and reads every layer through it, so vLLM must hold one KV cache group, of full attention: with
    several (a hybrid or sliding-window model) each group has its own block ids and the first group's would be
    used for every layer; a sliding-window group swaps blocks that left the window for vLLM's shared null block.

    Args:
        kv_cache_config: vLLM's ``KVCacheConfig`` (its ``kv_cache_groups``).

    Returns:
        The reason, for the start-up error; '' for one group of full attention.
    """
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    groups = list(kv_cache_config.kv_cache_groups)
    kinds = ", ".join(type(g.kv_cache_spec).__name__ for g in groups) or "none"
    spec = groups[0].kv_cache_spec if len(groups) == 1 else None
    if spec is None or not isinstance(spec, FullAttentionSpec) or isinstance(spec, MLAAttentionSpec):
        return (f"kvblend's connector needs one KV cache group of full attention, vLLM has {len(groups)} "
                f"({kinds}): a sliding-window, hybrid or MLA model's KV cache is not supported")
    return ""
