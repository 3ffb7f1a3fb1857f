"""Invariants 2, 3 and 5 for blended reuse."""

import pytest
import torch

from blend.errors import InvalidPolicyError
from blend.keys import Namespace
from blend.kvcache import KVEntry
from blend.selectors import SelectionInputs, select
from blend.policy import SELECTOR_NAMES, BudgetMode, ReusePolicy
from blend.report import ReuseClass
from blend.store.memory import MemoryStore
from conftest import make_docs, unguarded_blend


def plain_full_reuse_logits(engine, prompt) -> torch.Tensor:
    """Independent reference for ratio 0: load every document's canonical KV at its new
    position through the exact path's loader, then compute the question on top."""
    runner = engine.runner
    cache = runner.new_cache(len(prompt))
    h, _ = runner.prefill(cache, runner.ids(prompt.preamble.token_ids))
    for doc in prompt.documents:
        runner.load(cache, engine.segments.canonical_kv(prompt.preamble, doc.token_ids))
    h, _ = runner.prefill(cache, runner.ids(prompt.question.token_ids), keep_kv=False)
    return runner.logits(h[-1:])[0]


def classes(ans):
    return [s.reuse_class for s in ans.report.segments]


def test_ratio_one_reproduces_full_prefill(tiny_engine):
    prompt = tiny_engine.build_prompt("Which?", make_docs(4))
    full = tiny_engine.generate(prompt, ReusePolicy.none(), max_new_tokens=1)
    for warm in (False, True):
        b = tiny_engine.generate(prompt, unguarded_blend(ratio=1.0), max_new_tokens=1)
        assert (b.first_logits - full.first_logits).abs().max() <= 1e-4, warm
    assert b.report.recomputed_tokens == sum(len(d) for d in prompt.documents[1:])
    # every row it could recompute (the first document, exact, counts in the base): the report says the
    # share recomputed, as an adaptive budget's does, not the policy's 1.0
    share = b.report.recomputed_tokens / sum(len(d) for d in prompt.documents)
    assert b.report.ratio == pytest.approx(share) and b.report.spent == pytest.approx(share) and share < 0.9
    assert tiny_engine.generate(prompt, unguarded_blend(ratio=0.15), max_new_tokens=1).report.ratio == 0.15


def test_ratio_zero_reproduces_plain_full_reuse(tiny_engine):
    prompt = tiny_engine.build_prompt("Which?", make_docs(4))
    b = tiny_engine.generate(prompt, unguarded_blend(ratio=0.0), max_new_tokens=1)
    with torch.inference_mode():
        ref = plain_full_reuse_logits(tiny_engine, prompt)
    assert (b.first_logits - ref).abs().max() <= 1e-5
    assert b.report.recomputed_tokens == 0
    full = tiny_engine.generate(prompt, ReusePolicy.none(), max_new_tokens=1)
    assert (b.first_logits - full.first_logits).abs().max() > 1e-3  # reuse really is approximate here


def test_single_document_after_preamble_is_the_exact_path_bitwise(tiny_engine_factory):
    eng = tiny_engine_factory()
    prompt = eng.build_prompt("Which?", make_docs(1))
    exact = eng.generate(prompt, ReusePolicy.exact(), max_new_tokens=4)
    blend = eng.generate(prompt, unguarded_blend(ratio=0.0), max_new_tokens=4)
    assert torch.equal(exact.first_logits, blend.first_logits)
    assert exact.token_ids == blend.token_ids
    # the exact run kept the document under its canonical key (its exact KV at that position),
    # so the blend finds it: one entry, shared by both modes
    assert classes(exact)[:2] == [ReuseClass.COMPUTED, ReuseClass.COMPUTED]
    assert classes(blend)[:2] == [ReuseClass.EXACT, ReuseClass.EXACT]
    fresh = tiny_engine_factory()
    cold_blend = fresh.generate(prompt, unguarded_blend(ratio=0.0), max_new_tokens=4)
    assert classes(cold_blend)[:2] == [ReuseClass.COMPUTED, ReuseClass.COMPUTED]  # a fresh store: all cold
    assert torch.equal(exact.first_logits, cold_blend.first_logits)


