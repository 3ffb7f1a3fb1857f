"""The connector's scheduler side: what each request claims, and which blocks the worker fills and saves.

:class:`SchedulerSide` keeps one :class:`RequestState` per request vLLM's
scheduler knows, from its first lookup to ``request_finished``, and answers
the scheduler's calls of :class:`~blend.integrations.vllm.connector.KVBlendConnector`
(its decisions are :mod:`blend.integrations.vllm.plan`'s pure functions).

**How a request's report reaches its output.** The scheduler side writes what
it decided (``claim``, ``claimed_tokens``, a refusal); the worker adds what its
load got (``loaded_blocks``, ``load_s``, a blend's counts, classes and timings,
a load error) in the step's :class:`~blend.integrations.vllm.step_meta.KVBlendWorkerMeta`,
vLLM's one worker -> scheduler channel, which works alike whether the worker
runs in the scheduler's process or in its own. A request that stops in the step
that loaded it (one token) is finished, and its ``kv_transfer_params`` are put
into that step's output, *before* vLLM hands the scheduler the step's worker
metadata: vLLM's ``Scheduler.update_from_output`` finishes stopped requests,
then calls ``update_connector_output``, and only then sends the outputs. So
:meth:`SchedulerSide.request_finished` hands vLLM the report of such a request
marked :data:`WORKER_REPORT_KEY` = :data:`WORKER_REPORT_MISSING`, keeps it, and
:meth:`SchedulerSide.update_connector_output` completes that same dict (and
drops the mark) in the same call, before the output leaves. A report whose
worker part did not come in that call keeps the mark: never silently partial.
No vLLM import at module level beyond the step metadata's base classes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from blend.errors import KVBlendError
from blend.integrations.vllm.checks import skip_reason
from blend.integrations.vllm.engines import ConnectorConfig, SharedEngine
from blend.integrations.vllm.plan import (
    BLEND_SALT_MARK, PARAMS_KEY, BlendParams, ClaimKind, blend_claim, block_keys, exact_claim, parse_blend_params,
    salt_allows_blend, tenant_salt,
)
from blend.integrations.vllm.step_meta import KVBlendMeta, KVBlendWorkerMeta, LoadSpec, SaveSpec
from blend.keys import Namespace, StoreKey

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvblend.vllm")

# a report handed to vLLM before the worker's part of it arrived carries this key until that part comes
WORKER_REPORT_KEY = "worker_report"
WORKER_REPORT_MISSING = ("missing: the worker's report of this request's load (loaded_blocks, load_s, a blend's "
                         "counts, a load error) did not reach the scheduler before the request's output was sent")


@dataclass
class RequestState:
    """Scheduler-side bookkeeping of one request (owned by :class:`SchedulerSide`)."""

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
    loading: bool = False  # a load of this admission was sent to the worker and its report has not come yet


class SchedulerSide:
    """The scheduler's half of the connector.

    Args:
        cfg: the connector's config (``prefix_caching`` is read).
        shared: this process's kvblend engine and store.
        block_size: vLLM's tokens per block.
    """

    def __init__(self, cfg: ConnectorConfig, shared: SharedEngine, block_size: int) -> None:
        self.cfg = cfg
        self.shared = shared
        self.block_size = block_size
        self.requests: dict[str, RequestState] = {}
        # finished requests whose load report is still to come: request id -> (its admission, the report dict
        # vLLM holds in the output being built); completed or given up by the next update_connector_output
        self._awaiting: dict[str, tuple[int, dict]] = {}

    def _state(self, request: "Request") -> RequestState:
        st = self.requests.get(request.request_id)
        if st is None:
            toks = tuple(request.prompt_token_ids or ())
            salt = request.cache_salt or ""
            st = RequestState(toks, block_keys(self.shared.vllm_prov, toks, self.block_size, salt),
                              skipped=skip_reason(request))
            self.requests[request.request_id] = st
        return st

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens a request (being admitted) loads after vLLM's local prefix, and never asynchronously.

        Args:
            request: vLLM's request.
            num_computed_tokens: its local prefix (block-aligned).

        Returns:
            (tokens claimed, False).
        """
        st = self._state(request)
        n = len(st.token_ids)
        st.claim = None
        # a fresh admission (the first, or after a preemption): its report says what this one gets, never what
        # an earlier load did (a load error there, fields a blend set), even one that reports later
        st.report = {}
        st.admission += 1
        st.loading = False
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

    def update_state_after_alloc(self, request: "Request", num_external_tokens: int) -> None:
        """vLLM allocated the request's blocks and took ``num_external_tokens`` of its claim."""
        st = self._state(request)
        if num_external_tokens <= 0:
            if st.claim is not None:  # vLLM took none of it (a request with prompt_logprobs skips external KV,
                # a local partial block reaching as far): nothing is loaded, so the report claims nothing
                _, start, end = st.claim
                for k in ("claim", "claimed_tokens"):
                    st.report.pop(k, None)
                st.report["declined_tokens"] = end - start
            st.claim = None
        elif st.claim is not None and st.claim[1] + num_external_tokens < st.claim[2]:
            # vLLM took fewer tokens than claimed (it may cut a claim to whole blocks): load only those, and say so
            kind, start, _ = st.claim
            st.claim = (kind, start, start + num_external_tokens)
            st.report["claimed_tokens"] = num_external_tokens

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVBlendMeta:
        """The step's loads and saves, from vLLM's scheduler output."""
        # a report still awaited now belongs to a request that ended between steps (aborted: vLLM sends it nowhere)
        self._awaiting.clear()
        meta = KVBlendMeta()
        for new in scheduler_output.scheduled_new_reqs:
            st = self.requests.get(new.req_id)
            if st is None:
                continue
            st.block_ids = list(new.block_ids[0])
            self._plan_step(new.req_id, st, new.num_computed_tokens,
                            scheduler_output.num_scheduled_tokens.get(new.req_id, 0), meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self.requests.get(req_id)
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

    def _plan_step(self, req_id: str, st: RequestState, num_computed: int, num_scheduled: int,
                   meta: KVBlendMeta) -> None:
        """This step's load (a fresh claim) and saves (prompt blocks whole after this step) of a request."""
        b = self.block_size
        if st.claim is not None:
            kind, start, end = st.claim
            st.claim = None
            meta.loads.append(LoadSpec(req_id, kind, st.token_ids, tuple(st.block_ids), start, end,
                                       tuple(st.keys[: end // b]), st.blend, st.salt, st.admission))
            st.loading = True
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

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        """The step's worker reports, into the reports of the requests (and admissions) they are for, a finished
        request's included: its report is in the output vLLM is building (see the module docstring)."""
        wm = connector_output.kv_connector_worker_meta
        if isinstance(wm, KVBlendWorkerMeta):
            for req_id, rep in wm.reports.items():
                admission = wm.admissions.get(req_id)
                st = self.requests.get(req_id)
                if st is not None:
                    if admission == st.admission:  # not a load of an earlier admission
                        st.report.update(rep)
                        st.loading = False
                    continue
                awaited = self._awaiting.get(req_id)
                if awaited is not None and awaited[0] == admission:
                    del self._awaiting[req_id]
                    awaited[1].pop(WORKER_REPORT_KEY, None)
                    awaited[1].update(rep)
        # what did not come in this call would reach a report already sent: those stay marked missing
        self._awaiting.clear()

    def request_finished(self, request: "Request") -> tuple[bool, dict[str, Any] | None]:
        """Forget a finished request; its report goes out in its ``kv_transfer_params``.

        Returns:
            (False: its blocks are freed at once, ``{"kvblend": report}`` or None where there is nothing to say).
            A report whose load is not reported yet is marked :data:`WORKER_REPORT_KEY` and completed by the
            step's :meth:`update_connector_output`.
        """
        st = self.requests.pop(request.request_id, None)
        if st is None:
            return False, None
        report = dict(st.report)
        if st.loading:
            report[WORKER_REPORT_KEY] = WORKER_REPORT_MISSING
            self._awaiting[request.request_id] = (st.admission, report)
        return False, ({PARAMS_KEY: report} if report else None)
