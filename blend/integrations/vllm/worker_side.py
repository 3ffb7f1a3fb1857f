"""The connector's worker side: stored or blended KV into vLLM's paged blocks before the forward, and vLLM's
freshly computed whole prompt blocks into kvblend's store after it.

:class:`WorkerSide` owns the worker's view of vLLM's KV caches (one tensor per
layer, the block layout learnt from vLLM's own cache writer), the blocks that
failed to load in the step, the step's load reports and the counters vLLM
collects as connector stats. Nothing unverified is injected: a block that
cannot be loaded is reported as a load error and vLLM recomputes it.
"""

from __future__ import annotations

import logging
import re
import time
from typing import TYPE_CHECKING, Any, Callable

import torch

from blend.errors import KVBlendError
from blend.integrations.vllm.checks import unusable
from blend.integrations.vllm.engines import SharedEngine
from blend.integrations.vllm.layout import BlockLayout, calibrate
from blend.integrations.vllm.metrics import KVBlendStats
from blend.integrations.vllm.plan import ClaimKind
from blend.integrations.vllm.step_meta import KVBlendMeta, KVBlendWorkerMeta, LoadSpec
from blend.keys import Namespace
from blend.kvcache import KVEntry
from blend.store.base import LookupStatus
from blend.store.codec import all_finite

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext

log = logging.getLogger("kvblend.vllm")
_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")

# rows(layer) -> that layer's K (after RoPE) and V of the rows being written, (Hkv, T, D) each
RowSource = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


