"""Where a token's K and V live inside one of vLLM's paged KV blocks.

vLLM's CPU backend allocates each layer's cache as ``[num_blocks, Hkv, B, 2 D]``
and lets its C++ kernel (``cpu_attn_reshape_and_cache``) lay K and V out inside a
(block, head) slab in an ISA-dependent order (K transposed for the vector
kernels). Rather than hard-code one order, :func:`calibrate` asks the backend's
own writer to store a code tensor into a scratch block and reads back where each
(head, row, dim) of K and V landed. The result, a :class:`BlockLayout`, is two
index maps that read and write any block's rows, whatever the kernel does, as
long as it is a permutation (which :func:`calibrate` checks).

Nothing here imports vLLM: the writer is passed in, so the tests drive this
module with fake layouts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

# writer(key (B, Hkv, D), value (B, Hkv, D), block (1, Hkv, B, 2D)): stores rows 0..B-1 into the block
BlockWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


class LayoutError(RuntimeError):
    """The backend's block layout is not a permutation of (head, row, dim): nothing can be injected."""


@dataclass(frozen=True)
class BlockLayout:
    """Flat offsets of K and V inside one block.

    Attributes:
        k_index: (Hkv, B, D) int64 offset of K[h, row, d] in a flattened block.
        v_index: (Hkv, B, D) int64 offset of V[h, row, d].
    """

    k_index: torch.Tensor  # (Hkv, B, D)
    v_index: torch.Tensor  # (Hkv, B, D)

    @property
    def block_size(self) -> int:
        return int(self.k_index.shape[1])

    def read(self, cache: torch.Tensor, block: int, rows: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``rows`` of one block.

        Args:
            cache: (num_blocks, Hkv, B, 2D) one layer's paged cache.
            block: the block id.
            rows: rows of the block.

        Returns:
            k, v: (Hkv, R, D) each (K after RoPE, as vLLM stores it).
        """
        flat = cache[block].reshape(-1)  # (Hkv B 2D,)
        return flat[self.k_index[:, rows]], flat[self.v_index[:, rows]]

    def offsets(self, block_ids: torch.Tensor, start: int, end: int, block_stride: int) -> tuple[torch.Tensor, ...]:
        """Flat offsets, in a whole layer's cache, of token rows ``start .. end`` of a request.

        Args:
            block_ids: (nblocks,) int64 the request's blocks in order (token t is in block t // B).
            start, end: the token rows.
            block_stride: elements per block (Hkv * B * 2D).

        Returns:
            k_off, v_off: (Hkv, T, D) int64 offsets (the same for every layer of one cache shape).
        """
        t = torch.arange(start, end)  # (T,)
        b = self.block_size
        base = (block_ids[t // b] * block_stride)[None, :, None]  # (1, T, 1)
        return base + self.k_index[:, t % b], base + self.v_index[:, t % b]  # (Hkv, T, D) x2

    def scatter(self, cache: torch.Tensor, offs: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor,
                v: torch.Tensor) -> None:
        """Write rows (Hkv, T, D) of K and V at :meth:`offsets` of one layer's (contiguous) cache."""
        flat = cache.view(-1)
        flat[offs[0].reshape(-1)] = k.reshape(-1).to(cache.dtype)
        flat[offs[1].reshape(-1)] = v.reshape(-1).to(cache.dtype)


def calibrate(writer: BlockWriter, kv_heads: int, block_size: int, head_dim: int) -> BlockLayout:
    """Learn the block layout from the backend's own writer.

    Args:
        writer: stores key/value rows (B, Hkv, D) at slots 0..B-1 of a (1, Hkv, B, 2D) block.
        kv_heads, block_size, head_dim: the cache's shape.

    Returns:
        The layout.

    Raises:
        LayoutError: the writer did not place every K and V element exactly once.
    """
    h, b, d = kv_heads, block_size, head_dim
    n = h * b * d
    if 2 * n + 1 >= 2 ** 24:  # codes must be exact in float32
        raise LayoutError(f"block of {2 * n} elements is too large to calibrate in float32")
    codes = torch.arange(1, 2 * n + 1, dtype=torch.float32)  # 0 marks "never written"
    k_codes = codes[:n].view(h, b, d)  # (Hkv, B, D): code of K[h, row, d]
    v_codes = codes[n:].view(h, b, d)
    block = torch.zeros(1, h, b, 2 * d, dtype=torch.float32)
    writer(k_codes.transpose(0, 1).contiguous(), v_codes.transpose(0, 1).contiguous(), block)  # (B, Hkv, D) rows
    flat = block.reshape(-1)
    got = flat.round().long()  # (Hkv B 2D,) code stored at each offset
    if not torch.equal(torch.sort(got).values, torch.arange(1, 2 * n + 1)):
        raise LayoutError("the backend's cache writer is not a permutation of K and V rows")
    where = torch.empty(2 * n + 1, dtype=torch.long)
    where[got] = torch.arange(2 * n)  # code -> offset
    return BlockLayout(where[k_codes.long()], where[v_codes.long()])


def standard_layout(kv_heads: int, block_size: int, head_dim: int) -> BlockLayout:
    """The plain layout: K rows (B, D) then V rows (B, D) per (block, head). The reference for tests.

    Args:
        kv_heads: KV heads per layer (Hkv).
        block_size: rows per block (B).
        head_dim: the head dimension (D).

    Returns:
        The layout: K of head h at ``h * 2BD + row * D + d``, V a further ``BD`` on, (Hkv, B, D) int64 each.
    """
    h, b, d = kv_heads, block_size, head_dim
    base = (torch.arange(h) * (2 * b * d))[:, None, None]  # (Hkv, 1, 1)
    rows = (torch.arange(b) * d)[None, :, None] + torch.arange(d)[None, None, :]  # (1, B, D)
    return BlockLayout(base + rows, base + b * d + rows)
