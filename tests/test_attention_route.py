"""The engine with its attention on oneDNN's GEMMs (``KVBLEND_ATTENTION_GEMM``), thresholds lowered so
that the tiny model's prompts take that route: the invariants hold on it as on the flash op's."""

import pytest
import torch

import blend.kernels.onednn_attention as O
import blend.kernels.query_blocks as Q
import blend.kernels.suffix_attention as S
from blend.gemm import onednn_available
from blend.policy import ReusePolicy
from blend.report import ReuseClass
from blend.store.memory import MemoryStore
from conftest import make_docs, unguarded_blend

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN linear op")

LOW = dict(SUFFIX_MIN_KEYS=32, SUFFIX_MIN_QUERIES=4, ONEDNN_MIN_KEYS=32)


@pytest.fixture
def onednn_calls(attention_route, monkeypatch):
    """The route forced on from small sizes; counts of each oneDNN program's calls."""
    attention_route("onednn", **LOW)
    calls = {"suffix": 0, "blocks": 0}

    def count(name, fn):
        def wrapped(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        return wrapped

    monkeypatch.setattr(S, "suffix_onednn", count("suffix", S.suffix_onednn))
    monkeypatch.setattr(Q, "blocks_onednn", count("blocks", Q.blocks_onednn))
    return calls


def test_exact_reuse_cold_warm_and_no_reuse_agree_bit_for_bit_on_onednn(tiny_engine_factory, onednn_calls):
    store = MemoryStore()
    eng = tiny_engine_factory(store=store)
    prompt = eng.build_prompt("What is listed?", make_docs(4))
    none = eng.generate(prompt, ReusePolicy.none(), max_new_tokens=6, stop_at_newline=False)
    assert onednn_calls["suffix"] > 0  # the segments after the first ran on oneDNN
    cold = eng.generate(prompt, max_new_tokens=6, stop_at_newline=False)
    warm = eng.generate(prompt, max_new_tokens=6, stop_at_newline=False)
    shared = tiny_engine_factory(store=store).generate(prompt, max_new_tokens=6, stop_at_newline=False)
    for other in (cold, warm, shared):
        assert torch.equal(none.first_logits, other.first_logits) and none.token_ids == other.token_ids
    assert [s.reuse_class for s in warm.report.segments][-2] is ReuseClass.EXACT


def test_blend_on_onednn_ratio_one_is_full_prefill_and_cold_is_warm(tiny_engine_factory, onednn_calls):
    eng = tiny_engine_factory()
    prompt = eng.build_prompt("Which?", make_docs(4))
    full = eng.generate(prompt, ReusePolicy.none(), max_new_tokens=1)
    one = eng.generate(prompt, unguarded_blend(ratio=1.0), max_new_tokens=1)
    assert (one.first_logits - full.first_logits).abs().max() <= 1e-4
    cold_engine = tiny_engine_factory()
    cold = cold_engine.generate(prompt, unguarded_blend(ratio=0.2), max_new_tokens=1)
    warm = cold_engine.generate(prompt, unguarded_blend(ratio=0.2), max_new_tokens=1)
    assert torch.equal(cold.first_logits, warm.first_logits)
    assert onednn_calls["blocks"] > 0  # the selected rows' attention ran on oneDNN too


def test_the_route_is_part_of_the_provenance(tiny_engine_factory, attention_route):
    """The exact path's last bits depend on the route, so stored KV from one route is a miss under the other."""
    store = MemoryStore()
    attention_route("flash")
    flash = tiny_engine_factory(store=store)
    prompt = flash.build_prompt("Why?", make_docs(3))
    flash.generate(prompt, max_new_tokens=1)
    attention_route("onednn", **LOW)
    onednn = tiny_engine_factory(store=store)
    assert "/attn-flash/" in flash.provenance.backend
    assert f"/{O.attention_label()}/" in onednn.provenance.backend and O.attention_label() != "attn-flash"
    again = onednn.generate(prompt, max_new_tokens=1)
    assert all(s.reuse_class is not ReuseClass.EXACT for s in again.report.segments)  # all computed again
