"""One decode step for several sequences at once.

Each sequence keeps its own :class:`~blend.kvcache.KVCache` (the very cache its
prefill filled, blended or exact; nothing is copied into a shared layout).
The step batches what is shared and loops over what is not::

    tokens (B,) ─► embed ─► per layer:  QKV GEMM over B rows ─► RoPE at each row's own position
                                         ─► per sequence: write its K/V row, attend over its cache
                                         ─► O-proj + MLP GEMMs over B rows
                    ─► final norm + LM head GEMM over B rows ─► logits (B, V)

On a CPU (and at small batches on a GPU) decode time is the weight reads of
the GEMMs, which B rows share; attention of one query row over one cache is
small and needs no padding or masks when done per sequence.

Batching and bit-identity. A BLAS picks its kernel (and so its reduction
order) by the number of rows M, so a row's logits may differ in the last bits
between M=1 and M=5. Two modes:

- ``THROUGHPUT``: one GEMM of B rows. A row agrees with the same sequence
  decoded alone to float rounding (tests bound it), and B=1 is bit-identical
  to :meth:`ModelRunner.decode_step`.
- ``INVARIANT``: every GEMM runs on fixed tiles of :data:`INVARIANT_TILE`
  rows (padded), so each row's numbers are the same whatever else is in the
  batch and wherever it sits: concurrent answers are bit-identical to
  one-at-a-time ones. It costs the padding (on this CPU a 16-row GEMM of the
  135M model takes ~3x a 1-row one; on a GPU it is nearly free).
"""

from __future__ import annotations

from enum import Enum
from typing import Sequence

import torch

from blend.kvcache import KVCache
from blend.model import ModelRunner, attend, causal_mask, layer_forward
from blend.rope import apply_rope

INVARIANT_TILE = 16  # rows per GEMM in INVARIANT mode (a size every tested BLAS treats alike at any row)


class DecodeBatching(Enum):
    THROUGHPUT = "throughput"  # one GEMM over the batch; equal to one-at-a-time within float rounding
    INVARIANT = "invariant"  # fixed-size GEMM tiles; bit-identical to one-at-a-time


