"""``KVBlendConnector``: kvblend's store and blend inside vLLM, through vLLM's v1 KV-connector seam.

Load it with::

    kv_transfer_config={"kv_connector": "KVBlendConnector",
                        "kv_connector_module_path": "blend.integrations.vllm",
                        "kv_role": "kv_both",
                        "kv_connector_extra_config": {"store": "redis://host:6379/0"}}

Scheduler side (:meth:`get_num_new_matched_tokens` ... :meth:`request_finished`,
:class:`~blend.integrations.vllm.scheduler_side.SchedulerSide`): decides what a
request claims (:mod:`blend.integrations.vllm.plan`) and tells the worker which
blocks to fill and which to save. Worker side (:meth:`start_load_kv`,
:meth:`wait_for_save`, :class:`~blend.integrations.vllm.worker_side.WorkerSide`):
writes stored or blended KV into the request's blocks before the forward, and
saves vLLM's freshly computed whole prompt blocks after it. A block that cannot
be loaded (missing, corrupt, wrong provenance, a blend that failed) is reported
through :meth:`get_block_ids_with_load_errors`, and vLLM recomputes it: nothing
unverified is ever injected. Blended KV is approximate: it is never saved.

What each blended request got comes back in its output's ``kv_transfer_params``
(``{"kvblend": {...report...}}``), carried worker -> scheduler by
:class:`~blend.integrations.vllm.step_meta.KVBlendWorkerMeta`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from blend.errors import KVBlendError
from blend.integrations.vllm.checks import kv_cache_refusal
from blend.integrations.vllm.engines import ConnectorConfig, SharedEngine, load_failure_policy, shared_engine
from blend.integrations.vllm.metrics import KVBlendPromMetrics, KVBlendStats
from blend.integrations.vllm.scheduler_side import SchedulerSide
from blend.integrations.vllm.step_meta import KVBlendMeta, KVBlendWorkerMeta, LoadSpec, SaveSpec
from blend.integrations.vllm.worker_side import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KVBlendConnector", "KVBlendMeta", "KVBlendWorkerMeta", "LoadSpec", "SaveSpec"]


class KVBlendConnector(KVConnectorBase_V1):
    """vLLM v1 KV connector over kvblend's store and blended prefill. See the module docstring.

    Attributes:
        scheduler: the scheduler's half (what requests claim; the step's loads and saves; reports).
        worker: the worker's half (vLLM's caches; loads, saves, load errors, stats).
    """

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
        self.scheduler = SchedulerSide(self.cfg, self.shared, self.block_size)
        self.worker = WorkerSide(self.shared, self.block_size)

    # ---- scheduler side --------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        self.scheduler.update_state_after_alloc(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: "KVConnectorOutput"):
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request)

    # ---- worker side -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        self.worker.start_load_kv(self._get_connector_metadata(), forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole blocks are read back after the forward, in wait_for_save

    def wait_for_save(self):
        self.worker.wait_for_save(self._get_connector_metadata() if self.has_connector_metadata() else None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors()

    def get_kv_connector_stats(self) -> KVBlendStats | None:
        return self.worker.take_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVBlendStats:
        return KVBlendStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> KVBlendPromMetrics:
        return KVBlendPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker.take_worker_meta()
