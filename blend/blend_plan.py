"""A blended request's plan: where its re-positioned rows sit and their tables, built once.

The documents after the exact prefix and the question take rows [e, T) of the
cache (n = nb document rows + the question's rows); each document's canonical KV
(K before RoPE) is rotated to its place layer by layer as the pass reaches it
(:meth:`BlendPlan.prepare`), and the check layers the policy asks for are fixed
here (none under full reuse), as are the weights the pass's layers run on
(:func:`pass_layers`). :mod:`blend.blending` runs the pass over it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from blend.kernels import rope_rows
from blend.kvcache import KVCache, KVEntry
from blend.layer_weights import LayerWeights
from blend.model import ModelRunner
from blend.policy import ReusePolicy
from blend.probe_pass import recompute_dtype
from blend.prompt import Prompt
from blend.segment_values import ChunkKV

# rows of K and V :meth:`BlendPlan.prepare` re-positions (or tempers) in one go: several layers of a short
# prompt's documents (per-call overhead), about one layer of a long one's (its rows stay in the CPU's cache
# until the layer reads them: re-positioning every layer up front measured slower at ~3k tokens)
PREPARE_GROUP_BYTES = 4 << 20


@dataclass(frozen=True)
class CheckSpec:
    """One check layer of the policy: where, which one (0 = first), at what ratio."""

    layer: int
    index: int
    ratio: float


@dataclass(frozen=True)
class BlendPlan:
    """Per-request tensors of the re-positioned rows [e, T), built once (n = nb doc rows + question rows)."""

    e: int  # first re-positioned row (everything before it is an exact prefix in the cache)
    chunks: tuple[KVEntry, ...]  # each blended document's cached K (before RoPE) and V, (L, Hkv, n_j, D)
    starts: tuple[int, ...]  # each document's first row relative to e (its rows: starts[j] + [0, n_j))
    pos: torch.Tensor  # (n,) int64 new absolute positions
    cos: torch.Tensor  # (n, R) rotary tables at ``pos``
    sin: torch.Tensor  # (n, R)
    ids: torch.Tensor  # (n,) int64 token ids
    doc: torch.Tensor  # (nb,) int64 blended-document index of each document row
    offset: torch.Tensor  # (nb,) int64 offset of each document row inside its document
    forced: torch.Tensor  # (nb,) bool rows that must be recomputed (semantic edits)
    nb: int  # document rows; rows >= nb are the question
    budget_base: int  # reused document tokens the ratio counts
    checks: tuple[CheckSpec, ...]  # empty: full KV reuse (nothing is ever selected)
    # what this request's passes have done to the cache so far (see :meth:`prepare`, :meth:`_tables`)
    _done: "_PlanProgress" = field(default_factory=lambda: _PlanProgress(), compare=False, repr=False)

    @property
    def n(self) -> int:
        return int(self.pos.shape[0])

    @property
    def last_check(self) -> int | None:
        """The last check layer (None under full reuse): above it no selection reads anything, so only there
        may the recomputed rows run in another precision (``attention_precision``, ``linear_precision``)."""
        return self.checks[-1].layer if self.checks else None

    def always(self) -> torch.Tensor:
        """(F + Nq,) rows recomputed whatever the selector says: forced rows and the question."""
        return torch.cat([torch.nonzero(self.forced).flatten(), torch.arange(self.nb, self.n)])

    def cached(self, layer: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's cached K (before RoPE) and V of every document row: (Hkv, nb, D) each, in ``dtype``."""
        k = torch.cat([c.k[layer].to(dtype) for c in self.chunks], dim=1)  # (Hkv, nb, D)
        v = torch.cat([c.v[layer].to(dtype) for c in self.chunks], dim=1)  # (Hkv, nb, D)
        return k, v

    def prepare(self, layer: int, cache: KVCache, temperature: float = 1.0) -> None:
        """Make one layer's cached document rows ready for a pass that reads them: re-positioned (once
        per request) and, with ``temperature`` != 1, tempered (once). Works ahead over the next layers
        in one go while their rows fit :data:`PREPARE_GROUP_BYTES` (fewer, larger ops on short prompts;
        on long ones the rows are still in the CPU's cache when their layer reads them).

        Args:
            layer: the layer about to be computed.
            cache: the request's cache.
            temperature: the reused rows' attention temperature at this layer (1.0: none).
        """
        done = self._done
        if layer not in done.placed:
            group = self._group(layer, cache, lambda i: i not in done.placed)
            self.reposition_layers(group, cache)
            done.placed.update(group)
        if temperature != 1.0 and layer not in done.tempered:
            group = self._group(layer, cache, lambda i: i in done.placed and i not in done.tempered)
            self.temper(group, cache, temperature)
            done.tempered.update(group)

    def _group(self, layer: int, cache: KVCache, todo) -> range:
        """The layers :meth:`prepare` handles at once from ``layer``: consecutive ones for which ``todo``
        holds, as many as fit PREPARE_GROUP_BYTES of K and V rows (at least ``layer`` itself)."""
        n_layers, heads, dim, dtype, _ = cache.shape
        per_layer = 2 * heads * self.nb * dim * dtype.itemsize  # K and V of one layer's document rows
        stop = min(n_layers, layer + max(1, PREPARE_GROUP_BYTES // max(per_layer, 1)))
        return range(layer, next((i for i in range(layer + 1, stop) if not todo(i)), stop))

    def reposition_layers(self, layers: range, cache: KVCache) -> None:
        """Rotate the cached K of every document at its new positions into the cache (rows e .. e+nb)
        at each of ``layers`` (consecutive), V beside it: the numbers of :meth:`reposition_one`, with one
        rotation per document over all of those layers and one copy call per K and per V."""
        if len(layers) == 1:
            for c, lo in zip(self.chunks, self.starts):
                self.reposition_one(layers.start, cache, c, lo)
            return
        dtype = cache.k[0].dtype
        for c, lo in zip(self.chunks, self.starts):
            hi = lo + c.num_tokens
            k = c.k[layers.start:layers.stop].to(dtype)  # (Ls, Hkv, n_j, D)
            v = c.v[layers.start:layers.stop].to(dtype)  # (Ls, Hkv, n_j, D)
            flat = (-1, *k.shape[2:])  # (Ls Hkv, n_j, D): layers and heads as one dim, one op for all
            k_rot, _ = _rotate(k.reshape(flat), v.reshape(flat), self.cos[lo:hi], self.sin[lo:hi])
            k_rot = k_rot.view(k.shape)  # (Ls, Hkv, n_j, D)
            dst = [cache.rows(layer, self.e + lo, self.e + hi) for layer in layers]  # Ls x 2 x (Hkv, n_j, D)
            torch._foreach_copy_([d[0] for d in dst], list(k_rot.unbind(0)))
            torch._foreach_copy_([d[1] for d in dst], list(v.unbind(0)))

    def reposition_one(self, layer: int, cache: KVCache, chunk: KVEntry, lo: int) -> None:
        """One layer of one document (its rows start ``lo`` rows after e), rotated straight into the
        cache: one pass over the rows, no temporary."""
        hi = lo + chunk.num_tokens
        dtype = cache.k[layer].dtype
        k, v = chunk.k[layer].to(dtype), chunk.v[layer].to(dtype)  # (Hkv, n_j, D) in the compute dtype
        _rotate(k, v, self.cos[lo:hi], self.sin[lo:hi], out=cache.rows(layer, self.e + lo, self.e + hi))

    def temper(self, layers: range, cache: KVCache, temperature: float) -> None:
        """Divide the re-positioned document K in the cache (rows e .. e+nb) of ``layers`` by
        ``temperature``, in place: every query's attention logit to those rows becomes logit / T (APE's
        attention temperature on reused KV). Rows recomputed there are written over them afterwards."""
        rows = [cache.rows(layer, self.e, self.e + self.nb)[0] for layer in layers]  # Ls x (Hkv, nb, D) views
        torch._foreach_mul_(rows, 1.0 / temperature)

    def write_fresh(self, layer: int, cache: KVCache, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Rotate fresh K of ``rows`` (A,) (sorted, distinct, relative to e) at their positions and
        write them with V into the cache. k, v: (Hkv, A, D) before RoPE (the numbers rope_mix mixes in)."""
        if rows.shape[0] == self.n:  # every row (layers up to the first check): one contiguous write
            _rotate(k, v, self.cos, self.sin, out=cache.rows(layer, self.e, self.e + self.n))
            return
        cos, sin, at = self._tables(rows)  # (A, R) x2, (A,) rows of the cache
        k_rot, v_new = _rotate(k, v, cos, sin)  # (Hkv, A, D) x2
        cache.write_rows(layer, at, k_rot, v_new)

    def _tables(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rotary tables and cache rows of ``rows`` (A,), gathered once per set of rows (the same
        active rows are written at every layer between two check layers)."""
        done = self._done
        if done.tables is None or done.tables[0] is not rows:
            done.tables = (rows, self.cos[rows], self.sin[rows], self.e + rows)
        return done.tables[1], done.tables[2], done.tables[3]


@dataclass
class _PlanProgress:
    """One request's progress over its cache, owned by its :class:`BlendPlan`."""

    placed: set[int] = field(default_factory=set)  # layers whose document rows are re-positioned
    tempered: set[int] = field(default_factory=set)  # layers whose re-positioned K is tempered
    # the last active rows written and their gathered tables: (rows (A,), cos (A, R), sin (A, R), cache rows (A,))
    tables: tuple[torch.Tensor, ...] | None = None


def _rotate(k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """K rotated at the tables' positions, V beside it: ``rope_mix`` with no fresh rows (so the same
    numbers whichever rows are fresh), unchecked (the plan built the arguments). k, v: (H, S, D);
    cos, sin: (S, R)."""
    return rope_rows(k, v, cos, sin, out=out)


def plan_blend(model: ModelRunner, prompt: Prompt, blended: list[ChunkKV], n_exact: int, e: int,
               policy: ReusePolicy) -> BlendPlan:
    """Lay the blended documents and the question out after row ``e``.

    Args:
        model: supplies dims, dtype, device and the RoPE tables.
        prompt: the request.
        blended: the documents to re-position (all but the exact first one).
        n_exact: documents already in the cache as an exact prefix (the first and the exact run after it).
        e: rows already in the cache.
        policy: the blend policy (its check layers and ratios).

    Returns:
        The plan of rows [e, T): each blended document's KV, its new positions and rotary tables, the
        token ids, and the check layers with their ratios (none under full reuse).

    Raises:
        ValueError: a blended document's K is already rotated (an EXACT entry holds one placement only).
    """
    dev = model.device
    q = prompt.question
    nq = len(q)
    if any(c.kv.rotated for c in blended):  # K after RoPE holds one placement only: never re-positioned
        raise ValueError("a blended document's KV must hold K before RoPE (an EXACT entry is loaded, not blended)")
    lens = [c.kv.num_tokens for c in blended]
    nb = sum(lens)
    starts = tuple(itertools.accumulate(lens[:-1], initial=0))  # each document's first row relative to e
    pos = torch.arange(e, e + nb + nq, device=dev)  # (n,)
    cos, sin = model.rope(pos)  # (n, R)
    forced = torch.zeros(nb, dtype=torch.bool)
    lo = 0
    for c, n_c in zip(blended, lens):
        if c.forced is not None:
            forced[lo + c.forced] = True
        lo += n_c
    ids = torch.tensor([t for doc in prompt.documents[n_exact:] for t in doc.token_ids] + list(q.token_ids),
                       dtype=torch.long, device=dev)  # (n,)
    checks = () if policy.full_reuse else tuple(
        CheckSpec(layer, i, policy.ratio_at(i)) for i, layer in enumerate(policy.check_layers))
    return BlendPlan(
        e=e, chunks=tuple(KVEntry(c.kv.k.to(dev), c.kv.v.to(dev)) for c in blended), starts=starts,
        pos=pos, cos=cos, sin=sin, ids=ids,
        doc=torch.cat([torch.full((n_c,), j, dtype=torch.long) for j, n_c in enumerate(lens)]),
        offset=torch.cat([torch.arange(n_c) for n_c in lens]),
        forced=forced, nb=nb, budget_base=sum(len(doc) for doc in prompt.documents), checks=checks,
    )


def pass_layers(model: ModelRunner, plan: BlendPlan, policy: ReusePolicy) -> list[LayerWeights] | None:
    """The weights a blended pass runs its layers on.

    Args:
        model: the model runner.
        plan: the pass's plan (its last check layer).
        policy: its policy (``linear_precision`` resolved).

    Returns:
        None (the engine's own weights) unless ``linear_precision`` asks for another dtype and the plan has
        a check layer: then the engine's layers up to its last check layer (every selection reads only
        those) and a copy in that dtype above it (:meth:`ModelRunner.layers_in`, made once per engine and
        dtype; the probe's bf16 copy).
    """
    dtype, last = recompute_dtype(policy.linear_precision, model.dtype), plan.last_check
    if dtype == model.dtype or last is None:
        return None
    return [*model.layers[: last + 1], *model.layers_in(dtype)[last + 1:]]
