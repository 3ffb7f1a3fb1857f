"""Fuzz, engine level: a damaged entry file in the disk tier is a miss, and the answer is cold's.

Property (DESIGN invariant 6 seen from a request): whichever stored entry of a request is damaged (bit
flips, a truncation, an extension, a structural rewrite of its safetensors table or kvblend header, re-signed
or not), an engine over that disk tier answers with cold's logits bit for bit (``torch.equal``), and the
segment that entry held is reported ``rejected`` or ``computed``, never reused; unless the damage left an
entry that decodes to the very tensors that were stored (e.g. a flipped bit in the header's padding), which
may be reused. Exact mode (prefix-chained entries) and blend mode (canonical chunk entries) both.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from blend.keys import Namespace
from blend.policy import ReusePolicy
from blend.report import ReuseClass
from blend.store.codec import all_finite
from blend.store.disk import DiskStore
from blend.store.memory import MemoryStore
from conftest import make_docs
from _fuzz_util import bounded, fuzz_budget, still_the_entry
from test_fuzz_store import damage

POLICIES = {"exact": ReusePolicy.exact(), "blend": ReusePolicy.blend(ratio=0.2)}
ENGINE_FUZZ = fuzz_budget(40)  # ~0.1 s an example (a request on the tiny model, a fresh engine over the tier)


@pytest.fixture(scope="module")
def warm(tiny_engine_factory, tmp_path_factory):
    """(engine, prompt, cold answers by mode, disk root, {entry file: its pristine bytes})."""
    eng = tiny_engine_factory()
    prompt = eng.build_prompt("Which of these is listed?", make_docs(2))
    cold = {mode: eng.with_store(MemoryStore()).generate(prompt, p, max_new_tokens=1)
            for mode, p in POLICIES.items()}
    root = tmp_path_factory.mktemp("kv")
    filler = eng.with_store(DiskStore(root, fsync=False))
    for p in POLICIES.values():
        filler.generate(prompt, p, max_new_tokens=1)
    files = {f: f.read_bytes() for f in sorted(root.rglob("*.safetensors"))}
    assert {f.parent.parent.name for f in files} >= {Namespace.EXACT.value, Namespace.CANONICAL.value}
    for mode, p in POLICIES.items():  # the tier as filled serves every segment but the question
        again = eng.with_store(DiskStore(root, fsync=False)).generate(prompt, p, max_new_tokens=1)
        assert torch.equal(again.first_logits, cold[mode].first_logits)
        assert ReuseClass.COMPUTED not in [s.reuse_class for s in again.report.segments[:-1]], mode
    return eng, prompt, cold, root, files


@ENGINE_FUZZ
@given(data=st.data(), mode=st.sampled_from(sorted(POLICIES)))
def test_a_damaged_entry_on_disk_is_a_miss_and_the_answer_is_colds(warm, data, mode):
    eng, prompt, cold, root, files = warm
    for f, blob in files.items():  # an earlier example's damage (or its replacement) undone
        f.write_bytes(blob)
    target: Path = data.draw(st.sampled_from(sorted(files)), label="entry")
    blob = damage(files[target], data)
    target.write_bytes(blob)
    with bounded(max_bytes=256 << 20):
        ans = eng.with_store(DiskStore(root, fsync=False)).generate(prompt, POLICIES[mode], max_new_tokens=1)
    assert torch.equal(ans.first_logits, cold[mode].first_logits)
    assert ans.token_ids == cold[mode].token_ids
    held = [s for s in ans.report.segments if s.key == target.stem]
    if not still_the_entry(blob, files[target]):
        assert all(s.reuse_class in (ReuseClass.REJECTED, ReuseClass.COMPUTED) for s in held), held


def test_all_finite_decides_values_too_large_to_sum_one_by_one():
    big = torch.full((4, 8), 3e38)  # every value finite, their fp32 sum an infinity
    assert all_finite(big) and all_finite(torch.empty(0)) and all_finite(torch.ones(3, dtype=torch.bfloat16))
    big[1, 2] = float("nan")
    assert not all_finite(big) and not all_finite(torch.tensor([1.0, float("-inf")], dtype=torch.float16))
