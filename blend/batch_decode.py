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
small and needs no padding or masks when done per sequence. At 16 rows, though,
reading the 16 caches is half the step, and it goes faster in one call: when every
cache of a THROUGHPUT step is a slot of one :class:`~blend.decode_pool.DecodePool`
(the server's decode loop moves them there), K/V writes are one scatter and
attention one ``bmm`` pair per layer over the slots' range, padded to the longest
sequence and masked by length and position (:class:`PooledStep`); a step of one
sequence keeps the per-sequence program.

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

from dataclasses import dataclass
from typing import Sequence

import torch

from blend.decode_batching import DecodeBatching
from blend.decode_pool import DecodePool, PoolSlotCache
from blend.kvcache import KVCache
from blend.model import ModelRunner, attend, causal_mask, layer_forward
from blend.rope import apply_rope

INVARIANT_TILE = 16  # rows per GEMM in INVARIANT mode (a size every tested BLAS treats alike at any row)


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


@dataclass(frozen=True)
class PooledStep:
    """A step whose caches are all slots of one :class:`~blend.decode_pool.DecodePool`: its K/V
    writes and its attention run once per layer over the slots ``[lo, hi)``, ``rows`` keys each.

    Attributes:
        pool: the pool.
        lo, hi: the slot range the step reads (slots in it that are not in the step are read and
            their rows discarded).
        rows: keys per slot (the longest sequence's, with this step's row).
        slot_of: (B,) int64, each sequence's slot minus ``lo``.
        start: (B,) int64, each sequence's new row.
        mask: (hi - lo, 1, rows) additive: 0 where a key is one of the slot's rows at or before
            its sequence's position, -inf elsewhere (a slot not in the step sees its first key).
    """

    pool: DecodePool
    lo: int
    hi: int
    rows: int
    slot_of: torch.Tensor
    start: torch.Tensor
    mask: torch.Tensor

    @staticmethod
    def of(caches: Sequence[KVCache], starts: list[int], pos: torch.Tensor) -> "PooledStep | None":
        """The pooled form of a step over ``caches`` (positions already set), or None when they are
        not all slots of one pool, or fewer than two."""
        if len(caches) < 2 or not all(isinstance(c, PoolSlotCache) for c in caches):
            return None
        pool = caches[0].pool  # type: ignore[attr-defined]
        if any(c.pool is not pool for c in caches):  # type: ignore[attr-defined]
            return None
        slots = [c.slot for c in caches]  # type: ignore[attr-defined]
        lo, hi, rows = min(slots), max(slots) + 1, max(starts) + 1
        pool.ensure_readable(slots, rows, starts)  # before the step writes its rows: padding keys must be finite
        dev = pos.device
        slot_of = torch.tensor(slots, dtype=torch.long, device=dev) - lo  # (B,)
        start = torch.tensor(starts, dtype=torch.long, device=dev)  # (B,)
        keys = torch.arange(rows, device=dev)  # (R,)
        visible = torch.zeros(hi - lo, rows, dtype=torch.bool, device=dev)  # (S', R)
        visible[:, 0] = True  # a slot outside the step: any finite row, discarded
        visible[slot_of] = (keys[None, :] <= start[:, None]) & (pool.pos[slot_of + lo, :rows] <= pos[:, None])
        mask = torch.zeros(visible.shape, dtype=pool.k[0].dtype, device=dev).masked_fill(~visible, float("-inf"))
        return PooledStep(pool, lo, hi, rows, slot_of, start, mask[:, None, :])  # (S', 1, R)


class BatchDecodeRows:
    """:class:`~blend.model.LayerRows` of one decode step over B sequences (plus padding rows):
    row i's K/V go into ``caches[i]`` at its next position, and row i attends over that cache
    (per sequence, or, for slots of one pool, once per layer over the pool: ``pooled``)."""

    def __init__(self, caches: Sequence[KVCache], starts: list[int], cos: torch.Tensor, sin: torch.Tensor,
                 masks: list[torch.Tensor | None], scale: float, tile: int | None,
                 pooled: PooledStep | None = None) -> None:
        self.caches, self.starts, self.cos, self.sin, self.masks, self.scale = caches, starts, cos, sin, masks, scale
        self.gemm_tile = tile
        self.pooled = pooled

    def store_kv(self, layer, q, k, v, h):
        b = len(self.caches)
        k_rot = apply_rope(k[:, :b], self.cos, self.sin)  # (Hkv, B, D)
        p = self.pooled
        if p is not None:  # one scatter per layer into the pool: slot, every head, the new row
            slots = p.slot_of + p.lo  # (B,)
            p.pool.k[layer][slots, :, p.start] = k_rot.transpose(0, 1)  # (B, Hkv, D)
            p.pool.v[layer][slots, :, p.start] = v[:, :b].transpose(0, 1)  # (B, Hkv, D)
            return q, h
        for i, c in enumerate(self.caches):
            c.write(layer, self.starts[i], k_rot[:, i:i + 1], v[:, i:i + 1])
        return q, h

    def attend(self, layer, q):
        b = len(self.caches)
        q_rot = apply_rope(q[:, :b], self.cos, self.sin)  # (Hq, B, D)
        rows = torch.zeros(q.shape[1], q.shape[0] * q.shape[2], dtype=q.dtype, device=q.device)  # (N, Hq D)
        if self.pooled is not None:
            rows[:b] = self._attend_pooled(layer, q_rot)
            return rows
        for i, c in enumerate(self.caches):
            k_all, v_all = c.view(layer, self.starts[i] + 1)  # (Hkv, T, D)
            rows[i] = attend(q_rot[:, i:i + 1].contiguous(), k_all, v_all, self.scale, self.masks[i])[0]
        return rows

    def _attend_pooled(self, layer: int, q_rot: torch.Tensor) -> torch.Tensor:
        """Every sequence's row over its slot, one ``bmm`` pair for the whole slot range.

        Args:
            layer: the layer.
            q_rot: (Hq, B, D) the step's queries after RoPE.

        Returns:
            (B, Hq D) attention output rows, in the step's order.
        """
        p = self.pooled
        hq, b, d = q_rot.shape
        k = p.pool.k[layer][p.lo:p.hi, :, :p.rows]  # (S', Hkv, R, D) a view
        v = p.pool.v[layer][p.lo:p.hi, :, :p.rows]  # (S', Hkv, R, D) a view
        s, hkv = k.shape[0], k.shape[1]
        qs = torch.zeros(s, hq, d, dtype=q_rot.dtype, device=q_rot.device)  # (S', Hq, D)
        qs[p.slot_of] = q_rot.transpose(0, 1)  # query head h reads KV head h // (Hq / Hkv)
        keys = k.reshape(s * hkv, p.rows, d).transpose(1, 2)  # (S' Hkv, D, R) still a view
        # in the cache dtype: torch's CPU bmm has no float32 output, so a bf16/fp16 pool rounds its scores
        # before the fp32 softmax (README: within bf16's own noise; the per-sequence route keeps them fp32)
        scores = torch.bmm(qs.view(s * hkv, hq // hkv, d), keys)  # (S' Hkv, G, R)
        scores = scores.view(s, hq, p.rows) * self.scale + p.mask  # (S', Hq, R)
        probs = torch.softmax(scores.float(), dim=-1).to(v.dtype).view(s * hkv, hq // hkv, p.rows)  # (S' Hkv, G, R)
        out = torch.bmm(probs, v.reshape(s * hkv, p.rows, d))  # (S' Hkv, G, D)
        return out.view(s, hq * d)[p.slot_of]  # (B, Hq D)


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
        pooled = PooledStep.of(caches, starts, pos) if batching is DecodeBatching.THROUGHPUT else None
        masks = [] if pooled is not None else [
            causal_mask(pos[i:i + 1], caches[i].pos[: starts[i] + 1], runner.dtype) for i in range(b)]  # (1, T)
        self.rows = BatchDecodeRows(caches, starts, cos, sin, masks, runner.dims.scale, self.tile, pooled)
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
