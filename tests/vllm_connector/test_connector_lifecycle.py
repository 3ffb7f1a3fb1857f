"""KVBlendConnector's scheduler and worker sides over fake vLLM steps (vLLM imported, no model run).

The connector is built by its own ``__init__`` from a minimal vLLM config, with kvblend's engine replaced by
:class:`FakeShared` (a memory store and the provenance of vLLM's blocks), so each test drives the calls vLLM
makes (lookup, allocation, metadata, load, save, finish) in seconds.
"""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec,
)

from blend.errors import InvalidRequestError, KVBlendError  # noqa: E402
from blend.integrations.vllm import connector as connector_module  # noqa: E402
from blend.integrations.vllm.connector import KVBlendConnector, KVBlendMeta, LoadSpec  # noqa: E402
from blend.integrations.vllm.engines import ConnectorConfig, OnLoadError, parse_extra_config  # noqa: E402
from blend.integrations.vllm.layout import standard_layout  # noqa: E402
from blend.integrations.vllm.plan import (  # noqa: E402
    PARAMS_KEY, ClaimKind, block_keys, blend_request, vllm_provenance,
)
from blend.integrations.vllm.scheduler_side import WORKER_REPORT_KEY, WORKER_REPORT_MISSING  # noqa: E402
from blend.keys import Namespace, Provenance  # noqa: E402
from blend.kvcache import KVEntry  # noqa: E402
from blend.store.memory import MemoryStore  # noqa: E402
from _scheduler_steps import scheduler_step  # noqa: E402

B = 4  # tokens per block
BLOCKS = 16  # blocks in the fake paged cache
PROV = vllm_provenance(Provenance("llama:x", "w", "t", "float32", "float32", "cpu", "kvblend-layers", "{}"),
                       "vllm-test/cpu", B, "float32")


class FakeShared:
    """What the connector reads of :class:`~blend.integrations.vllm.engines.SharedEngine` (one layer, one head,
    head dim 1); ``blend`` answers with :attr:`blend_rows` (L, Hkv, T, D) for K and V."""

    def __init__(self) -> None:
        self.vllm_prov, self.vllm_prov_json = PROV, PROV.canonical_json()
        self.store = MemoryStore()
        self.engine = SimpleNamespace(dims=SimpleNamespace(num_layers=1))
        self.blend_refusal = ""
        self.blend_rows: torch.Tensor | None = None

    def blend(self, token_ids, params, salt=""):
        rows = self.blend_rows
        cache = SimpleNamespace(view=lambda layer, end: (rows[layer][:, :end], rows[layer][:, :end]))
        return cache, {"reused_tokens": 0, "recomputed_tokens": 0}


LAYER = "model.layers.0.self_attn.attn"


def _group(spec=None, layers=(LAYER,)) -> KVCacheGroupSpec:
    return KVCacheGroupSpec(list(layers), spec or FullAttentionSpec(block_size=B, num_kv_heads=1, head_size=1,
                                                                    dtype=torch.float32))


def _connector(role, shared, groups=None, load_failure_policy="fail", on_load_error="recompute"):
    """The connector built by its own ``__init__`` over ``shared``, with vLLM's KV cache config of ``groups``
    (one full-attention group by default) and the given load-failure settings."""
    cfg = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
                          cache_config=SimpleNamespace(block_size=B),
                          kv_transfer_config=SimpleNamespace(kv_connector_extra_config={"on_load_error": on_load_error},
                                                             kv_load_failure_policy=load_failure_policy))
    kv_cache_config = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups or [_group()])
    c = KVBlendConnector(cfg, role, kv_cache_config)
    c.register_kv_caches({LAYER: torch.zeros(BLOCKS, 1, B, 2)})
    c.worker.layout = standard_layout(1, B, 1)  # what calibrating vLLM's CPU writer gives for this shape
    return c


def _fake_kvblend(monkeypatch, engines) -> None:
    """Connectors built from now on take kvblend's side from ``engines()`` (a fake per call), and ConnectorConfig
    from the extra config alone."""
    monkeypatch.setattr(connector_module, "shared_engine", lambda cfg, block_size: engines())
    monkeypatch.setattr(connector_module.ConnectorConfig, "from_vllm", classmethod(
        lambda cls, vllm_config, extra: ConnectorConfig(
            model="m", dtype="float32", backend="test", prefix_caching=False,
            recompute_on_load_error=parse_extra_config(extra).on_load_error is OnLoadError.RECOMPUTE)))


