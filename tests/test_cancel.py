"""blend.cancel: a prefill inside a cancellable block stops before its next layer once the flag is set, and
computes the same bits while it is not (tiny model)."""

from __future__ import annotations

import threading

import pytest
import torch

from blend.cancel import PrefillCancelled, cancel_flag, cancellable
from blend.policy import ReusePolicy
from conftest import make_docs

DOCS = make_docs(3, words=20, seed=2)
POLICIES = {"none": ReusePolicy.none(), "exact": ReusePolicy.exact(), "blend": ReusePolicy.blend(ratio=0.3)}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_flag_never_set_changes_no_bit(tiny_engine_factory, name):
    """Cold then warm (the second run loads what the first stored), inside a block and outside one."""
    outside, inside = tiny_engine_factory(), tiny_engine_factory()
    flag = threading.Event()
    for _ in range(2):
        want, _, _ = outside.prefill(outside.build_prompt("q?", DOCS), POLICIES[name])
        with cancellable(flag):
            got, _, _ = inside.prefill(inside.build_prompt("q?", DOCS), POLICIES[name])
        assert torch.equal(got, want)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_set_flag_stops_the_prefill_and_only_inside_its_block(tiny_engine, name):
    flag = threading.Event()
    flag.set()
    prompt = tiny_engine.build_prompt("q?", DOCS)
    with cancellable(flag), pytest.raises(PrefillCancelled):
        tiny_engine.prefill(prompt, POLICIES[name])
    assert cancel_flag() is None
    logits, _, report = tiny_engine.prefill(prompt, POLICIES[name])  # outside it: the whole prefill
    assert logits is not None and report.prompt_tokens == len(prompt)


def test_a_block_is_its_own_threads_and_blocks_nest():
    flag, other = threading.Event(), threading.Event()
    seen = []
    with cancellable(flag):
        worker = threading.Thread(target=lambda: seen.append(cancel_flag()))
        worker.start()
        worker.join()
        with cancellable(other):
            assert cancel_flag() is other
        assert cancel_flag() is flag
    assert seen == [None] and cancel_flag() is None
