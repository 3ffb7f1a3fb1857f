"""The connector's counters, through vLLM's connector-stats path to its Prometheus ``/metrics``.

The worker counts what it loads and saves (:class:`KVBlendStats`); vLLM ships
the stats to its logger process and hands them to :class:`KVBlendPromMetrics`,
which adds them to ``vllm:kvblend_*`` counters labelled per engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

# counter name -> help text; every value is a running sum
COUNTERS = {
    "exact_requests": "requests that loaded stored vLLM blocks through kvblend",
    "exact_tokens": "prompt tokens loaded from kvblend's store (exact, vLLM-computed KV)",
    "blend_requests": "requests blended by kvblend",
    "blend_reused_tokens": "document tokens whose KV kvblend reused (re-positioned)",
    "blend_recomputed_tokens": "document tokens kvblend recomputed in a blend",
    "load_errors": "claims that failed to load (their blocks recomputed by vLLM)",
    "saved_blocks": "whole prompt blocks saved to kvblend's store",
    "unsaved_after_load_error": "blocks not saved: computed in a step whose load failed before them",
}


@dataclass
class KVBlendStats(KVConnectorStats):
    """Sums of :data:`COUNTERS` over an interval (serialisable: a dict of numbers)."""

    data: dict[str, Any] = field(default_factory=dict)

    def add(self, name: str, value: float = 1) -> None:
        if name not in COUNTERS:
            raise KeyError(name)
        self.data[name] = self.data.get(name, 0) + value

    def count_load(self, exact: bool, report: dict, block_size: int) -> None:
        """Count one claim's load from its report.

        Args:
            exact: an exact claim (stored blocks), else a blend.
            report: what the load got (``loaded_blocks``, ``reused_tokens``, ``recomputed_tokens``, ``error``).
            block_size: vLLM's tokens per block.
        """
        if "error" in report:
            self.add("load_errors")
        if exact:
            self.add("exact_requests")
            self.add("exact_tokens", report.get("loaded_blocks", 0) * block_size)
        elif "error" not in report:
            self.add("blend_requests")
            self.add("blend_reused_tokens", report.get("reused_tokens", 0))
            self.add("blend_recomputed_tokens", report.get("recomputed_tokens", 0))

    def reset(self):
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "KVBlendStats":
        for k, v in (other.data or {}).items():
            if k in COUNTERS:
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: self.data.get(k, 0) for k in COUNTERS}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KVBlendPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvblend_<name>_total`` counters, one child per engine."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {
            name: create_metric_per_engine(
                self._counter_cls(name=f"vllm:kvblend_{name}", documentation=doc, labelnames=labelnames),
                per_engine_labelvalues)
            for name, doc in COUNTERS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for name, value in transfer_stats_data.items():
            if name in self.counters and value:
                self.counters[name][engine_idx].inc(value)
