"""The vLLM connector's pure parts: claims, keys, request parameters, block layout (no vLLM needed)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from blend.errors import InvalidRequestError
from blend.integrations.vllm.layout import LayoutError, calibrate, standard_layout
from blend.integrations.vllm.plan import (
    PARAMS_KEY, blend_claim, blend_request, blend_salt, block_keys, exact_claim, parse_blend_params, prompt_spans,
    salt_allows_blend,
    vllm_provenance,
)
from blend.keys import Provenance, exact_chain

PROV = Provenance("llama:x", "w", "t", "float32", "float32", "cpu", "kvblend-layers", "{}")


def test_exact_claims_whole_stored_blocks_after_the_local_prefix_and_leave_a_token():
    b = 4
    assert exact_claim([True, True, False, True], 20, 0, b) == 8  # stops at the first miss
    assert exact_claim([True, True, True], 12, 0, b) == 8  # 12 tokens: the last block holds the last token
    assert exact_claim([True, True, True], 13, 0, b) == 12
    assert exact_claim([True, True, True], 13, 8, b) == 4  # vLLM already holds two blocks
    assert exact_claim([True, True], 13, 8, b) == 0
    assert exact_claim([], 3, 0, b) == 0


def test_blend_claims_every_row_before_the_question():
    p = parse_blend_params(blend_request(list(range(40)), [(5, 12), (12, 30)]), 40)
    assert p.question_start == 30
    assert blend_claim(p, 0, 8) == 30 and blend_claim(p, 16, 8) == 14 and blend_claim(p, 32, 8) == 0


def test_a_blend_needs_its_own_salt_beside_vllms_prefix_cache():
    """The salt commits to the policy and the whole prompt: blended blocks (question-dependent) are
    reused by vLLM's prefix cache only for the same prompt under the same policy."""
    ids = list(range(40))
    params = blend_request(ids, [(5, 12), (12, 30)], ratio=0.15, selector="probe")
    p = parse_blend_params(params, 40)
    assert salt_allows_blend(blend_salt(params, ids), p, ids)
    assert salt_allows_blend(blend_salt(params, ids, "tenant-a"), p, ids)
    assert blend_salt(params, ids, "a") != blend_salt(params, ids, "b")
    assert not salt_allows_blend(None, p, ids) and not salt_allows_blend("tenant-a", p, ids)
    other = parse_blend_params(blend_request(ids, [(5, 12), (12, 30)], ratio=0.3), 40)
    assert not salt_allows_blend(blend_salt(params, ids), other, ids)  # another ratio: other KV, other salt
    question = ids[:30] + [7] * 10  # same documents, another question
    assert not salt_allows_blend(blend_salt(params, ids), p, question)
    whole = blend_request(ids, [(5, 12), (12, 30)], ratio=1)  # an int ratio salts as the connector reads it
    assert salt_allows_blend(blend_salt(whole, ids), parse_blend_params(whole, 40), ids)
    for guard in (0.7, 0.5):  # the near-tie guard changes which KV a near tie gets: another salt
        unguarded = parse_blend_params(blend_request(ids, [(5, 12), (12, 30)], ratio=0.15, guard_margin=guard), 40)
        assert not salt_allows_blend(blend_salt(params, ids), unguarded, ids)
    near = blend_request(ids, [(5, 12), (12, 30)], guard_margin=0.7)
    nearer = parse_blend_params(blend_request(ids, [(5, 12), (12, 30)], guard_margin=0.70000001), 40)
    assert not salt_allows_blend(blend_salt(near, ids), nearer, ids)  # every digit of the margin
    recut = parse_blend_params(blend_request(ids, [(5, 20), (20, 30)], ratio=0.15, selector="probe"), 40)
    assert not salt_allows_blend(blend_salt(params, ids), recut, ids)  # the same tokens, other documents


def test_the_near_tie_guard_is_opt_in_inside_vllm():
    spans = [[5, 12], [12, 30]]
    assert parse_blend_params({PARAMS_KEY: {"documents": spans}}, 40).guard_margin is None
    assert parse_blend_params({PARAMS_KEY: {"documents": spans, "guard_margin": None}}, 40).guard_margin is None
    assert parse_blend_params({PARAMS_KEY: {"documents": spans, "guard_margin": 2}}, 40).guard_margin == 2.0
    assert parse_blend_params(blend_request(list(range(40)), spans, guard_margin=0.7), 40).guard_margin == 0.7


