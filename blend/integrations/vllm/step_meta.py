"""What crosses between the connector's two sides each step (pickled by vLLM where they are processes apart).

Scheduler -> worker: :class:`KVBlendMeta` (which blocks to fill before the
forward, :class:`LoadSpec`, and which to save after it, :class:`SaveSpec`).
Worker -> scheduler: :class:`KVBlendWorkerMeta`, the step's load reports, in
the step's ``KVConnectorOutput``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from blend.integrations.vllm.plan import BlendParams, ClaimKind
from blend.keys import StoreKey


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
    admission: int = 0  # which admission of the request claimed it (RequestState.admission), echoed in the report


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