@pytest.fixture
def shared(monkeypatch):
    """kvblend's side of the connector (fake), one per process: every connector built in the test shares it."""
    fake = FakeShared()
    _fake_kvblend(monkeypatch, lambda: fake)
    return fake


@pytest.fixture
def conn(shared):
    """One connector playing both roles (as in one process), over a fake (1 layer, 1 head, B, 2) paged cache."""
    return _connector(KVConnectorRole.SCHEDULER, shared)


def _request(req_id, ids, params=None, **extra):
    fields = dict(request_id=req_id, prompt_token_ids=list(ids), cache_salt=None, kv_transfer_params=params,
                  lora_request=None, prompt_embeds=None, mm_features=None)
    return SimpleNamespace(**{**fields, **extra})


def _store(shared: FakeShared, key, value: float = 1.0) -> None:
    rows = torch.full((1, 1, B, 1), value)  # (L, Hkv, B, D)
    shared.store.put(Namespace.EXACT, key, KVEntry(rows, rows.clone(), shared.vllm_prov_json))


def _admit(c, req, num_computed: int = 0) -> int:
    """vLLM's lookup and allocation of a waiting request: the tokens it loads."""
    got, _ = c.get_num_new_matched_tokens(req, num_computed)
    c.update_state_after_alloc(req, None, got)
    return got


def _run(c, meta) -> None:
    """One worker step: loads before the forward, saves after it (as vLLM's runner calls them)."""
    c.bind_connector_metadata(meta)
    c.start_load_kv(None)
    c.wait_for_save()
    c.clear_connector_metadata()


def _worker_output(c) -> SimpleNamespace:
    return SimpleNamespace(kv_connector_worker_meta=c.build_connector_worker_meta())


def test_a_block_computed_over_another_requests_failed_load_is_not_saved(conn):
    """vLLM's prefix cache shares A's claimed blocks with B in the same step. A's load of them fails, so B's forward
    attends over a hole (vLLM recomputes B after the step): B's blocks of that step were saved as exact KV, and
    every later request loaded that wrong KV from the store, as a hit."""
    prefix = list(range(100, 108))  # two blocks, stored
    keys = block_keys(PROV, prefix, B)
    _store(conn.shared, keys[0])
    _store(conn.shared, keys[1], float("nan"))  # fails its check at load time
    a, b = _request("a", prefix + [7]), _request("b", prefix + list(range(200, 209)))
    assert _admit(conn, a) == 8
    assert _admit(conn, b, 8) == 0  # b's local prefix: a's blocks 1 and 2 (vLLM's prefix cache)
    meta = conn.build_connector_meta(scheduler_step(new=[("a", [1, 2, 3], 8), ("b", [1, 2, 5, 6, 7], 8)],
                                           scheduled={"a": 1, "b": 9}))
    (save,) = meta.saves  # b's whole blocks, its local prefix's too (stored ones are skipped)
    assert [blk for blk, _ in save.blocks] == [1, 2, 5, 6]
    _run(conn, meta)
    assert conn.get_block_ids_with_load_errors() == {2}
    b_keys = block_keys(PROV, b.prompt_token_ids, B)
    assert not any(conn.shared.store.contains(Namespace.EXACT, k) for k in b_keys[2:])
    # vLLM recomputes from the failed block: the next step saves b's blocks, now computed over a's real KV
    meta = conn.build_connector_meta(scheduler_step(cached=[("a", None, 4, False), ("b", None, 8, False)],
                                           scheduled={"a": 5, "b": 9}))
    _run(conn, meta)
    assert all(conn.shared.store.contains(Namespace.EXACT, k) for k in b_keys)


@pytest.mark.parametrize("extra", [{"prompt_embeds": torch.zeros(9, 8)},
                                   {"mm_features": [SimpleNamespace(identifier="image-1")]}])
def test_requests_whose_kv_is_not_their_token_ids_own_neither_claim_nor_save(conn, extra):
    """The store's keys name token ids only: prompt embeddings (or a mixed prompt's embedded rows) and media
    behind placeholder ids give other KV for the same ids. Such a request loaded the blocks of plain requests with
    those ids, and saved its own under their keys."""
    ids = list(range(300, 309))
    for key in block_keys(PROV, ids, B):
        _store(conn.shared, key)
    plain = _request("plain", ids)
    assert _admit(conn, plain) == 8  # a plain request claims the stored blocks
    req = _request("embeds", ids, **extra)
    assert _admit(conn, req) == 0
    fresh = list(range(400, 409))  # nothing stored for these ids: it would have saved them
    other = _request("other", fresh, **extra)
    assert _admit(conn, other) == 0
    meta = conn.build_connector_meta(scheduler_step(new=[("embeds", [1, 2, 3], 0), ("other", [4, 5, 6], 0)],
                                           scheduled={"embeds": 9, "other": 9}))
    assert not meta.loads and not meta.saves
    assert "neither loads nor saves" in conn.request_finished(req, [])[1][PARAMS_KEY]["skipped"]