def test_a_blend_may_name_its_recompute_precisions_and_they_salt_its_blocks():
    """The opt-in bf16 arithmetic for the recomputed rows (blend.policy.RecomputePrecision) reaches the
    connector's blend; blocks made with it never share vLLM's prefix cache with fp32 ones, and a blend
    that names none keeps the salt it had before the fields."""
    from blend.policy import RecomputePrecision

    ids, spans = list(range(40)), [(5, 12), (12, 30)]
    plain = blend_request(ids, spans)
    assert "attention_precision" not in plain[PARAMS_KEY] and "linear_precision" not in plain[PARAMS_KEY]
    p = parse_blend_params(plain, 40)
    assert p.attention_precision is p.linear_precision is RecomputePrecision.COMPUTE and p.precision_tag == ""
    fast = blend_request(ids, spans, attention_precision="bf16", linear_precision="auto")
    q = parse_blend_params(fast, 40)
    assert (q.attention_precision, q.linear_precision) == (RecomputePrecision.BF16, RecomputePrecision.AUTO)
    assert salt_allows_blend(blend_salt(fast, ids), q, ids)
    assert not salt_allows_blend(blend_salt(plain, ids), q, ids)
    assert not salt_allows_blend(blend_salt(fast, ids), p, ids)
    attn_only = parse_blend_params(blend_request(ids, spans, attention_precision="bf16"), 40)
    assert not salt_allows_blend(blend_salt(fast, ids), attn_only, ids)  # each field salts
    named = parse_blend_params({PARAMS_KEY: {"documents": [list(s) for s in spans], "attention_precision": "compute",
                                             "linear_precision": "compute"}}, 40)
    assert salt_allows_blend(blend_salt(plain, ids), named, ids)  # the defaults named: the same blocks
    null = parse_blend_params({PARAMS_KEY: {"documents": [list(s) for s in spans], "attention_precision": None}}, 40)
    assert null.attention_precision is RecomputePrecision.COMPUTE  # null: not named, as in kvblend serve
    as_enum = blend_request(ids, spans, attention_precision=RecomputePrecision.BF16, linear_precision="auto")
    assert as_enum == fast


@pytest.mark.parametrize("field", ["attention_precision", "linear_precision"])
@pytest.mark.parametrize("value", ["fp16", "BF16", "", "bf16:x|y", 1, True, ["bf16"], {"bf16": 1}])
def test_a_recompute_precision_outside_its_names_is_refused(field, value):
    with pytest.raises(InvalidRequestError, match=field):
        parse_blend_params({PARAMS_KEY: {"documents": [[1, 3]], field: value}}, 10)


def test_vllm_kv_never_aliases_kvblend_kv():
    """Same tokens, same weights: a vLLM-computed block and a kvblend segment get different keys,
    and any field of the vLLM record (backend, block size, dtype) changes every key."""
    toks = list(range(16))
    vp = vllm_provenance(PROV, "vllm-0.32.0/cpu", 8, "float32")
    assert vp.digest() != PROV.digest() and "k-after-rope" in vp.backend
    keys = block_keys(vp, toks, 8)
    assert len(keys) == 2 and keys[0] == exact_chain(vp, [toks[:8]])[0]
    assert set(keys).isdisjoint(exact_chain(PROV, [toks[:8], toks[8:]]))
    for other in (vllm_provenance(PROV, "vllm-0.33.0/cpu", 8, "float32"),
                  vllm_provenance(PROV, "vllm-0.32.0/cpu", 16, "float32"),
                  vllm_provenance(PROV, "vllm-0.32.0/cpu", 8, "bfloat16"),
                  vllm_provenance(dataclasses.replace(PROV, weights_sha256="w2"), "vllm-0.32.0/cpu", 8, "float32")):
        assert block_keys(other, toks, 8)[0] != keys[0]
    assert block_keys(vp, toks, 8, salt="tenant")[0] != keys[0]
    assert block_keys(vp, toks[:7], 8) == []  # no whole block