def _padded(n: int, batching: DecodeBatching) -> int:
    if batching is DecodeBatching.THROUGHPUT:
        return n
    return -(-n // INVARIANT_TILE) * INVARIANT_TILE


def _rope_rows(runner: ModelRunner, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin (B, R) at each row's position. Dynamic-NTK tables depend on the
    longest position of the call, so there each sequence gets its own tables
    (as its one-at-a-time decode step would)."""
    if not runner.rope.dynamic:
        return runner.rope(pos)
    pairs = [runner.rope(pos[b:b + 1]) for b in range(pos.shape[0])]
    return torch.cat([c for c, _ in pairs]), torch.cat([s for _, s in pairs])


class BatchDecodeRows:
    """:class:`~blend.model.LayerRows` of one decode step over B sequences (plus padding rows):
    row i's K/V go into ``caches[i]`` at its next position, and row i attends over that cache."""

    def __init__(self, caches: Sequence[KVCache], starts: list[int], cos: torch.Tensor, sin: torch.Tensor,
                 masks: list[torch.Tensor | None], scale: float, tile: int | None) -> None:
        self.caches, self.starts, self.cos, self.sin, self.masks, self.scale = caches, starts, cos, sin, masks, scale
        self.gemm_tile = tile

    def store_kv(self, layer, q, k, v, h):
        b = len(self.caches)
        k_rot = apply_rope(k[:, :b], self.cos, self.sin)  # (Hkv, B, D)
        for i, c in enumerate(self.caches):
            c.write(layer, self.starts[i], k_rot[:, i:i + 1], v[:, i:i + 1])
        return q, h

    def attend(self, layer, q):
        b = len(self.caches)
        q_rot = apply_rope(q[:, :b], self.cos, self.sin)  # (Hq, B, D)
        rows = torch.zeros(q.shape[1], q.shape[0] * q.shape[2], dtype=q.dtype, device=q.device)  # (N, Hq D)
        for i, c in enumerate(self.caches):
            k_all, v_all = c.view(layer, self.starts[i] + 1)  # (Hkv, T, D)
            rows[i] = attend(q_rot[:, i:i + 1].contiguous(), k_all, v_all, self.scale, self.masks[i])[0]
        return rows


class DecodeStep:
    """One batched decode step that runs a layer at a time, so a thread can stop between
    layers and hand the rest to another (the server's decode shares). Running it to the end
    is :func:`decode_batch`: the same operations in the same order, so the same bits.

    Args:
        runner: the engine's model runner.
        caches: one cache per sequence (any lengths); each gains one row when the step finishes.
        tokens: the token fed to each sequence.
        batching: GEMM batching mode (see the module docstring).
    """

    def __init__(self, runner: ModelRunner, caches: Sequence[KVCache], tokens: Sequence[int],
                 batching: DecodeBatching = DecodeBatching.THROUGHPUT) -> None:
        b = len(caches)
        if b == 0 or len(tokens) != b:
            raise ValueError(f"decode_batch needs one token per cache, got {len(tokens)} for {b}")
        for c in caches:
            if c.length >= c.capacity:
                raise ValueError(f"KV cache full: {c.length} rows of capacity {c.capacity}")
        dev = runner.device
        self.runner, self.caches, self.b = runner, caches, b
        self.n = _padded(b, batching)
        self.tile = INVARIANT_TILE if batching is DecodeBatching.INVARIANT else None
        ids = torch.zeros(self.n, dtype=torch.long, device=dev)  # (N,) padded rows decode token 0, unused
        ids[:b] = torch.tensor(list(tokens), dtype=torch.long, device=dev)
        starts = [c.length for c in caches]
        pos = torch.tensor(starts, dtype=torch.long, device=dev)  # (B,)
        cos, sin = _rope_rows(runner, pos)  # (B, R)
        for c, p in zip(caches, pos):
            c.set_positions(c.length, p[None])
        masks = [causal_mask(pos[i:i + 1], caches[i].pos[: starts[i] + 1], runner.dtype) for i in range(b)]  # (1, T)
        self.rows = BatchDecodeRows(caches, starts, cos, sin, masks, runner.dims.scale, self.tile)
        self.layer = 0
        with torch.inference_mode():
            self.h = runner.embed(ids)  # (N, C)

    @property
    def done(self) -> bool:
        """Every layer has run."""
        return self.layer >= len(self.runner.layers)

    def advance(self) -> bool:
        """Run the next layer; True while layers remain."""
        if not self.done:
            with torch.inference_mode():
                self.h = layer_forward(self.runner.layers[self.layer], self.runner.dims, self.layer, self.h,
                                       self.rows)  # (N, C)
            self.layer += 1
        return not self.done

    def finish(self) -> torch.Tensor:
        """Run the remaining layers and the LM head; return (B, V) float32 logits, row b for ``caches[b]``."""
        while self.advance():
            pass
        with torch.inference_mode():
            spans = [(0, self.n)] if self.tile is None else [(lo, lo + self.tile) for lo in range(0, self.n, self.tile)]
            logits = torch.cat([self.runner.logits(self.h[lo:hi]) for lo, hi in spans])[: self.b]  # (B, V)
        for c in self.caches:
            c.advance(1)
        return logits


def decode_batch(runner: ModelRunner, caches: Sequence[KVCache], tokens: Sequence[int],
                 batching: DecodeBatching = DecodeBatching.THROUGHPUT) -> torch.Tensor:
    """Feed one token to each sequence; return every sequence's next-token logits.

    Args:
        runner: the engine's model runner.
        caches: one cache per sequence (any lengths); each gains one row.
        tokens: the token fed to each sequence.
        batching: GEMM batching mode (see the module docstring).

    Returns:
        (B, V) float32 logits, row b for ``caches[b]``.
    """
    return DecodeStep(runner, caches, tokens, batching).finish()