class WorkerSide:
    """The worker's half of the connector.

    Args:
        shared: this process's kvblend engine and store.
        block_size: vLLM's tokens per block.
    """

    def __init__(self, shared: SharedEngine, block_size: int) -> None:
        self.shared = shared
        self.block_size = block_size
        self.kv: list[torch.Tensor] = []  # each layer's paged cache, in layer order
        self.names: list[str] = []  # their layer names, same order
        self.layout: BlockLayout | None = None
        self._load_errors: set[int] = set()
        # blocks whose load failed in this step: the forward computes every later block of a request holding one
        # (the loading request's, or another's sharing it through vLLM's prefix cache) over unloaded KV, and
        # vLLM recomputes after the step, so those are never saved
        self._failed: set[int] = set()
        self._reports: dict[str, dict] = {}
        self._admissions: dict[str, int] = {}  # request id -> the admission its reported load was for
        self.stats = KVBlendStats()  # counters since vLLM last collected them

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """vLLM's paged caches, one per layer (``model.layers.<i>....`` names).

        Raises:
            KVBlendError: a cache whose blocks are not the scheduler's blocks, or not one per model layer.
        """
        def index(name: str) -> int:
            m = _LAYER_INDEX.search(name)
            if m is None:
                raise KVBlendError(f"cannot tell the layer index of KV cache {name!r}")
            return int(m.group(1))

        self.names = sorted(kv_caches, key=index)
        self.kv = [kv_caches[n] for n in self.names]
        for name, kv in zip(self.names, self.kv):  # (num_blocks, Hkv, B, 2D): block ids and keys count B tokens
            if kv.dim() != 4 or kv.shape[2] != self.block_size:
                raise KVBlendError(f"KV cache {name!r} has shape {tuple(kv.shape)}, not (blocks, heads, "
                                   f"{self.block_size}, 2 x head dim): vLLM's kernel blocks are not its blocks")
        layers = self.shared.engine.dims.num_layers
        if len(self.kv) != layers:
            raise KVBlendError(f"vLLM has {len(self.kv)} KV caches, kvblend's model {layers} layers: "
                               "not the same model")

    def _calibrate(self, forward_context: "ForwardContext") -> None:
        from vllm import _custom_ops as ops

        layer = forward_context.no_compile_layers[self.names[0]]
        _, h, b, two_d = self.kv[0].shape

        def writer(key: torch.Tensor, value: torch.Tensor, block: torch.Tensor) -> None:
            kc, vc = block.view(1, h, 2 * b, two_d // 2).chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(key, value, kc, vc, torch.arange(b), layer.isa)

        self.layout = calibrate(writer, h, b, two_d // 2)

    def start_load_kv(self, meta: Any, forward_context: "ForwardContext") -> None:
        """Fill the step's claimed blocks before the forward (``meta``: the step's :class:`KVBlendMeta`)."""
        if not isinstance(meta, KVBlendMeta) or not (meta.loads or meta.saves):
            return
        if self.layout is None:  # once, before the first load or save
            self._calibrate(forward_context)
        for spec in meta.loads:
            t0 = time.perf_counter()
            try:
                rep = self._load_exact(spec) if spec.kind is ClaimKind.EXACT else self._load_blend(spec)
            except Exception as e:  # noqa: BLE001 - a failed load is recomputed by vLLM, never used
                log.warning("request %s: load failed (%s); vLLM recomputes its blocks", spec.req_id, e)
                self.fail(spec, spec.start)
                rep = {"error": f"load failed: {e}"}
            rep["load_s"] = round(time.perf_counter() - t0, 6)
            self.stats.count_load(spec.kind is ClaimKind.EXACT, rep, self.block_size)
            rep = {"claim": spec.kind.value, "claimed_tokens": spec.end - spec.start, **rep}
            # to the scheduler in the step's worker metadata, wherever it runs (scheduler_side's docstring)
            self._reports[spec.req_id], self._admissions[spec.req_id] = rep, spec.admission

    def fail(self, spec: LoadSpec, from_token: int) -> None:
        """The claim's blocks from ``from_token`` on failed to load: vLLM recomputes them, and nothing computed
        over them in this step is saved."""
        b = self.block_size
        failed = spec.block_ids[from_token // b: -(-spec.end // b)]
        self._load_errors.update(failed)
        self._failed.update(failed)

    def _load_exact(self, spec: LoadSpec) -> dict:
        b = self.block_size
        prov = self.shared.vllm_prov_json
        want = (len(self.kv), self.kv[0].shape[1], b, self.kv[0].shape[3] // 2)  # (L, Hkv, B, D)
        entries: list[KVEntry] = []
        rep: dict = {}
        for i in range(spec.start // b, spec.end // b):
            got = self.shared.store.get(Namespace.EXACT, spec.keys[i], prov)
            why = unusable(got, want)
            if why:  # never injected: this block and the rest of the claim are recomputed by vLLM
                if got.status is not LookupStatus.MISS:  # drop the bad entry: the recomputed block replaces it
                    self.shared.store.delete(Namespace.EXACT, spec.keys[i])
                self.fail(spec, i * b)
                rep["error"] = f"block {i}: {why}"
                break
            entries.append(got.entry)
        if entries:  # the good run before any bad block
            end = spec.start + len(entries) * b
            self._write(spec.block_ids, spec.start, end,
                        lambda layer: (torch.cat([e.k[layer] for e in entries], dim=1),  # (Hkv, T, D)
                                       torch.cat([e.v[layer] for e in entries], dim=1)))
        return {"loaded_blocks": len(entries), **rep}

    def _load_blend(self, spec: LoadSpec) -> dict:
        assert spec.blend is not None
        cache, report = self.shared.blend(spec.token_ids, spec.blend, spec.salt)  # rows [0, question start), all layers

        def rows(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
            k, v = cache.view(layer, spec.end)  # (Hkv, end, D) K after RoPE
            k, v = k[:, spec.start:], v[:, spec.start:]  # (Hkv, end - start, D)
            if not (all_finite(k) and all_finite(v)):  # never injected: vLLM recomputes
                raise KVBlendError(f"non-finite values in the blended KV of layer {layer}")
            return k, v

        self._write(spec.block_ids, spec.start, spec.end, rows)  # the last block may be partial
        return report

    def _write(self, block_ids: tuple[int, ...], start: int, end: int, rows: RowSource) -> None:
        """Token rows [start, end) of a request into its blocks, one scatter per layer."""
        assert self.layout is not None
        offs = self.layout.offsets(torch.tensor(block_ids, dtype=torch.long), start, end, self.kv[0][0].numel())
        for layer, kv in enumerate(self.kv):
            self.layout.scatter(kv, offs, *rows(layer))

    def wait_for_save(self, meta: Any) -> None:
        """Save the step's whole prompt blocks (``meta``: the step's :class:`KVBlendMeta`, or None) after the
        forward, except those computed over a block that failed to load."""
        failed, self._failed = self._failed, set()
        if not isinstance(meta, KVBlendMeta) or not meta.saves or self.layout is None:
            return
        store, prov = self.shared.store, self.shared.vllm_prov_json
        for spec in meta.saves:
            over_hole = not failed.isdisjoint(spec.context)
            for block, key in spec.blocks:
                over_hole = over_hole or block in failed
                if over_hole:  # computed over (or in) a block that failed to load: vLLM recomputes it
                    self.stats.add("unsaved_after_load_error")
                    continue
                if store.contains(Namespace.EXACT, key):
                    continue
                ks, vs = zip(*(self.layout.read(kv, block) for kv in self.kv))  # gathered: fresh tensors
                store.put(Namespace.EXACT, key, KVEntry(torch.stack(ks), torch.stack(vs), prov))  # (L, Hkv, B, D)
                self.stats.add("saved_blocks")

    def take_load_errors(self) -> set[int]:
        """Blocks that failed to load since the last call (vLLM recomputes them)."""
        out, self._load_errors = self._load_errors, set()
        return out

    def take_stats(self) -> KVBlendStats | None:
        """The counters since the last call (None if nothing was counted)."""
        if self.stats.is_empty():
            return None
        out, self.stats = self.stats, KVBlendStats()
        return out

    def take_worker_meta(self) -> KVBlendWorkerMeta | None:
        """The step's load reports for the scheduler (None if nothing loaded)."""
        if not self._reports:
            return None
        out, self._reports, self._admissions = KVBlendWorkerMeta(self._reports, self._admissions), {}, {}
        return out