@pytest.mark.parametrize("selector", ["v", "query", "combo"])
def test_cold_equals_warm_for_blend(tiny_engine_factory, selector):
    docs = make_docs(4)
    policy = ReusePolicy.blend(ratio=0.15, selector=selector)  # the default guard fires on these near ties:
    cold_eng = tiny_engine_factory()  # cold == warm must hold through its second pass too
    prompt = cold_eng.build_prompt("Which?", docs)
    cold = cold_eng.generate(prompt, policy, max_new_tokens=6, stop_at_newline=False)
    warm = cold_eng.generate(prompt, policy, max_new_tokens=6, stop_at_newline=False)
    # a third engine whose chunks were precomputed in a *different* order by other requests
    other = tiny_engine_factory()
    other.generate(other.build_prompt("Other?", docs[::-1]), policy, max_new_tokens=1)
    reordered_first = other.generate(prompt, policy, max_new_tokens=6, stop_at_newline=False)
    for ans in (warm, reordered_first):
        assert torch.equal(cold.first_logits, ans.first_logits)
        assert cold.token_ids == ans.token_ids
    assert ReuseClass.COMPUTED in classes(cold)[1:-1]
    assert classes(warm)[1:-1] == [ReuseClass.EXACT] + [ReuseClass.BLENDED] * 3


def test_reordered_duplicates_and_one_token_documents(tiny_engine):
    docs = make_docs(3)
    policy = unguarded_blend(ratio=0.15)
    tiny_engine.precompute_chunks(docs + ["x"])
    for order in ([2, 0, 1], [1, 1, 0], [0, 0, 0]):
        prompt = tiny_engine.build_prompt("Which?", [docs[i] for i in order] + ["x"])
        ans = tiny_engine.generate(prompt, policy, max_new_tokens=2)
        assert classes(ans)[1:-1] == [ReuseClass.EXACT] + [ReuseClass.BLENDED] * 3  # a 100% hit
        full = tiny_engine.generate(prompt, ReusePolicy.none(), max_new_tokens=1)
        ratio1 = tiny_engine.generate(prompt, unguarded_blend(ratio=1.0), max_new_tokens=1)
        assert (ratio1.first_logits - full.first_logits).abs().max() <= 1e-4


def test_budget_counts_reused_document_tokens_and_never_the_first_document(tiny_engine):
    prompt = tiny_engine.build_prompt("Which?", make_docs(4))
    reused = sum(len(d) for d in prompt.documents)
    for sel in SELECTOR_NAMES:
        ans = tiny_engine.generate(prompt, unguarded_blend(ratio=0.1, selector=sel), max_new_tokens=1)
        assert ans.report.recomputed_tokens == round(0.1 * reused), sel
        assert ans.report.segments[1].recomputed == 0
        assert ans.report.selector == sel