@pytest.mark.parametrize("bad", [
    {PARAMS_KEY: []},
    {PARAMS_KEY: {"ratio": 1.5, "documents": [[1, 3]]}},
    {PARAMS_KEY: {"ratio": True, "documents": [[1, 3]]}},
    {PARAMS_KEY: {"selector": "nope", "documents": [[1, 3]]}},
    {PARAMS_KEY: {"documents": []}},
    {PARAMS_KEY: {"documents": [[0, 3]]}},  # no preamble
    {PARAMS_KEY: {"documents": [[1, 3], [4, 6]]}},  # a gap
    {PARAMS_KEY: {"documents": [[3, 3]]}},
    {PARAMS_KEY: {"documents": [[1, 10]]}},  # no question
    {PARAMS_KEY: {"documents": [["1", 3]]}},
    {PARAMS_KEY: {"documents": [[1, 3, 5]]}},
    {PARAMS_KEY: {"guard_margin": -0.1, "documents": [[1, 3]]}},
    {PARAMS_KEY: {"guard_margin": "0.7", "documents": [[1, 3]]}},
    {PARAMS_KEY: {"guard_margin": True, "documents": [[1, 3]]}},
    {PARAMS_KEY: {"guard_margin": float("nan"), "documents": [[1, 3]]}},
    {PARAMS_KEY: {"mode": "blnd", "documents": [[1, 3]]}},  # a typo ran as exact reuse
    {PARAMS_KEY: {"mode": "none"}},
    {PARAMS_KEY: {"ratoi": 0.9, "documents": [[1, 3]]}},  # a misspelt option ran at the default ratio
])
def test_malformed_blend_params_are_rejected(bad):
    with pytest.raises(InvalidRequestError):
        parse_blend_params(bad, 10)


def test_requests_without_a_blend_entry_are_plain():
    assert parse_blend_params(None, 10) is None
    assert parse_blend_params({"other": 1}, 10) is None
    assert parse_blend_params({PARAMS_KEY: {"mode": "exact"}}, 10) is None


def test_prompt_spans_follow_segment_lengths():
    assert prompt_spans([3, 4, 5, 2]) == [(3, 7), (7, 12)]
    with pytest.raises(InvalidRequestError):
        prompt_spans([3, 2])


def _fake_writer(k_transposed: bool):
    """A cache writer like vLLM's CPU kernel: per (block, head) slab, K (or K^T) then V."""
    def write(key, value, block):  # key/value (B, H, D), block (1, H, B, 2D)
        _, h, b, two_d = block.shape
        d = two_d // 2
        slab = block.view(1, h, 2 * b * d)
        k = key.transpose(0, 1)  # (H, B, D)
        slab[0, :, : b * d] = (k.transpose(1, 2) if k_transposed else k).reshape(h, -1)
        slab[0, :, b * d:] = value.transpose(0, 1).reshape(h, -1)
    return write


@pytest.mark.parametrize("k_transposed", [False, True])
def test_the_layout_is_learnt_from_the_writer_and_round_trips(k_transposed):
    h, b, d = 3, 8, 4
    layout = calibrate(_fake_writer(k_transposed), h, b, d)
    if not k_transposed:
        std = standard_layout(h, b, d)
        assert torch.equal(layout.k_index, std.k_index) and torch.equal(layout.v_index, std.v_index)
    cache = torch.zeros(5, h, b, 2 * d)
    k, v = torch.randn(h, b, d), torch.randn(h, b, d)
    layout.scatter(cache, layout.offsets(torch.tensor([3]), 0, b, cache[0].numel()), k, v)  # one whole block
    rk, rv = layout.read(cache, 3)
    assert torch.equal(rk, k) and torch.equal(rv, v)
    assert float(cache[[0, 1, 2, 4]].abs().sum()) == 0  # other blocks untouched
    # the writer's own placement of the same rows equals ours
    ref = torch.zeros(1, h, b, 2 * d)
    _fake_writer(k_transposed)(k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous(), ref)
    assert torch.equal(ref[0], cache[3])
    part = torch.zeros(1, h, b, 2 * d)
    layout.scatter(part, layout.offsets(torch.tensor([0]), 2, 5, part[0].numel()), k[:, 2:5], v[:, 2:5])  # rows 2-4
    assert torch.equal(layout.read(part, 0, slice(2, 5))[0], k[:, 2:5])


