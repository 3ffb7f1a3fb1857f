"""The engine's invariants on an accelerator, end to end (the prepared device check's second half).

    python -m blend.evals.check_device --device cuda --json OUT.json

Runs the tiny random-weight model (no download, no data files: the device
machine reaches nothing) through the public API on ``--device`` and, for the
blend, against the same engine on the CPU:

- exact reuse: a warm request equals the cold one bit for bit;
- blend at ratio 1.0 equals full prefill within the fp32 logit tolerance;
- blend@0.15 on the device (Triton kernels on CUDA) against blend@0.15 on the CPU (torch path):
  first-token KL and the largest logit difference, and the share of selected rows both picked.

Prints one line per check and exits non-zero if an invariant fails. On the CPU
it runs the same checks (the device engine and the CPU engine are then the same
path), which is how CI keeps this script working.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from blend.defaults import DEFAULT_RATIO
from blend.kernels.tolerances import TOL
from blend.engine import Engine
from blend.evals.metrics import kl_divergence
from blend.policy import ReusePolicy
from blend.tiny import make_docs
from blend import safeio

EXACT_SALT = "device-check-exact"
RATIO_ONE_ATOL = TOL[torch.float32].logits  # fp32 logits, as the quality gate's ratio-1.0 check



@dataclass(frozen=True)
class DeviceCheck:
    name: str
    ok: bool
    value: float
    detail: str


def _kernel_backend(device: str) -> str:
    from blend.kernels import kernel_backend

    return kernel_backend(torch.empty(0, device=device)).value


def run_checks(device: str, model: str = "tiny-llama", prompts: int = 3) -> list[DeviceCheck]:
    """Every check on ``prompts`` prompts of five pseudo-documents.

    Args:
        device: where the engine under test runs (``cuda``, ``cpu``).
        model: a tiny model name (random weights built locally).
        prompts: how many prompts.

    Returns:
        One :class:`DeviceCheck` per check and prompt.
    """
    dev = Engine.load(model, device=device, quality_gate=False)
    cpu = Engine.load(model, device="cpu", quality_gate=False)
    out: list[DeviceCheck] = []
    for i in range(prompts):
        docs, question = make_docs(5, 60, seed=i), f"Which word comes first in document {i % 5}?"
        p_dev, p_cpu = dev.build_prompt(question, docs), cpu.build_prompt(question, docs)
        exact = ReusePolicy.exact(cache_salt=EXACT_SALT)  # its entries must not turn the blends below exact
        cold = dev.generate(p_dev, exact, max_new_tokens=4)
        warm = dev.generate(p_dev, exact, max_new_tokens=4)
        same = torch.equal(cold.first_logits, warm.first_logits) and cold.token_ids == warm.token_ids
        out.append(DeviceCheck(f"prompt {i}: exact warm == cold", same, 0.0 if same else 1.0,
                               f"{len(p_dev)} tokens"))
        full = dev.generate(p_dev, ReusePolicy.none(), max_new_tokens=1)
        one = dev.generate(p_dev, ReusePolicy.blend(ratio=1.0), max_new_tokens=1)
        diff = float((one.first_logits - full.first_logits).abs().max())
        out.append(DeviceCheck(f"prompt {i}: blend@1.0 == full prefill", diff <= RATIO_ONE_ATOL, diff,
                               f"max |logit diff|, bound {RATIO_ONE_ATOL}"))
        policy = ReusePolicy.blend(ratio=DEFAULT_RATIO)
        b_dev, b_cpu = dev.generate(p_dev, policy, max_new_tokens=1), cpu.generate(p_cpu, policy, max_new_tokens=1)
        kl = float(kl_divergence(b_cpu.first_logits.cpu(), b_dev.first_logits.cpu()))
        ldiff = float((b_dev.first_logits.cpu() - b_cpu.first_logits.cpu()).abs().max())
        picked = [set(s.recomputed_offsets) for s in b_dev.report.segments]
        picked_cpu = [set(s.recomputed_offsets) for s in b_cpu.report.segments]
        both = sum(len(a & b) for a, b in zip(picked, picked_cpu))
        total = max(1, sum(len(b) for b in picked_cpu))
        out.append(DeviceCheck(f"prompt {i}: blend@{DEFAULT_RATIO} {device} vs cpu", kl <= 1e-3, kl,
                               f"KL(cpu || {device}); max |logit diff| {ldiff:.2e}; "
                               f"selected rows in common {both}/{total}"))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m blend.evals.check_device", description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    checks = run_checks(args.device, args.model, args.prompts)
    engine_backend = _kernel_backend(args.device)
    for c in checks:
        print(f"{'ok  ' if c.ok else 'FAIL'} {c.name}: {c.value:.3g} ({c.detail})")
    print(f"kernel backend on {args.device}: {engine_backend}; {time.perf_counter() - t0:.1f} s")
    if args.json:
        safeio.atomic_write_text(args.json, json.dumps({"device": args.device, "backend": engine_backend,
                                         "torch": torch.__version__,
                                         "checks": [asdict(c) for c in checks]}, indent=1))
    return 0 if all(c.ok for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
