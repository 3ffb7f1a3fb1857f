"""The blend's re-positioning and tempering of several layers at once give the per-layer bits."""

import torch

from blend.blend_plan import plan_blend
from blend.policy import ReusePolicy
from blend.report import ReuseClass
from blend.segment_values import ChunkKV
from conftest import make_docs


def test_repositioning_layers_at_once_gives_the_per_layer_bits(tiny_engine, monkeypatch):
    import blend.blend_plan as B

    monkeypatch.setattr(B, "PREPARE_GROUP_BYTES", 1 << 30)  # every layer in one group
    prompt = tiny_engine.build_prompt("Which one?", make_docs(3, words=30))
    runner = tiny_engine.runner
    chunks = []
    for doc in prompt.documents[1:]:  # canonical KV: each document alone after the preamble
        cache = runner.new_cache(len(prompt.preamble) + len(doc))
        runner.prefill(cache, runner.ids(prompt.preamble.token_ids))
        _, kv = runner.prefill(cache, runner.ids(doc.token_ids))
        chunks.append(ChunkKV(kv, ReuseClass.COMPUTED, ""))
    e = len(prompt.preamble) + len(prompt.documents[0])
    plan = plan_blend(runner, prompt, chunks, 1, e, ReusePolicy.blend(0.2))
    layers = runner.dims.num_layers
    assert layers >= 4
    one, every = runner.new_cache(len(prompt)), runner.new_cache(len(prompt))
    for layer in range(layers):
        for c, lo in zip(plan.chunks, plan.starts):
            plan.reposition_one(layer, one, c, lo)
    plan.reposition_layers(range(1, layers), every)
    plan.reposition_layers(range(0, 1), every)
    for layer in range(layers):
        a, b = one.rows(layer, e, e + plan.nb), every.rows(layer, e, e + plan.nb)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # prepare: each layer once, whatever order and grouping; tempered once
    lazy = runner.new_cache(len(prompt))
    for layer in (2, 0, 1, 2, 3, 1):
        plan.prepare(layer, lazy, 1.25)
    for layer in range(4):
        a, b = one.rows(layer, e, e + plan.nb), lazy.rows(layer, e, e + plan.nb)
        assert torch.equal(a[0] * (1.0 / 1.25), b[0]) and torch.equal(a[1], b[1])
