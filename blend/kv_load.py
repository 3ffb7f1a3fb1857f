"""Loading stored KV into a request's cache: entries appended at the next positions, K rotated there.

Stored K is before RoPE (except an EXACT entry's, computed at exactly its positions), so a load rotates
it at the positions it lands on; runs of short segments are joined first and rotated together
(:func:`load_runs`). :meth:`blend.model.ModelRunner.load_many` is the entry point; this module holds
what it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from blend.kvcache import KVCache, KVEntry
from blend.layer_weights import ModelDims
from blend.rope import RopeTables, apply_rope_into


# a stored segment of at least this many rows is rotated straight from its entry into the cache when loaded;
# consecutive shorter ones are joined first and rotated together (fewer ops: many short documents paid ~6 per
# segment and layer). Straight from the entry saves the joined copy's write and read: a 5 x 600-row prefix
# (fp32, two threads, AMX Xeon) loaded in 25 ms instead of 32.
LOAD_DIRECT_MIN_ROWS = 128


@dataclass(frozen=True)
class LoadRun:
    """Consecutive stored segments rotated together: entries [first, last), rows [start, stop) of the load."""

    first: int
    last: int
    start: int
    stop: int


def load_runs(lengths: Sequence[int], min_rows: int, alone: Sequence[bool] | None = None) -> list[LoadRun]:
    """Split segments of these row counts into runs for :func:`load_entries`: each segment of at
    least ``min_rows`` rows alone, each maximal stretch of shorter ones together.

    Args:
        lengths: rows of each segment, in order (at least one).
        min_rows: the shortest segment rotated on its own.
        alone: per segment, whether it makes a run of its own whatever its length (an entry with K
            already rotated: copied, never joined); None: none does.

    Returns:
        the runs, in order, covering every segment and row once.
    """
    runs: list[LoadRun] = []
    row, joining = 0, False  # joining: the last run is a stretch of short segments
    for j, n in enumerate(lengths):
        short = n < min_rows and not (alone is not None and alone[j])
        if short and joining:
            last = runs[-1]
            runs[-1] = LoadRun(last.first, j + 1, last.start, row + n)
        else:
            runs.append(LoadRun(j, j + 1, row, row + n))
        joining = short
        row += n
    return runs


def load_entries(cache: KVCache, segs: Sequence[KVEntry], rope: RopeTables, dims: ModelDims,
                 dtype: torch.dtype, device: torch.device) -> None:
    """Append stored segments, in order, at the next positions.

    Per layer, one concatenation of V straight into the cache. K before RoPE is rotated straight
    from each stored segment into the cache (one pass over its rows); runs of short segments are
    joined first and rotated together (:func:`load_runs`), since a prefix of many short documents
    paid ~6 ops per segment and layer. The same numbers as loading each in turn (RoPE is
    elementwise per position, and the tables are indexed by position). An entry whose K is
    already rotated (``rotated``: an EXACT entry, computed at exactly these positions) is copied.

    Args:
        cache: the request's cache (the segments go at its end).
        segs: stored entries, (L, Hkv, S_j, D) K and V each; none: nothing happens.
        rope: the model's RoPE tables; dims: its shapes.
        dtype, device: the cache's (entries are cast to them).
    """
    if not segs:
        return
    start = cache.length
    runs = load_runs([int(e.k.shape[2]) for e in segs], LOAD_DIRECT_MIN_ROWS, [e.rotated for e in segs])
    s = runs[-1].stop
    pos = torch.arange(start, start + s, device=device)  # (S,)
    cache.set_positions(start, pos)
    if not all(e.rotated for e in segs):  # some K before RoPE: the tables at these positions
        cos, sin = rope(pos)  # (S, R) float32
        cos, sin = cos.to(dtype), sin.to(dtype)  # once, not per run and layer (apply_rope_into casts)
    joined = max((r.stop - r.start for r in runs if r.last - r.first > 1), default=0)
    scratch = (torch.empty(dims.num_kv_heads * joined * dims.head_dim, dtype=dtype, device=device)
               if joined else None)  # (Hkv * rows of the longest joined run * D,) reused across runs and layers
    for i in range(dims.num_layers):
        k_rows, v_rows = cache.rows(i, start, start + s)  # (Hkv, S, D) views of the cache
        vs = [e.v[i].to(device=device, dtype=dtype) for e in segs]  # (Hkv, S_j, D) each
        if len(vs) == 1:
            v_rows.copy_(vs[0])
        else:
            torch.cat(vs, dim=1, out=v_rows)  # straight into the cache
        for r in runs:
            if segs[r.first].rotated:  # K after RoPE at these positions: a copy
                k_rows[:, r.start:r.stop].copy_(segs[r.first].k[i])
                continue
            ks = [e.k[i].to(device=device, dtype=dtype) for e in segs[r.first:r.last]]  # (Hkv, S_j, D)
            if len(ks) == 1:
                k = ks[0]
            else:
                n = r.stop - r.start
                k = torch.cat(ks, dim=1, out=scratch[: dims.num_kv_heads * n * dims.head_dim].view(
                    dims.num_kv_heads, n, dims.head_dim))  # (Hkv, n, D)
            apply_rope_into(k_rows[:, r.start:r.stop], k, cos[r.start:r.stop], sin[r.start:r.stop])
    cache.advance(s)
