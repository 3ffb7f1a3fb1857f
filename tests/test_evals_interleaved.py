"""evals/interleaved.py: the in-process A/B that issue 18's speed changes are measured with."""

import torch

from blend.evals.interleaved import interleaved_ab
from blend.policy import ReusePolicy
from conftest import make_docs, unguarded_blend


def test_interleaved_ab_alternates_modes_and_keeps_each_modes_logits(tiny_engine):
    prompts = [tiny_engine.build_prompt(q, make_docs(3)) for q in ("Which?", "Who?")]
    calls = []
    res = interleaved_ab(tiny_engine, prompts, unguarded_blend(ratio=0.3), calls.append, ("old", "new"), repeats=2)
    assert calls[:4] == ["old", "new", "old", "new"]  # warm-up: each mode once per prompt
    assert calls[4:8] == ["old", "new", "old", "new"] and calls[8:12] == ["new", "old", "new", "old"]
    assert calls[-1] == "new"  # left on the last mode
    assert all(len(res.ratios[m]) == 4 and all(r > 0 for r in res.ratios[m]) for m in ("old", "new"))
    assert res.identical("old", "new")  # the same path under both names
    assert len(res.kl("new")) == 2 and all(k >= 0 for k in res.kl("new"))
    assert "logits bit-identical: True" in res.summary()
    res.logits["new"][0] = res.logits["new"][0] + 1.0
    assert not res.identical("old", "new")
    assert isinstance(res.reference[0], torch.Tensor)


def test_a_full_prefill_per_mode_divides_each_mode_by_its_own(tiny_engine, monkeypatch):
    """When the change touches the full prefill too, each mode's TTFT is over that mode's full prefill."""
    from blend.engine import Engine

    prompts = [tiny_engine.build_prompt("Which?", make_docs(3))]
    mode, seen = ["old"], []
    real = Engine.generate

    def generate(self, prompt, policy=None, **kw):  # records which mode each full prefill ran in
        ans = real(self, prompt, policy, **kw)
        if policy is not None and policy == ReusePolicy.one_pass():  # the full prefill every ratio divides by
            seen.append(mode[0])
        return ans

    monkeypatch.setattr(Engine, "generate", generate)
    res = interleaved_ab(tiny_engine, prompts, unguarded_blend(ratio=0.3), lambda m: mode.__setitem__(0, m),
                         ("old", "new"), repeats=2, full_per_mode=True)
    # warm-up: the reference in the first mode and an untimed one in the second; then one per mode and round
    assert seen == ["old", "new", "old", "new", "new", "old"]
    assert all(len(res.full_s[m]) == 2 for m in ("old", "new"))
    assert "full prefill ms (median)" in res.summary()


def test_a_modes_first_full_prefill_is_not_a_timed_sample(tiny_engine, monkeypatch):
    """With a full prefill per mode, the second mode's first full prefill (a new path's one-off packing or
    plans) was round 0's timed sample: the warm-up ran the full prefill in the first mode only."""
    import time

    from blend.engine import Engine

    prompts = [tiny_engine.build_prompt("Which?", make_docs(3))]
    mode, first_done = ["old"], set()
    real = Engine.prefill
    one_off_s = 0.5

    def prefill(self, prompt, policy, *a, **kw):  # each mode's first full prefill pays a one-off cost
        if policy == ReusePolicy.one_pass() and mode[0] not in first_done:
            first_done.add(mode[0])
            time.sleep(one_off_s)
        return real(self, prompt, policy, *a, **kw)

    monkeypatch.setattr(Engine, "prefill", prefill)
    res = interleaved_ab(tiny_engine, prompts, unguarded_blend(ratio=0.3), lambda m: mode.__setitem__(0, m),
                         ("old", "new"), repeats=2, full_per_mode=True)
    assert first_done == {"old", "new"}
    assert all(s < one_off_s for m in ("old", "new") for s in res.full_s[m])