def test_a_writer_that_is_not_a_permutation_is_refused():
    def lossy(key, value, block):
        block.zero_()
        block[0, :, :, 0] = 1.0

    with pytest.raises(LayoutError):
        calibrate(lossy, 2, 4, 2)


def test_offsets_scatter_a_request_over_its_blocks_as_the_backend_writer_would():
    h, b, d = 2, 4, 3
    writer = _fake_writer(True)
    layout = calibrate(writer, h, b, d)
    blocks = torch.tensor([3, 0, 5])
    k, v = torch.randn(h, 11, d), torch.randn(h, 11, d)  # rows 1..11 of a request: partial first and last block
    one = torch.zeros(6, h, b, 2 * d)
    layout.scatter(one, layout.offsets(blocks, 1, 12, one[0].numel()), k, v)
    want = torch.zeros(6, h, b, 2 * d)
    full_k, full_v = torch.zeros(h, 12, d), torch.zeros(h, 12, d)  # token rows 0..11, row 0 unwritten (zeros)
    full_k[:, 1:], full_v[:, 1:] = k, v
    for j, blk in enumerate(blocks.tolist()):  # the backend's writer, one whole block at a time
        rows = slice(j * b, (j + 1) * b)
        writer(full_k[:, rows].transpose(0, 1).contiguous(), full_v[:, rows].transpose(0, 1).contiguous(),
               want[blk:blk + 1])
    assert torch.equal(one, want)


def test_the_tenant_part_of_a_blend_salt_salts_kvblends_own_keys():
    """A blend's cache_salt is ``tenant|<blend suffix>``: the suffix commits to the whole prompt (vLLM's
    prefix cache), so kvblend's chunk keys take the tenant alone; any other salt is the tenant itself."""
    from blend.integrations.vllm.plan import tenant_salt

    ids = list(range(40))
    params = blend_request(ids, [(5, 12), (12, 30)])
    p = parse_blend_params(params, 40)
    assert tenant_salt(blend_salt(params, ids, "tenant-a"), p, ids) == "tenant-a"
    assert tenant_salt(blend_salt(params, ids), p, ids) == ""
    assert tenant_salt(blend_salt(params, ids, "a|b"), p, ids) == "a|b"
    assert tenant_salt("tenant-a", p, ids) == "tenant-a"  # prefix cache off: any salt is the tenant's
    assert tenant_salt(None, p, ids) == tenant_salt("", p, ids) == ""
    other = list(range(1, 41))  # another prompt's blend suffix is not stripped: a salt of its own
    assert tenant_salt(blend_salt(params, ids, "t"), p, other) == blend_salt(params, ids, "t")


def test_connector_blends_of_tenants_with_different_salts_share_no_chunk_kv():
    """The connector's blend keys kvblend's canonical chunks under the request's tenant salt, as its exact
    blocks are keyed: a second tenant blending the same documents computes them (no cross-tenant hit)."""
    from blend.engine import Engine
    from blend.integrations.vllm.engines import ConnectorConfig, SharedEngine
    from blend.integrations.vllm.plan import tenant_salt
    from blend.report import ReuseClass
    from blend.tiny import make_docs

    shared = SharedEngine(ConnectorConfig(model="tiny-llama", dtype="float32", backend="test", force=True), 4)
    prompt = Engine.build_prompt(shared.engine, "Which one?", make_docs(3, words=12))
    ids = list(prompt.token_ids)
    params = blend_request(ids, prompt_spans([len(s) for s in prompt.segments]), guard_margin=None)
    p = parse_blend_params(params, len(ids))

    def doc_classes(tenant: str) -> list[ReuseClass]:
        salt = tenant_salt(blend_salt(params, ids, tenant), p, ids)
        _, report = shared.blend(ids, p, salt)
        return [ReuseClass(c) for c in report["classes"][2:-1]]  # documents after the first (canonical chunks)

    assert doc_classes("tenant-a") == [ReuseClass.COMPUTED, ReuseClass.COMPUTED]
    assert doc_classes("tenant-b") == [ReuseClass.COMPUTED, ReuseClass.COMPUTED]  # was BLENDED: tenant a's KV
    assert doc_classes("tenant-a") == [ReuseClass.BLENDED, ReuseClass.BLENDED]  # a tenant still reuses its own


