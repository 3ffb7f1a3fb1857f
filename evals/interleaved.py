"""In-process A/B of code paths on the same requests (how issue 18's speed changes are measured).

Timings on a shared 2-core machine drift by several percent between runs, so a change is
measured inside one process: every mode (e.g. ``old``, restored by patching, and ``new``) answers
the same prompts, alternating which runs first, and each TTFT is divided by a full prefill of
the same prompt timed just before it. First-token logits of each mode are kept from an untimed
warm-up (which also stores the chunks), so the caller can check that a change is bit-identical.

    result = interleaved_ab(engine, prompts, policy, set_mode, modes=("old", "new"), repeats=5)
    print(result.summary())
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from blend.defaults import DEFAULT_EVAL_DATA, DEFAULT_MODEL, DEFAULT_RATIO
from blend.engine import Engine
from blend.evals.bench_phases import SIZES, size_prompts
from blend.evals.metrics import kl_divergence
from blend.policy import ReusePolicy
from blend.prompt import Prompt


@dataclass
class ABResult:
    """What :func:`interleaved_ab` measured."""

    modes: tuple[str, ...]
    ratios: dict[str, list[float]] = field(default_factory=dict)  # mode -> TTFT / full prefill, per prompt x repeat
    logits: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # mode -> (V,) first-token logits per prompt
    reference: list[torch.Tensor] = field(default_factory=list)  # (V,) full prefill's per prompt
    full_s: dict[str, list[float]] = field(default_factory=dict)  # mode -> full prefill seconds (when the
    # full prefill is timed in each mode: a change to the full prefill's own path)

    def median(self, mode: str) -> float:
        """Median ratio of ``mode``."""
        return statistics.median(self.ratios[mode])

    def paired(self, mode: str, base: str) -> float:
        """Median over prompts and repeats of ``mode``'s ratio over ``base``'s (same prompt, same repeat)."""
        return statistics.median(a / b for a, b in zip(self.ratios[mode], self.ratios[base]))

    def identical(self, a: str, b: str) -> bool:
        """Whether two modes gave bit-identical first-token logits on every prompt."""
        return all(torch.equal(x, y) for x, y in zip(self.logits[a], self.logits[b]))

    def kl(self, mode: str) -> list[float]:
        """First-token KL of ``mode`` against full prefill, per prompt."""
        return [kl_divergence(r, x) for r, x in zip(self.reference, self.logits[mode])]

    def summary(self) -> str:
        """One line: median and mean ratio per mode, the last mode paired against the first, bit-identity."""
        first, last = self.modes[0], self.modes[-1]
        cells = {m: (round(self.median(m), 4), round(statistics.mean(self.ratios[m]), 4)) for m in self.modes}
        full = {m: round(statistics.median(t) * 1e3) for m, t in self.full_s.items() if t}
        return (f"{cells} (median, mean) paired {last}/{first} median {self.paired(last, first):.4f} "
                + (f"full prefill ms (median) {full} " if full else "")
                + f"logits bit-identical: {self.identical(first, last)} KL {[round(x, 6) for x in self.kl(last)]}")


def interleaved_ab(engine: Engine, prompts: Sequence[Prompt], policy: ReusePolicy,
                   set_mode: Callable[[str], None], modes: Sequence[str] = ("old", "new"),
                   repeats: int = 5, full_per_mode: bool = False) -> ABResult:
    """Time ``policy`` on every prompt under each mode, interleaved with full prefills.

    Args:
        engine: the engine (its store keeps the prompts' chunks after the warm-up).
        prompts: the requests.
        policy: the reuse policy every mode runs.
        set_mode: switches the code path (e.g. patches a function back to its previous version).
        modes: the modes' names, passed to ``set_mode``; the first is the baseline.
        repeats: timed rounds; odd rounds run the modes in reverse order.
        full_per_mode: time the full prefill in every mode (when the change touches it too) and
            divide each mode's TTFT by its own; the reference logits are the first mode's. The warm-up
            then runs the full prefill once in every mode, so no mode's first full prefill (a new path's
            packing or plans) is a timed sample.

    Returns:
        Ratios per mode, first-token logits per mode and full prefill's.
    """
    res = ABResult(tuple(modes), {m: [] for m in modes}, {m: [] for m in modes},
                   full_s={m: [] for m in modes} if full_per_mode else {})
    for p in prompts:  # warm-up: chunks stored; every mode's logits kept
        if full_per_mode:
            set_mode(modes[0])
        res.reference.append(engine.generate(p, ReusePolicy.one_pass(), max_new_tokens=1).first_logits)
        for m in modes:
            set_mode(m)
            if full_per_mode and m != modes[0]:  # the full prefill is timed in this mode too: its first call
                engine.generate(p, ReusePolicy.one_pass(), max_new_tokens=1)  # (packing, plans) is not a sample
            res.logits[m].append(engine.generate(p, policy, max_new_tokens=1).first_logits)
    for rep in range(repeats):
        order = list(modes) if rep % 2 == 0 else list(reversed(modes))
        for p in prompts:
            full = None if full_per_mode else engine.generate(p, ReusePolicy.one_pass(), max_new_tokens=1).ttft_s
            for m in order:
                set_mode(m)
                if full_per_mode:
                    full = engine.generate(p, ReusePolicy.one_pass(), max_new_tokens=1).ttft_s
                    res.full_s[m].append(full)
                res.ratios[m].append(engine.generate(p, policy, max_new_tokens=1).ttft_s / full)
    set_mode(modes[-1])
    return res


def ab_over_sizes(set_mode: Callable[[str], None], sizes: str, items: str = "0-2", repeats: int = 5,
                  guard: bool = False, extra: Callable[[ABResult], str] | None = None,
                  data: str = DEFAULT_EVAL_DATA, full_per_mode: bool = False) -> dict[str, ABResult]:
    """:func:`interleaved_ab` of the default blend (its ratio) on the default model at ``bench_phases``' prompt
    sizes, one line per size.

    Args:
        set_mode: switches between ``old`` and ``new``.
        sizes: comma list of ``bench_phases`` sizes (600, 3k, 6k).
        items: item range A-B of ``data``.
        repeats: timed rounds.
        guard: the default near-tie guard on (off: the blend's own pass).
        extra: more text for each size's line.
        data: the musique file.
        full_per_mode: see :func:`interleaved_ab`.

    Returns:
        The result per size (each also printed).
    """
    engine = Engine.load(DEFAULT_MODEL)
    lo, hi = (int(x) for x in items.split("-"))
    policy = ReusePolicy.blend(DEFAULT_RATIO) if guard else ReusePolicy.blend(DEFAULT_RATIO, guard_margin=None)
    out = {}
    for size in sizes.split(","):
        prompts = size_prompts(engine, data, range(lo, hi + 1), SIZES[size])
        res = out[size] = interleaved_ab(engine, prompts, policy, set_mode, ("old", "new"), repeats, full_per_mode)
        print(size, f"items {lo}-{hi} x {repeats}", "guard" if guard else "no guard", res.summary(),
              extra(res) if extra else "", flush=True)
    return out