def test_split_selector_takes_half_by_combo_and_the_rest_by_v():
    g = torch.Generator().manual_seed(0)
    n = 40
    inp = SelectionInputs(torch.rand(n, generator=g), torch.rand(n, generator=g), torch.rand(n, generator=g),
                          torch.zeros(n, dtype=torch.long), torch.arange(n), torch.rand(n, generator=g))
    for budget in (1, 7, 10, 40, 55):
        got = select("split", inp, budget)
        b = min(budget, n)
        assert got.numel() == b and got.unique().numel() == b
        combo = set(select("combo", inp, (b + 1) // 2).tolist())
        assert combo <= set(got.tolist())
        rest = set(got.tolist()) - combo
        by_v = [i for i in torch.argsort(inp.dev_v, descending=True, stable=True).tolist() if i not in combo]
        assert rest == set(by_v[: b - len(combo)])


def test_lead_selector_takes_document_starts(tiny_engine):
    prompt = tiny_engine.build_prompt("Which?", make_docs(3))
    ans = tiny_engine.generate(prompt, unguarded_blend(ratio=0.02, selector="lead"), max_new_tokens=1)
    per_doc = [s.recomputed for s in ans.report.segments[2:4]]
    assert abs(per_doc[0] - per_doc[1]) <= 1 and sum(per_doc) == ans.report.recomputed_tokens


def test_gradual_filtering_and_threshold_mode(tiny_engine):
    prompt = tiny_engine.build_prompt("Which?", make_docs(4))
    full = tiny_engine.generate(prompt, ReusePolicy.none(), max_new_tokens=1).first_logits
    grad = tiny_engine.generate(prompt, unguarded_blend(ratio=0.3, check_layers=(1, 2), layer_ratios=(0.3, 0.1)),
                                max_new_tokens=1)
    blended = sum(len(d) for d in prompt.documents[1:])  # the first document is exact at its place
    assert grad.report.recomputed_tokens == round(0.3 * sum(len(d) for d in prompt.documents))
    # the report also says what each later check layer kept (it counted only the first's selection)
    n_doc = sum(len(d) for d in prompt.documents)  # the budget's base
    assert grad.report.check_rows == (grad.report.recomputed_tokens, round(0.1 * n_doc))
    assert grad.report.to_dict()["check_rows"] == list(grad.report.check_rows)
    last = tiny_engine.generate(prompt, unguarded_blend(ratio=1.0, check_layers=(1, 2), layer_ratios=(1.0, 0.0)),
                                max_new_tokens=1)
    assert last.report.check_rows == (blended, 0)  # every re-positioned row up to layer 2, none above it
    everything = tiny_engine.generate(prompt, unguarded_blend(threshold=0.0, max_ratio=1.0), max_new_tokens=1)
    assert (everything.first_logits - full).abs().max() <= 1e-4
    capped = tiny_engine.generate(prompt, unguarded_blend(threshold=0.0, max_ratio=0.05), max_new_tokens=1)
    n_doc = sum(len(d) for d in prompt.documents)
    assert capped.report.recomputed_tokens == round(0.05 * n_doc)
    none = tiny_engine.generate(prompt, unguarded_blend(threshold=1e9), max_new_tokens=1)
    assert none.report.recomputed_tokens == 0
    # the report says the share a threshold selected, not the policy's unused fixed ratio
    assert capped.report.ratio == capped.report.recomputed_tokens / n_doc and none.report.ratio == 0.0
    assert everything.report.ratio == everything.report.recomputed_tokens / n_doc  # the first document: exact


def test_min_prompt_tokens_falls_back_to_full_compute(tiny_engine):
    prompt = tiny_engine.build_prompt("Which?", make_docs(2))
    ans = tiny_engine.generate(prompt, unguarded_blend(min_prompt_tokens=10_000), max_new_tokens=1)
    assert [s.reuse_class for s in ans.report.segments if s.kind.value == "document"] == [ReuseClass.FALLBACK] * 2
    full = tiny_engine.generate(prompt, ReusePolicy.none(), max_new_tokens=1)
    assert torch.equal(ans.first_logits, full.first_logits)
    assert "min_prompt_tokens" in ans.report.gate
    assert ans.report.ratio is None and ans.report.spent is None  # refused: nothing was blended


def test_a_blend_that_recomputes_nothing_reports_a_share_of_zero(tiny_engine_factory):
    """No document to re-position (none, one exact after the preamble, or every one exact and hot): the
    report said the policy's fixed ratio, as if that share had been recomputed."""
    engine = tiny_engine_factory()
    for docs in ([], make_docs(1)):
        prompt = engine.build_prompt("Which one?", docs)
        for policy in (unguarded_blend(ratio=0.4), unguarded_blend(threshold=0.0, max_ratio=1.0)):
            rep = engine.generate(prompt, policy, max_new_tokens=1).report
            assert rep.recomputed_tokens == 0 and rep.ratio == 0.0 and rep.spent == 0.0, (docs, policy)
    prompt = engine.build_prompt("Which one?", make_docs(3))
    engine.generate(prompt, ReusePolicy.exact(), max_new_tokens=1)  # stores this order's exact prefix
    for _ in range(2):  # the exact prefix loaded, then attached hot
        rep = engine.generate(prompt, unguarded_blend(ratio=0.4, take_exact=True), max_new_tokens=1).report
        assert rep.recomputed_tokens == 0 and rep.ratio == 0.0 and rep.spent == 0.0


def test_blend_never_writes_the_exact_namespace_beyond_the_preamble(tiny_engine):
    prompt = tiny_engine.build_prompt("Which?", make_docs(3))
    tiny_engine.generate(prompt, unguarded_blend(ratio=0.15), max_new_tokens=2)
    assert len(list(tiny_engine.store.keys(Namespace.EXACT))) == 1  # the preamble only
    assert len(list(tiny_engine.store.keys(Namespace.CANONICAL))) == 3
    assert not list(tiny_engine.store.keys(Namespace.APPROX))


@pytest.mark.parametrize("kw, match", [
    (dict(ratio=1.5), "ratio"), (dict(ratio=-0.1), "ratio"), (dict(ratio=float("nan")), "ratio"),
    (dict(selector="nope"), "unknown selector"), (dict(check_layers=()), "check_layers"),
    (dict(check_layers=(2, 1)), "increasing"),
    (dict(check_layers=(1, 2), layer_ratios=(0.3, 0.15), threshold=0.5), "not with an adaptive budget or a threshold"),
    (dict(check_layers=(1, 2), layer_ratios=(0.3, 0.15), budget=BudgetMode.AUTO), "not with an adaptive"),
])
def test_policy_validation(kw, match):
    with pytest.raises(InvalidPolicyError, match=match):
        unguarded_blend(**kw)


def test_check_layer_outside_model_is_rejected(tiny_engine):
    prompt = tiny_engine.build_prompt("Which?", make_docs(3))
    with pytest.raises(InvalidPolicyError, match="outside the model"):
        tiny_engine.generate(prompt, unguarded_blend(check_layers=(4,)))


def test_default_policy_is_exact(tiny_engine):
    prompt = tiny_engine.build_prompt("Which?", make_docs(2))
    ans = tiny_engine.generate(prompt, max_new_tokens=1)
    assert ans.report.policy == "exact"
    assert ReusePolicy().mode.value == "exact"


def test_blend_generation_continues_from_the_mixed_cache(tiny_engine):
    """Decoding after a ratio-1.0 blend equals decoding after full prefill."""
    prompt = tiny_engine.build_prompt("Which?", make_docs(3))
    full = tiny_engine.generate(prompt, ReusePolicy.none(), max_new_tokens=10, stop_at_newline=False)
    b = tiny_engine.generate(prompt, unguarded_blend(ratio=1.0), max_new_tokens=10, stop_at_newline=False)
    assert b.token_ids == full.token_ids


def test_store_shared_across_engines_serves_blend(tiny_engine_factory):
    store = MemoryStore()
    a = tiny_engine_factory(store=store)
    docs = make_docs(3)
    a.precompute_chunks(docs)
    b = tiny_engine_factory(store=store)
    ans = b.generate(b.build_prompt("Q?", docs), unguarded_blend(), max_new_tokens=1)
    assert classes(ans)[1:-1] == [ReuseClass.EXACT, ReuseClass.BLENDED, ReuseClass.BLENDED]


@pytest.mark.parametrize("policy", [unguarded_blend(0.25, "probe"), unguarded_blend(0.25, "v"),
                                    unguarded_blend(0.3, "probe", check_layers=(1, 2), layer_ratios=(0.3, 0.2)),
                                    unguarded_blend(0.3, "combo", check_layers=(1, 2)),
                                    unguarded_blend(0.3, "split", check_layers=(1, 2), layer_ratios=(0.3, 0.2)),
                                    unguarded_blend(0.0), unguarded_blend(1e-9, "probe")])
def test_context_only_blend_leaves_the_context_rows_bit_identical(tiny_engine, policy):
    """question=False (a serving engine computes the question itself) stops the question's rows
    after the check: every row before the question is the same as in a whole blend (no document
    row attends to the question) up to float rounding (the GEMMs and the blocked attention see
    fewer rows, so a BLAS may pick other kernels: bit-identical up to the check layer, <= 1e-5
    above), the cache ends before the question, logits are None; the selection is the same."""
    prompt = tiny_engine.build_prompt("Which one is it?", make_docs(4))
    whole, c_whole, r_whole = tiny_engine.prefill(prompt, policy)
    logits, c_ctx, r_ctx = tiny_engine.prefill(prompt, policy, question=False)
    n_ctx = len(prompt) - len(prompt.question)
    if policy.ratio == 0.0:  # no check layer: the question runs whole
        assert logits is not None and c_ctx.length == len(prompt)
    else:
        assert logits is None and c_ctx.length == n_ctx
    assert whole is not None and c_whole.length == len(prompt)
    for layer in range(tiny_engine.dims.num_layers):
        kw, vw = c_whole.view(layer, n_ctx)
        kc, vc = c_ctx.view(layer, n_ctx)
        if layer <= max(policy.check_layers) - 1 or policy.ratio == 0.0:
            assert torch.equal(kw, kc) and torch.equal(vw, vc), layer
        torch.testing.assert_close(kc, kw, rtol=0, atol=1e-5)
        torch.testing.assert_close(vc, vw, rtol=0, atol=1e-5)
    assert [s.recomputed_offsets for s in r_whole.segments] == [s.recomputed_offsets for s in r_ctx.segments]


def test_blend_takes_the_exact_prefix_an_exact_run_stored(tiny_engine_factory):
    """With take_exact, documents this order's exact path stored are exact in a blend too: a repeat of an
    exact prompt under such a blend is the exact path bit for bit, whatever the ratio."""
    eng = tiny_engine_factory()
    prompt = eng.build_prompt("Which?", make_docs(4))
    exact = eng.generate(prompt, ReusePolicy.exact(), max_new_tokens=3)
    for ratio, sel in [(0.15, "probe"), (0.0, "probe"), (0.3, "v")]:
        b = eng.generate(prompt, unguarded_blend(ratio=ratio, selector=sel, take_exact=True), max_new_tokens=3)
        assert classes(b)[:-1] == [ReuseClass.EXACT] * 5
        assert b.report.recomputed_tokens == 0 and b.report.reused_tokens == len(prompt) - len(prompt.question)
        assert torch.equal(b.first_logits, exact.first_logits) and b.token_ids == exact.token_ids


def test_blend_exact_run_stops_at_the_first_document_not_stored_in_this_order(tiny_engine_factory):
    eng = tiny_engine_factory()
    docs = make_docs(4)
    eng.generate(eng.build_prompt("Which?", docs[:2]), ReusePolicy.exact(), max_new_tokens=1)  # docs 0, 1 exact
    prompt = eng.build_prompt("Which?", [docs[0], docs[1], docs[3], docs[2]])
    b = eng.generate(prompt, unguarded_blend(ratio=1.0, take_exact=True), max_new_tokens=1)
    assert classes(b)[1:-1] == [ReuseClass.EXACT, ReuseClass.EXACT, ReuseClass.COMPUTED, ReuseClass.COMPUTED]
    full = eng.generate(prompt, ReusePolicy.none(), max_new_tokens=1)
    assert (b.first_logits - full.first_logits).abs().max() <= 1e-4  # ratio 1.0 == full prefill still
    assert b.report.recomputed_tokens == len(prompt.documents[2]) + len(prompt.documents[3])  # not the exact ones
    # the same documents reordered after the first: only document 1 is exact (its canonical position)
    other = eng.build_prompt("Which?", [docs[0], docs[3], docs[1], docs[2]])
    b2 = eng.generate(other, unguarded_blend(ratio=0.15, take_exact=True), max_new_tokens=1)
    # (docs[1] was exact before, so its canonical KV is computed now; docs[3] and docs[2] were blended)
    assert classes(b2)[1:-1] == [ReuseClass.EXACT, ReuseClass.BLENDED, ReuseClass.COMPUTED, ReuseClass.BLENDED]


class _SlowCanonicalStore(MemoryStore):
    """A memory store whose canonical lookups take as long as a slow tier's (counted)."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s, self.canonical_gets = delay_s, 0

    def get(self, ns, key, provenance):
        if ns is Namespace.CANONICAL:
            self.canonical_gets += 1
            import time

            time.sleep(self.delay_s)
        return super().get(ns, key, provenance)


def test_blend_cancels_canonical_lookups_of_documents_the_exact_run_took(tiny_engine_factory):
    """Overlapped loading starts every document's canonical lookup; the ones still queued when the
    exact run has taken their documents never run (wasted reads on a disk or Redis tier)."""
    store = _SlowCanonicalStore(0.0)
    eng = tiny_engine_factory(store=store)
    prompt = eng.build_prompt("Which?", make_docs(8))
    exact = eng.generate(prompt, ReusePolicy.exact(), max_new_tokens=1)
    store.delay_s, store.canonical_gets = 0.25, 0
    b = eng.generate(prompt, unguarded_blend(ratio=0.15, take_exact=True), max_new_tokens=1)
    assert classes(b)[:-1] == [ReuseClass.EXACT] * 9 and torch.equal(b.first_logits, exact.first_logits)
    pool = eng.segments.prefetcher._pool  # FIFO, two workers: once two later tasks ran, every queued lookup began
    for f in [pool.submit(lambda: None) for _ in range(2)]:
        f.result()
    # document 1's lookup and the few that began before the run was known ran; not all 8
    assert 1 <= store.canonical_gets < 8


def test_blend_exact_run_respects_the_cache_salt_and_rejects_corrupt_entries(tiny_engine_factory):
    eng = tiny_engine_factory()
    docs = make_docs(3)
    prompt = eng.build_prompt("Which?", docs)
    eng.generate(prompt, ReusePolicy.exact(cache_salt="tenant-a"), max_new_tokens=1)
    b = eng.generate(prompt, unguarded_blend(ratio=0.15, cache_salt="tenant-b", take_exact=True), max_new_tokens=1)
    assert classes(b)[2:-1] == [ReuseClass.COMPUTED, ReuseClass.COMPUTED]  # another tenant's KV: never seen
    ref = eng.generate(prompt, unguarded_blend(ratio=0.15, take_exact=True), max_new_tokens=1)  # no exact run: salt ""
    # an exact entry of the wrong length (crafted) ends the run: the document is blended instead
    keys = eng.segments.prefix_keys([prompt.preamble, *prompt.documents])
    ns, key = keys[2]
    eng.generate(prompt, ReusePolicy.exact(), max_new_tokens=1)
    good = eng.segments.lookup(ns, key, len(prompt.documents[1])).entry
    eng.store.put(ns, key, KVEntry(good.k[:, :, :-1], good.v[:, :, :-1], good.provenance))
    b3 = eng.generate(prompt, unguarded_blend(ratio=0.15, take_exact=True), max_new_tokens=1)
    assert classes(b3)[1:-1] == [ReuseClass.EXACT, ReuseClass.BLENDED, ReuseClass.BLENDED]
    assert torch.equal(b3.first_logits, ref.first_logits)


def test_a_blend_is_a_function_of_the_request_whatever_the_exact_path_stored(tiny_engine_factory):
    """DESIGN's invariant 2 (cold equals warm, for every mode): an exact request of the same order stored
    exact-prefix entries, and the next blend took them (a different answer, 0.4 off on the tiny model,
    3.5 on SmolLM2), so a blend's output depended on earlier traffic, evictions and other processes.
    By default it never does; take_exact opts in."""
    docs = make_docs(4)
    cold = tiny_engine_factory()
    prompt = cold.build_prompt("Which?", docs)
    ref = cold.generate(prompt, unguarded_blend(ratio=0.15), max_new_tokens=3)
    warm = tiny_engine_factory()
    for _ in range(2):  # the exact path stores this order; its second request makes the prefix hot
        warm.generate(prompt, ReusePolicy.exact(), max_new_tokens=1)
    for _ in range(2):  # found stored, then hot: neither changes a blend
        b = warm.generate(prompt, unguarded_blend(ratio=0.15), max_new_tokens=3)
        assert torch.equal(b.first_logits, ref.first_logits) and b.token_ids == ref.token_ids
        assert set(classes(b)[2:-1]) <= {ReuseClass.COMPUTED, ReuseClass.BLENDED}  # re-positioned, never exact
        assert b.report.recomputed_tokens == ref.report.recomputed_tokens > 0
    taken = warm.generate(prompt, unguarded_blend(ratio=0.15, take_exact=True), max_new_tokens=3)
    assert classes(taken)[:-1] == [ReuseClass.EXACT] * 5  # the opt-in
    assert "take-exact" in taken.report.policy
    with pytest.raises(InvalidPolicyError, match="take_exact"):
        ReusePolicy(take_exact=True)  # an exact policy takes what is stored anyway


def test_attention_plan_is_made_once_per_active_row_set(tiny_engine, monkeypatch):
    """The active rows' positions, RoPE tables and the blocked attention's plan are made when the
    active rows change (at a check layer), not at every layer, and give the bits of making them per layer."""
    import blend.blending as B

    prompt = tiny_engine.build_prompt("Which?", make_docs(4))
    pol = unguarded_blend(ratio=0.3)
    tiny_engine.generate(prompt, pol, max_new_tokens=1)  # warm: the chunks stored
    made = []
    real = B.plan_query_blocks
    monkeypatch.setattr(B, "plan_query_blocks", lambda *a, **kw: made.append(a[0].numel()) or real(*a, **kw))
    planned = tiny_engine.generate(prompt, pol, max_new_tokens=1)
    assert len(made) == len(pol.check_layers) + 1 < tiny_engine.runner.dims.num_layers
    assert made[0] > made[-1]  # the rows the check layer kept are fewer

    def per_layer(self, active, dtype):
        plan = self.plan
        return B._ActiveQueries(active, dtype, plan.pos[active], plan.cos[active], plan.sin[active], None)

    monkeypatch.setattr(B.BlendRows, "_active_queries", per_layer)
    assert torch.equal(tiny_engine.generate(prompt, pol, max_new_tokens=1).first_logits, planned.first_logits)