def test_vllm_settings_that_change_kv_change_the_blocks_backend_digest():
    """hf_overrides (e.g. rope_theta) reach the model vLLM runs but not the config.json kvblend reads: the
    blocks' keys missed them (4.27 off on a hit). The digest covers vLLM's model config as it runs, its
    load, attention, compilation and kernel configs."""
    from types import SimpleNamespace

    from blend.integrations.vllm.engines import vllm_numerics

    def config(theta=10000.0, backend="FLASH_ATTN", load="auto"):
        hashed = lambda v: SimpleNamespace(compute_hash=lambda: v)  # noqa: E731
        hf = SimpleNamespace(to_json_string=lambda use_diff=False: f'{{"rope_theta": {theta}}}')
        return SimpleNamespace(model_config=SimpleNamespace(compute_hash=lambda: "m", hf_config=hf),
                               load_config=hashed(load), attention_config=hashed(backend),
                               compilation_config=hashed("c"), kernel_config=None)

    base = vllm_numerics(config())
    assert base == vllm_numerics(config()) and len(base) == 16
    assert len({base, vllm_numerics(config(theta=50000.0)), vllm_numerics(config(backend="TRITON_ATTN")),
                vllm_numerics(config(load="dummy"))}) == 4


@pytest.mark.parametrize("extra, field", [
    ({"on_load_error": "recompte"}, "on_load_error"),  # was read as "fail": recompute silently off
    ({"force": "false"}, "force"),  # bool("false") is True: the quality gate silently skipped
    ({"stor": "disk:/x"}, "stor"),  # a misspelt key: the store silently in memory
    ({"memory_budget_bytes": "1GB"}, "memory_budget_bytes"),
    ({"memory_budget_bytes": True}, "memory_budget_bytes"),
    ({"store": 3}, "store"),
])
def test_the_connectors_extra_config_is_checked_strictly(extra, field):
    from blend.integrations.vllm.engines import parse_extra_config

    with pytest.raises(InvalidRequestError, match=field):
        parse_extra_config(extra)


def test_the_connectors_extra_config_defaults_and_values():
    from blend.integrations.vllm.engines import ExtraConfig, OnLoadError, parse_extra_config

    assert parse_extra_config({}) == ExtraConfig()
    assert parse_extra_config({}).on_load_error is OnLoadError.RECOMPUTE
    got = parse_extra_config({"store": "disk:/kv", "force": True, "on_load_error": "fail",
                              "memory_budget_bytes": 1 << 20})
    assert got == ExtraConfig("disk:/kv", True, OnLoadError.FAIL, 1 << 20)


def test_the_connector_never_blends_under_a_model_config_kvblend_does_not_run():
    """vLLM applies hf_overrides (a RoPE theta, a norm epsilon) to the model it runs; kvblend's engine reads
    config.json from disk. Exact blocks are vLLM's own KV under keys that carry vLLM's config, but a blend is
    kvblend's KV: it was injected into a vLLM running another model config. The shared engine refuses it."""
    from blend.errors import KVBlendError
    from blend.integrations.vllm.engines import ConnectorConfig, SharedEngine

    cfg = ConnectorConfig(model="tiny-llama", dtype="float32", backend="test", force=True)
    ours = SharedEngine(cfg, 4).engine.provenance.model_arch
    params = parse_blend_params(blend_request(list(range(40)), [(5, 12), (12, 30)], guard_margin=None), 40)
    other = SharedEngine(dataclasses.replace(cfg, model_arch=ours + "-overridden"), 4)
    assert "another model config" in other.blend_refusal
    with pytest.raises(KVBlendError, match="another model config"):
        other.blend(list(range(40)), params)
    same = SharedEngine(dataclasses.replace(cfg, model_arch=ours), 4)
    assert same.blend_refusal == "" and same.blend(list(range(40)), params)[1]["classes"]
