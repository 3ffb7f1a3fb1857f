"""The stored form of one segment's KV (all layers): what a computed segment leaves behind and what a
store returns. Its K is before RoPE, except in an entry whose ``rotated`` flag says it is after RoPE at
the positions it was computed at (an EXACT entry, see :attr:`blend.keys.Namespace.k_after_rope`).

Kept apart from :mod:`blend.kvcache` so that the store's tiers (and ``kvblend store ls``, which reads
only headers) can name the type without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class KVEntry:
    """KV rows of one segment, all layers.

    Attributes:
        k: keys, (L, Hkv, T, D): before RoPE, or after it where ``rotated``.
        v: values, (L, Hkv, T, D).
        provenance: canonical JSON of the producing :class:`~blend.keys.Provenance`.
        rotated: k is after RoPE at the positions the entry was computed at: it can only be
            loaded there (a copy). Not stored: a store's namespace says it
            (:attr:`~blend.keys.Namespace.k_after_rope`), and the segment cache sets it on lookup.
    """

    k: torch.Tensor  # (L, Hkv, T, D)
    v: torch.Tensor  # (L, Hkv, T, D)
    provenance: str = ""  # "" until the segment cache stamps it for the store
    rotated: bool = False

    @property
    def num_tokens(self) -> int:
        return int(self.k.shape[2])

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()