def test_a_claim_vllm_cuts_short_loads_and_reports_only_what_vllm_took(conn):
    """vLLM may take fewer external tokens than claimed (it cuts a claim to whole blocks under bounded replay): the
    connector loaded and reported the whole claim, past what vLLM counts as computed."""
    ids = list(range(500, 513))
    for key in block_keys(PROV, ids, B):
        _store(conn.shared, key)
    req = _request("cut", ids)
    got, _ = conn.get_num_new_matched_tokens(req, 0)
    assert got == 12
    conn.update_state_after_alloc(req, None, 8)  # vLLM took two blocks of three
    meta = conn.build_connector_meta(scheduler_step(new=[("cut", [1, 2, 3, 4], 8)], scheduled={"cut": 5}))
    (load,) = meta.loads
    assert (load.start, load.end) == (0, 8)
    assert [blk for blk, _ in meta.saves[0].blocks] == [3]  # the third block is vLLM's to compute, then stored
    _run(conn, meta)
    conn.update_connector_output(_worker_output(conn))
    rep = conn.request_finished(req, [])[1][PARAMS_KEY]
    assert rep["claimed_tokens"] == 8 and rep["loaded_blocks"] == 2


@pytest.mark.parametrize("blend", [False, True], ids=["exact", "blend"])
def test_a_claim_vllm_declines_is_not_reported_as_claimed(conn, blend):
    """vLLM may take none of a claim (it skips external KV for a request with prompt_logprobs, and a local partial
    block reaching as far as the claim wins): nothing was loaded, yet the report said "claim": "exact" (or "blend")
    with every claimed token. It now says how many tokens vLLM declined, and claims nothing."""
    ids = list(range(550, 570))
    for key in block_keys(PROV, ids, B):
        _store(conn.shared, key)
    conn.shared.blend_rows = torch.ones(1, 1, 10, 1)  # (L, Hkv, T, D)
    req = _request("declined", ids, blend_request(ids, [(2, 6), (6, 10)], ratio=0.15) if blend else None)
    got, _ = conn.get_num_new_matched_tokens(req, 0)
    assert got == (10 if blend else 16)
    conn.update_state_after_alloc(req, None, 0)  # vLLM: ext_tokens = 0
    meta = conn.build_connector_meta(scheduler_step(new=[("declined", [1, 2, 3, 4, 5], 0)], scheduled={"declined": 20}))
    assert not meta.loads
    _run(conn, meta)
    conn.update_connector_output(_worker_output(conn))
    assert conn.request_finished(req, [])[1][PARAMS_KEY] == {"declined_tokens": got}


def test_non_finite_blended_kv_is_never_injected(conn):
    """A blend whose KV holds a NaN (a non-finite chunk in the store, an overflow) was written into vLLM's blocks
    unchecked; stored blocks were checked. Now the claim is a load error and vLLM recomputes it."""
    ids = list(range(600, 620))
    params = blend_request(ids, [(2, 6), (6, 10)], ratio=0.15)  # the question starts at 10
    rows = torch.ones(1, 1, 10, 1)  # (L, Hkv, T, D)
    rows[0, 0, 7, 0] = float("nan")
    conn.shared.blend_rows = rows
    req = _request("nan", ids, params)
    assert _admit(conn, req) == 10
    meta = conn.build_connector_meta(scheduler_step(new=[("nan", [1, 2, 3, 4, 5], 10)], scheduled={"nan": 10}))
    _run(conn, meta)
    assert conn.get_block_ids_with_load_errors() == {1, 2, 3}  # the blocks of rows 0..9
    assert not torch.isnan(conn.worker.kv[0]).any()
    conn.update_connector_output(_worker_output(conn))
    assert "non-finite" in conn.request_finished(req, [])[1][PARAMS_KEY]["error"]


