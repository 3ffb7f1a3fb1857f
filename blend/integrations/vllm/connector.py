"""``KVBlendConnector``: kvblend's store and blend inside vLLM, through vLLM's v1 KV-connector seam.

Load it with::

    kv_transfer_config={"kv_connector": "KVBlendConnector",
                        "kv_connector_module_path": "blend.integrations.vllm",
                        "kv_role": "kv_both",
                        "kv_connector_extra_config": {"store": "redis://host:6379/0"}}

Scheduler side (:meth:`get_num_new_matched_tokens` ... :meth:`request_finished`):
decides what a request claims (:mod:`blend.integrations.vllm.plan`) and tells
the worker which blocks to fill and which to save. Worker side
(:meth:`start_load_kv`, :meth:`wait_for_save`): writes stored or blended KV into
the request's blocks before the forward, and saves vLLM's freshly computed
whole prompt blocks after it. A block that cannot be loaded (missing,
corrupt, wrong provenance, a blend that failed) is reported through
:meth:`get_block_ids_with_load_errors`, and vLLM recomputes it: nothing
unverified is ever injected. Blended KV is approximate: it is never saved.

What each blended request got comes back in its output's ``kv_transfer_params``
(``{"kvblend": {...report...}}``), carried worker -> scheduler by
:class:`KVBlendWorkerMeta`.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from blend.errors import KVBlendError
from blend.integrations.vllm.checks import kv_cache_refusal, skip_reason, unusable
from blend.integrations.vllm.engines import ConnectorConfig, SharedEngine, load_failure_policy, shared_engine
from blend.integrations.vllm.layout import BlockLayout, calibrate
from blend.integrations.vllm.metrics import KVBlendPromMetrics, KVBlendStats
from blend.integrations.vllm.plan import (
    BLEND_SALT_MARK, PARAMS_KEY, BlendParams, ClaimKind, blend_claim, block_keys, exact_claim, parse_blend_params,
    salt_allows_blend, tenant_salt,
)
from blend.keys import Namespace, StoreKey
from blend.kvcache import KVEntry
from blend.store.base import LookupStatus

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvblend.vllm")
_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


@dataclass(frozen=True)
class LoadSpec:
    """Fill blocks of one request before the forward."""

    req_id: str
    kind: ClaimKind
    token_ids: tuple[int, ...]  # the prompt
    block_ids: tuple[int, ...]  # the request's blocks, in order
    start: int  # first claimed token (block-aligned: vLLM's local prefix ends here)
    end: int  # one past the last claimed token (block-aligned)
    keys: tuple[StoreKey, ...] = ()  # exact: key of every block up to ``end``
    blend: BlendParams | None = None
    salt: str = ""  # blend: the request's tenant salt (kvblend's chunk keys)
    admission: int = 0  # which admission of the request claimed it (_ReqState.admission), echoed in the report


@dataclass(frozen=True)
class SaveSpec:
    """Blocks vLLM computed that are whole and not yet in the store."""

    req_id: str
    blocks: tuple[tuple[int, StoreKey], ...]  # (block id, key), in prompt order
    # the request's blocks before the first saved one: its KV attended over them (vLLM's prefix cache may
    # share them with another request, whose load of one may fail in this very step)
    context: tuple[int, ...] = ()


@dataclass
class KVBlendMeta(KVConnectorMetadata):
    """Scheduler -> worker, one step."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass
class KVBlendWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler, one step: what each loading request got, and for which of its admissions."""

    reports: dict[str, dict] = field(default_factory=dict)
    admissions: dict[str, int] = field(default_factory=dict)  # request id -> its LoadSpec.admission

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "KVConnectorWorkerMetadata":
        if isinstance(other, KVBlendWorkerMeta):
            self.reports.update(other.reports)
            self.admissions.update(other.admissions)
        return self


@dataclass
class _ReqState:
    """Scheduler-side bookkeeping of one request (owned by the scheduler connector)."""

    token_ids: tuple[int, ...]
    keys: list[StoreKey]  # every whole prompt block's key (under the request's cache salt)
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0  # prompt blocks [0, saved) are stored or claimed from the store
    blended: bool = False  # approximate KV in its blocks: never saved
    claim: tuple[ClaimKind, int, int] | None = None  # kind, start, end of a claim awaiting its load
    blend: BlendParams | None = None
    salt: str = ""  # the tenant salt of kvblend's own keys (plan.tenant_salt)
    # why its KV is not what the token ids alone give ('' if it is): then it neither loads nor saves
    skipped: str = ""
    report: dict = field(default_factory=dict)
    admission: int = 0  # admissions so far (a preemption's too): a load that reports late, under async
    # scheduling, after the request was admitted again, is of an earlier admission and does not report to it


class KVBlendConnector(KVConnectorBase_V1):
    """vLLM v1 KV connector over kvblend's store and blended prefill. See the module docstring."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        par = vllm_config.parallel_config
        if par.tensor_parallel_size > 1 or par.pipeline_parallel_size > 1:
            # each rank holds a shard of the heads or layers, and the store's keys name no rank: ranks would
            # save their shards under one key and load each other's
            raise KVBlendError(f"kvblend's connector runs without tensor or pipeline parallelism (got "
                               f"tp={par.tensor_parallel_size}, pp={par.pipeline_parallel_size})")
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.block_size = int(vllm_config.cache_config.block_size)
        self.cfg = ConnectorConfig.from_vllm(vllm_config, extra)
        # by default a store entry that fails its checks is a miss: vLLM recomputes its blocks instead of failing
        # the request (vLLM's default policy); its scheduler reads this after building us
        ktc = self._kv_transfer_config
        ktc.kv_load_failure_policy = load_failure_policy(self.cfg, ktc.kv_load_failure_policy)
        why = kv_cache_refusal(kv_cache_config) if kv_cache_config is not None else ""  # vLLM always passes one
        if why:
            raise KVBlendError(why)
        self.shared: SharedEngine = shared_engine(self.cfg, self.block_size)
        if role == KVConnectorRole.SCHEDULER:  # keep this process's worker reports for us
            self.shared.reports.attach_scheduler()
        self._reqs: dict[str, _ReqState] = {}  # scheduler side
        self._kv: list[torch.Tensor] = []  # worker side: each layer's paged cache, in layer order
        self._names: list[str] = []  # their layer names, same order
        self._layout: BlockLayout | None = None
        self._load_errors: set[int] = set()
        # blocks whose load failed in this step: the forward computes every later block of a request holding one
        # (the loading request's, or another's sharing it through vLLM's prefix cache) over unloaded KV, and
        # vLLM recomputes after the step, so those are never saved
        self._failed: set[int] = set()
        self._reports: dict[str, dict] = {}
        self._admissions: dict[str, int] = {}  # request id -> the admission its reported load was for
        self._stats = KVBlendStats()  # worker side: counters since vLLM last collected them

    # ---- scheduler side --------------------------------------------------------------------

    def _state(self, request: "Request") -> _ReqState:
        st = self._reqs.get(request.request_id)
        if st is None:
            toks = tuple(request.prompt_token_ids or ())
            salt = request.cache_salt or ""
            st = _ReqState(toks, block_keys(self.shared.vllm_prov, toks, self.block_size, salt),
                           skipped=skip_reason(request))
            self._reqs[request.request_id] = st
        return st

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        st = self._state(request)
        n = len(st.token_ids)
        st.claim = None
        # a fresh admission (the first, or after a preemption): its report says what this one gets, never what
        # an earlier load did (a load error there, fields a blend set), even one that reports later
        st.report = {}
        st.admission += 1
        self.shared.reports.take(request.request_id)
        if st.skipped:
            st.report = {"skipped": st.skipped}
            return 0, False
        try:
            st.blend = parse_blend_params(request.kv_transfer_params, n)
        except KVBlendError as e:  # a malformed blend request runs as a plain vLLM request
            st.blend, st.report = None, {"error": str(e)}
            log.warning("request %s: %s", request.request_id, e)
        if st.blend is not None and self.cfg.prefix_caching and not salt_allows_blend(request.cache_salt, st.blend,
                                                                                          st.token_ids):
            st.report = {"error": "blend refused: with vLLM's prefix cache on, a blended request needs the "
                                  "cache_salt of blend_salt() (approximate blocks must not enter the prefix cache)"}
            st.blend = None
        if st.blend is not None and self.shared.blend_refusal:  # vLLM runs another model config than kvblend
            st.report = {"error": self.shared.blend_refusal}
            st.blend = None
        if st.blend is not None or BLEND_SALT_MARK in (request.cache_salt or ""):
            # blended blocks (this step's claim, or vLLM's prefix cache under a blend salt): never saved
            st.blended = True
        if st.blend is not None:
            st.salt = tenant_salt(request.cache_salt, st.blend, st.token_ids)
            got = blend_claim(st.blend, num_computed_tokens, self.block_size)
            kind = ClaimKind.BLEND
        else:
            present = []
            for k in st.keys[num_computed_tokens // self.block_size:]:
                if not self.shared.store.contains(Namespace.EXACT, k):
                    break
                present.append(True)
            got = exact_claim([True] * (num_computed_tokens // self.block_size) + present, n, num_computed_tokens,
                              self.block_size)
            kind = ClaimKind.EXACT
        if got > 0:
            st.claim = (kind, num_computed_tokens, num_computed_tokens + got)
            st.report.update(claim=kind.value, claimed_tokens=got)
        return got, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        st = self._state(request)
        if num_external_tokens <= 0:
            st.claim = None
        elif st.claim is not None and st.claim[1] + num_external_tokens < st.claim[2]:
            # vLLM took fewer tokens than claimed (it may cut a claim to whole blocks): load only those, and say so
            kind, start, _ = st.claim
            st.claim = (kind, start, start + num_external_tokens)
            st.report["claimed_tokens"] = num_external_tokens

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = KVBlendMeta()
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue
            st.block_ids = list(new.block_ids[0])
            self._plan_step(new.req_id, st, new.num_computed_tokens,
                            scheduler_output.num_scheduled_tokens.get(new.req_id, 0), meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # after preemption: the whole block list again
                st.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                st.block_ids.extend(new_ids[0])
            self._plan_step(req_id, st, cached.num_computed_tokens[i],
                            scheduler_output.num_scheduled_tokens.get(req_id, 0), meta)
        return meta

    def _plan_step(self, req_id: str, st: _ReqState, num_computed: int, num_scheduled: int, meta: KVBlendMeta) -> None:
        """This step's load (a fresh claim) and saves (prompt blocks whole after this step) of a request."""
        b = self.block_size
        if st.claim is not None:
            kind, start, end = st.claim
            st.claim = None
            meta.loads.append(LoadSpec(req_id, kind, st.token_ids, tuple(st.block_ids), start, end,
                                       tuple(st.keys[: end // b]), st.blend, st.salt, st.admission))
            if kind is ClaimKind.BLEND:
                st.blended = True
            else:
                st.saved = max(st.saved, end // b)
        if st.blended or st.skipped:  # approximate KV, or not the token ids' own: never saved
            return
        if num_computed < st.saved * b:  # vLLM recomputes from here (a failed load): save those blocks again
            st.saved = num_computed // b
        whole = min(num_computed + num_scheduled, len(st.token_ids)) // b  # prompt blocks whole after this step
        todo = [(st.block_ids[i], st.keys[i]) for i in range(st.saved, min(whole, len(st.block_ids), len(st.keys)))]
        if todo:
            meta.saves.append(SaveSpec(req_id, tuple(todo), tuple(st.block_ids[: st.saved])))
            st.saved = whole

    def update_connector_output(self, connector_output: "KVConnectorOutput"):
        wm = connector_output.kv_connector_worker_meta
        if isinstance(wm, KVBlendWorkerMeta):
            for req_id, rep in wm.reports.items():
                admission = wm.admissions.get(req_id)
                self.shared.reports.discard(req_id, rep, admission)  # its in-process copy (a finished request's too)
                st = self._reqs.get(req_id)
                if st is not None and admission == st.admission:  # not a load of an earlier admission
                    st.report.update(rep)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        st = self._reqs.pop(request.request_id, None)
        if st is None:
            return False, None
        report = {**st.report, **self.shared.reports.take(request.request_id, st.admission)}
        return False, ({PARAMS_KEY: report} if report else None)

    # ---- worker side -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        def index(name: str) -> int:
            m = _LAYER_INDEX.search(name)
            if m is None:
                raise KVBlendError(f"cannot tell the layer index of KV cache {name!r}")
            return int(m.group(1))

        self._names = sorted(kv_caches, key=index)
        self._kv = [kv_caches[n] for n in self._names]
        for name, kv in zip(self._names, self._kv):  # (num_blocks, Hkv, B, 2D): block ids and keys count B tokens
            if kv.dim() != 4 or kv.shape[2] != self.block_size:
                raise KVBlendError(f"KV cache {name!r} has shape {tuple(kv.shape)}, not (blocks, heads, "
                                   f"{self.block_size}, 2 x head dim): vLLM's kernel blocks are not its blocks")
        layers = self.shared.engine.dims.num_layers
        if len(self._kv) != layers:
            raise KVBlendError(f"vLLM has {len(self._kv)} KV caches, kvblend's model {layers} layers: "
                               "not the same model")

    def _calibrate(self, forward_context: "ForwardContext") -> None:
        from vllm import _custom_ops as ops

        layer = forward_context.no_compile_layers[self._names[0]]
        _, h, b, two_d = self._kv[0].shape

        def writer(key: torch.Tensor, value: torch.Tensor, block: torch.Tensor) -> None:
            kc, vc = block.view(1, h, 2 * b, two_d // 2).chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(key, value, kc, vc, torch.arange(b), layer.isa)

        self._layout = calibrate(writer, h, b, two_d // 2)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVBlendMeta) or not (meta.loads or meta.saves):
            return
        if self._layout is None:  # once, before the first load or save
            self._calibrate(forward_context)
        for spec in meta.loads:
            t0 = time.perf_counter()
            try:
                rep = self._load_exact(spec) if spec.kind is ClaimKind.EXACT else self._load_blend(spec)
            except Exception as e:  # noqa: BLE001 - a failed load is recomputed by vLLM, never used
                log.warning("request %s: load failed (%s); vLLM recomputes its blocks", spec.req_id, e)
                self._fail(spec, spec.start)
                rep = {"error": f"load failed: {e}"}
            rep["load_s"] = round(time.perf_counter() - t0, 6)
            self._stats.count_load(spec.kind is ClaimKind.EXACT, rep, self.block_size)
            rep = {"claim": spec.kind.value, "claimed_tokens": spec.end - spec.start, **rep}
            # a scheduler in this process reads it before this step's output is built (a request may
            # finish in the step that loaded it); every scheduler gets it in the worker meta
            self.shared.reports.post(spec.req_id, rep, spec.admission)
            self._reports[spec.req_id], self._admissions[spec.req_id] = rep, spec.admission

    def _fail(self, spec: LoadSpec, from_token: int) -> None:
        b = self.block_size
        failed = spec.block_ids[from_token // b: -(-spec.end // b)]
        self._load_errors.update(failed)
        self._failed.update(failed)

    def _load_exact(self, spec: LoadSpec) -> dict:
        b = self.block_size
        prov = self.shared.vllm_prov_json
        want = (len(self._kv), self._kv[0].shape[1], b, self._kv[0].shape[3] // 2)  # (L, Hkv, B, D)
        entries: list[KVEntry] = []
        rep: dict = {}
        for i in range(spec.start // b, spec.end // b):
            got = self.shared.store.get(Namespace.EXACT, spec.keys[i], prov)
            why = unusable(got, want)
            if why:  # never injected: this block and the rest of the claim are recomputed by vLLM
                if got.status is not LookupStatus.MISS:  # drop the bad entry: the recomputed block replaces it
                    self.shared.store.delete(Namespace.EXACT, spec.keys[i])
                self._fail(spec, i * b)
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
            if not bool(torch.isfinite(k).all() and torch.isfinite(v).all()):  # never injected: vLLM recomputes
                raise KVBlendError(f"non-finite values in the blended KV of layer {layer}")
            return k, v

        self._write(spec.block_ids, spec.start, spec.end, rows)  # the last block may be partial
        return report

    def _write(self, block_ids: tuple[int, ...], start: int, end: int, rows) -> None:
        """Token rows [start, end) of a request into its blocks, one scatter per layer.
        ``rows(layer)``: that layer's K (after RoPE) and V of those rows, (Hkv, end - start, D) each."""
        assert self._layout is not None
        offs = self._layout.offsets(torch.tensor(block_ids, dtype=torch.long), start, end, self._kv[0][0].numel())
        for layer, kv in enumerate(self._kv):
            self._layout.scatter(kv, offs, *rows(layer))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole blocks are read back after the forward, in wait_for_save

    def wait_for_save(self):
        failed, self._failed = self._failed, set()
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        if not isinstance(meta, KVBlendMeta) or not meta.saves or self._layout is None:
            return
        store, prov = self.shared.store, self.shared.vllm_prov_json
        for spec in meta.saves:
            over_hole = not failed.isdisjoint(spec.context)
            for block, key in spec.blocks:
                over_hole = over_hole or block in failed
                if over_hole:  # computed over (or in) a block that failed to load: vLLM recomputes it
                    self._stats.add("unsaved_after_load_error")
                    continue
                if store.contains(Namespace.EXACT, key):
                    continue
                ks, vs = zip(*(self._layout.read(kv, block) for kv in self._kv))  # gathered: fresh tensors
                store.put(Namespace.EXACT, key, KVEntry(torch.stack(ks), torch.stack(vs), prov))  # (L, Hkv, B, D)
                self._stats.add("saved_blocks")

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def get_kv_connector_stats(self) -> KVBlendStats | None:
        if self._stats.is_empty():
            return None
        out, self._stats = self._stats, KVBlendStats()
        return out

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVBlendStats:
        return KVBlendStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> KVBlendPromMetrics:
        return KVBlendPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if not self._reports:
            return None
        out, self._reports, self._admissions = KVBlendWorkerMeta(self._reports, self._admissions), {}, {}
        return out