def test_a_readmitted_request_reports_its_last_load_not_an_earlier_error(conn):
    """A request whose first load failed at a bad block, then preempted and admitted again with a clean load,
    finished with the first load's error beside the second's counts."""
    ids = list(range(700, 709))
    keys = block_keys(PROV, ids, B)
    _store(conn.shared, keys[0])
    _store(conn.shared, keys[1], float("nan"))
    req = _request("again", ids)
    assert _admit(conn, req) == 8
    _run(conn, conn.build_connector_meta(scheduler_step(new=[("again", [1, 2, 3], 8)], scheduled={"again": 1})))
    assert conn.get_block_ids_with_load_errors() == {2}
    conn.update_connector_output(_worker_output(conn))
    _store(conn.shared, keys[1])  # vLLM recomputed block 1 and it was stored again
    assert _admit(conn, req) == 8  # preempted, admitted again
    _run(conn, conn.build_connector_meta(scheduler_step(cached=[("again", [7, 8, 9], 8, True)], scheduled={"again": 1})))
    assert conn.get_block_ids_with_load_errors() == set()
    conn.update_connector_output(_worker_output(conn))
    rep = conn.request_finished(req, [])[1][PARAMS_KEY]
    assert rep["loaded_blocks"] == 2 and "error" not in rep


def test_a_blend_under_another_model_config_runs_plain(conn):
    """vLLM runs its model config with hf_overrides applied (e.g. another RoPE theta); kvblend's engine runs
    config.json as it is on disk, so its blended KV is of another model: the blend is refused, the request plain."""
    ids = list(range(800, 820))
    conn.shared.blend_refusal = "blend refused: vLLM runs another model config"
    req = _request("overridden", ids, blend_request(ids, [(2, 6), (6, 10)], ratio=0.15))
    assert _admit(conn, req) == 0
    meta = conn.build_connector_meta(scheduler_step(new=[("overridden", [1, 2, 3, 4, 5], 0)], scheduled={"overridden": 20}))
    assert not meta.loads and meta.saves  # a plain request: vLLM computes it, its blocks are stored
    assert "another model config" in conn.request_finished(req, [])[1][PARAMS_KEY]["error"]


def test_kv_caches_whose_blocks_are_not_the_schedulers_blocks_are_refused(conn):
    """vLLM may split its blocks into smaller kernel blocks (the tensor's block dimension): the connector's block
    ids and keys count the scheduler's block size, so every load and save would land in the wrong rows."""
    with pytest.raises(KVBlendError, match="kernel blocks"):
        conn.register_kv_caches({LAYER: torch.zeros(2 * BLOCKS, 1, B // 2, 2)})


def test_on_load_error_fail_beside_vllms_recompute_policy_is_refused_at_start_up(shared):
    """``"on_load_error": "fail"`` left vLLM's kv_load_failure_policy as given, so beside an explicit "recompute"
    (vLLM's default is "fail") a block that failed to load was recomputed: the setting did not do what it says."""
    with pytest.raises(InvalidRequestError, match="on_load_error.*fail.*kv_load_failure_policy.*recompute"):
        _connector(KVConnectorRole.SCHEDULER, shared, load_failure_policy="recompute", on_load_error="fail")
    assert _connector(KVConnectorRole.SCHEDULER, shared, on_load_error="fail")._kv_transfer_config \
        .kv_load_failure_policy == "fail"
    assert _connector(KVConnectorRole.SCHEDULER, shared)._kv_transfer_config.kv_load_failure_policy == "recompute"


@pytest.mark.parametrize("groups", [
    [_group(), _group(SlidingWindowSpec(block_size=B, num_kv_heads=1, head_size=1, dtype=torch.float32,
                                        sliding_window=8), ["model.layers.1.self_attn.attn"])],
    [_group(SlidingWindowSpec(block_size=B, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=8))],
], ids=["hybrid", "sliding-window"])
def test_kv_caches_of_several_groups_or_a_sliding_window_are_refused_at_start_up(shared, groups):
    """Each KV cache group has its own block table; the connector read and wrote every layer through the first
    group's block ids, and a sliding-window group swaps blocks that left the window for vLLM's null block: loads
    and saves landed in other requests' blocks. The connector now refuses such a cache when vLLM builds it."""
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(KVBlendError, match="one KV cache group of full attention, vLLM has"):
            _connector(role, shared, groups)


def _stored_load(shared, req_id: str, ids: list[int]) -> KVBlendMeta:
    """A step that loads the two stored blocks of ``ids`` into blocks 1 and 2 (as a scheduler elsewhere sends)."""
    keys = block_keys(PROV, ids, B)
    for key in keys:
        _store(shared, key)
    return KVBlendMeta(loads=[LoadSpec(req_id, ClaimKind.EXACT, tuple(ids), (1, 2, 3), 0, 8, tuple(keys[:2]))])


def test_the_report_of_a_request_that_ends_in_its_load_step_is_completed_before_its_output_leaves(conn):
    """vLLM finishes a request that stops in the step that loaded it (one token) before it hands the scheduler that
    step's worker metadata: the report it got back from request_finished is completed in place by that step's
    update_connector_output, which vLLM calls before it sends the step's outputs. A request aborted before its load
    ran is finished with the mark that the worker's part is missing (vLLM sends an aborted request no report)."""
    ids = list(range(1000, 1009))
    for key in block_keys(PROV, ids, B):
        _store(conn.shared, key)
    one, aborted = _request("one-token", ids), _request("aborted", ids)
    assert _admit(conn, one) == 8 and _admit(conn, aborted) == 8
    meta = conn.build_connector_meta(scheduler_step(new=[("one-token", [1, 2, 3], 0), ("aborted", [4, 5, 6], 0)],
                                           scheduled={"one-token": 9, "aborted": 9}))
    gone = conn.request_finished(aborted, [])[1][PARAMS_KEY]
    assert gone == {"claim": "exact", "claimed_tokens": 8, WORKER_REPORT_KEY: WORKER_REPORT_MISSING}
    _run(conn, meta)
    sent = conn.request_finished(one, [])[1][PARAMS_KEY]  # finished in its load step: what vLLM puts in its output
    assert sent[WORKER_REPORT_KEY] == WORKER_REPORT_MISSING
    conn.update_connector_output(_worker_output(conn))  # the step's output comes after both finished
    assert sent["loaded_blocks"] == 2 and "load_s" in sent and WORKER_REPORT_KEY not in sent


def _readmitted_before_its_load_ran(conn, req_id: str, ids: list[int]):
    """Async scheduling: ``req_id`` is admitted (its second block stored corrupt) and scheduled, then preempted and
    admitted again before the worker ran that first step. Returns the request and both steps' metadata."""
    keys = block_keys(PROV, ids, B)
    _store(conn.shared, keys[0])
    _store(conn.shared, keys[1], float("nan"))
    req = _request(req_id, ids)
    assert _admit(conn, req) == 8
    first = conn.build_connector_meta(scheduler_step(new=[(req_id, [1, 2, 3], 8)], scheduled={req_id: 1}))
    assert _admit(conn, req) == 8  # preempted and admitted again: the scheduler runs a step ahead of the worker
    second = conn.build_connector_meta(scheduler_step(cached=[(req_id, [7, 8, 9], 8, True)], scheduled={req_id: 1}))
    assert [s.admission for s in first.loads + second.loads] == [1, 2]
    return req, first, second


def test_a_load_report_of_an_earlier_admission_arriving_late_is_dropped(conn):
    """Under async scheduling a step's output arrives after the scheduler planned the next step: a request preempted
    and admitted again in between had its first admission's load report (a load error) merged into the report of
    the second, whose load was clean."""
    req, first, second = _readmitted_before_its_load_ran(conn, "late", list(range(1100, 1109)))
    _run(conn, first)  # the first admission's load: block 1 is corrupt
    assert conn.get_block_ids_with_load_errors() == {2}
    first_out = _worker_output(conn)
    assert first_out.kv_connector_worker_meta.admissions == {"late": 1}
    assert "error" in first_out.kv_connector_worker_meta.reports["late"]
    _store(conn.shared, block_keys(PROV, req.prompt_token_ids, B)[1])  # vLLM recomputed the block; it was stored
    _run(conn, second)
    assert conn.get_block_ids_with_load_errors() == set()
    second_out = _worker_output(conn)
    conn.update_connector_output(first_out)  # arrives after the second admission was planned
    conn.update_connector_output(second_out)
    rep = conn.request_finished(req, [])[1][PARAMS_KEY]
    assert rep["loaded_blocks"] == 2 and "error" not in rep and WORKER_REPORT_KEY not in rep


def test_a_request_ended_after_readmission_takes_no_report_of_its_earlier_admission(conn):
    """A request aborted after it was admitted again (before its second load ran) took the report the first
    admission's load posted after the re-admission: its load error. Its report says only what the second admission
    claimed, and that the worker's part of it never came."""
    req, first, _ = _readmitted_before_its_load_ran(conn, "aborted-again", list(range(1200, 1209)))
    _run(conn, first)  # the first admission's load: its block 1 is corrupt
    first_out = _worker_output(conn)
    rep = conn.request_finished(req, [])[1][PARAMS_KEY]
    conn.update_connector_output(first_out)
    assert rep == {"claim": "exact", "claimed_tokens": 8, WORKER_REPORT_KEY: WORKER_REPORT_MISSING}


def _across(obj):
    """``obj`` as the other process gets it: vLLM's executor sends the scheduler's output to a worker process, and
    the worker's output back, pickled."""
    return pickle.loads(pickle.dumps(obj))


def test_a_one_step_request_gets_the_workers_report_with_the_worker_in_another_process(monkeypatch):
    """With vLLM's worker in a process of its own (``--distributed-executor-backend mp``), a request that finished in
    the step that loaded it (one token) got the scheduler's half of its report only: the worker's half reached the
    scheduler's process in the step's worker metadata after vLLM had finished the request, and an in-process box
    carried it only where both sides share a process. The scheduler now completes the report it handed vLLM when
    that metadata comes, before vLLM sends the step's outputs."""
    from vllm.v1.outputs import KVConnectorOutput

    scheduler_process, worker_process = FakeShared(), FakeShared()  # a kvblend engine in each process ...
    worker_process.store = scheduler_process.store  # ... over one store they share (disk or Redis)
    engines = iter([scheduler_process, worker_process])
    _fake_kvblend(monkeypatch, lambda: next(engines))
    scheduler = _connector(KVConnectorRole.SCHEDULER, scheduler_process)
    worker = _connector(KVConnectorRole.WORKER, worker_process)
    exact_ids, blend_ids = list(range(1300, 1309)), list(range(1400, 1420))
    for key in block_keys(PROV, exact_ids, B):
        _store(scheduler_process, key)
    worker_process.blend_rows = torch.ones(1, 1, 10, 1)  # (L, Hkv, T, D): the blend's KV before the question
    exact = _request("exact", exact_ids)
    blend = _request("blend", blend_ids, blend_request(blend_ids, [(2, 6), (6, 10)], ratio=0.15))
    assert _admit(scheduler, exact) == 8 and _admit(scheduler, blend) == 10
    meta = scheduler.build_connector_meta(scheduler_step(new=[("exact", [1, 2, 3], 8), ("blend", [4, 5, 6, 7, 8], 10)],
                                                         scheduled={"exact": 1, "blend": 10}))
    _run(worker, _across(meta))
    output = _across(KVConnectorOutput(kv_connector_worker_meta=worker.build_connector_worker_meta()))
    # vLLM's update_from_output: both stop at their first token and are finished, then the step's connector output
    # is handed over, then the outputs (holding the reports request_finished returned) leave
    sent = {r.request_id: scheduler.request_finished(r, [])[1][PARAMS_KEY] for r in (exact, blend)}
    scheduler.update_connector_output(output)
    assert sent["exact"]["claim"] == "exact" and sent["exact"]["loaded_blocks"] == 2 and "load_s" in sent["exact"]
    assert sent["blend"]["claim"] == "blend" and sent["blend"]["reused_tokens"] == 0 and "load_s" in sent["blend"]
    assert not any(WORKER_REPORT_KEY in rep or "error" in rep for rep in sent.values())
    assert _across(sent) == sent  # what leaves for the client


def test_a_report_whose_workers_part_did_not_come_in_time_says_so(monkeypatch):
    """A finished request whose load report is not in the step's worker metadata (its load ran in a later step)
    was sent with the scheduler's half only, silently; it says the worker's part is missing, and a later report is
    not written into it (vLLM has sent it by then)."""
    fake = FakeShared()
    _fake_kvblend(monkeypatch, lambda: fake)
    c = _connector(KVConnectorRole.SCHEDULER, fake)
    ids = list(range(1500, 1509))
    for key in block_keys(PROV, ids, B):
        _store(fake, key)
    req = _request("late", ids)
    assert _admit(c, req) == 8
    meta = c.build_connector_meta(scheduler_step(new=[("late", [1, 2, 3], 8)], scheduled={"late": 1}))
    sent = c.request_finished(req, [])[1][PARAMS_KEY]
    c.update_connector_output(SimpleNamespace(kv_connector_worker_meta=None))  # a step that loaded nothing
    _run(c, meta)
    c.update_connector_output(_worker_output(c))
    assert sent == {"claim": "exact", "claimed_tokens": 8, WORKER_REPORT_KEY: WORKER_REPORT_MISSING}
