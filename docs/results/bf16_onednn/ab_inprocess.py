"""In-process A/B of a bfloat16 engine's linear layers: F.linear (before) vs oneDNN over packed weights.

Two bf16 SmolLM2 engines in one process, `--gemm torch` and `--gemm onednn` (what `auto` now picks on a
CPU with native bf16), interleaved per prompt and repeat (order alternating), plus the float32 engine's
full prefill of the same prompt as the common reference. Per prompt size (bench_phases' ~600 and ~3k
musique prompts, items 0-2): full prefill TTFT, blend@0.15 TTFT (bench_phases' method: the default
policy, near-tie guard on), and the decode steps of a 32-token greedy answer (ms per token after the
first). Chunk KV is precomputed, so blends read every document from the memory store.

    OMP_NUM_THREADS=2 .venv/bin/python docs/results/bf16_onednn/ab_inprocess.py [REPEATS] > OUT.txt
"""
import statistics
import sys
import time

import torch

from blend.defaults import DEFAULT_MODEL
from blend.engine import Engine
from blend.defaults import DEFAULT_EVAL_DATA
from blend.evals.bench_phases import SIZES, size_prompts
from blend.evals.environment import describe_environment
from blend.evals.methods import parse_methods
from blend.policy import ReusePolicy
from blend.store.memory import MemoryStore

REPEATS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
DECODE_TOKENS = 32
FULL = ReusePolicy.none()
BLEND = next(m for m in parse_methods("blend@0.15") if m.name == "blend@0.15").policy()  # (parse_methods puts full first)


def decode_ms_per_token(engine: Engine, prompt) -> float:
    """Milliseconds per decode step of a DECODE_TOKENS-token greedy answer (its prefill excluded)."""
    t0 = time.perf_counter()
    # under a salt of its own: this order's exact prefix must not be found by the blend requests (they would
    # take the exact path)
    ans = engine.generate(prompt, ReusePolicy.exact(cache_salt="ab-decode"), max_new_tokens=DECODE_TOKENS,
                          stop_at_newline=False)
    total = time.perf_counter() - t0
    steps = len(ans.token_ids) - 1
    return (total - ans.ttft_s) / steps * 1e3 if steps > 0 else float("nan")


def main() -> None:
    engines = {g: Engine.load(DEFAULT_MODEL, dtype="bfloat16", store=MemoryStore(), quality_gate=False, gemm=g)
               for g in ("torch", "onednn")}
    fp32 = Engine.load(DEFAULT_MODEL, dtype="float32", store=MemoryStore(), quality_gate=False)
    print(describe_environment(fp32.device), flush=True)
    print(f"threads {torch.get_num_threads()}, repeats {REPEATS}, items 0-2, gemm {[e.runner.gemm.value for e in engines.values()]}")
    for size in ("600", "3k"):
        prompts = size_prompts(fp32, DEFAULT_EVAL_DATA, range(0, 3), SIZES[size])
        got: dict[str, list[float]] = {}
        for p in prompts:
            for e in engines.values():
                e.precompute(p, BLEND)
                e.generate(p, BLEND, max_new_tokens=1)
                e.generate(p, FULL, max_new_tokens=1)
            fp32.generate(p, FULL, max_new_tokens=1)
            for r in range(REPEATS):
                ref = fp32.generate(p, FULL, max_new_tokens=1).ttft_s
                order = list(engines.items()) if r % 2 == 0 else list(engines.items())[::-1]
                for g, e in order:
                    full = e.generate(p, FULL, max_new_tokens=1).ttft_s
                    blend = e.generate(p, BLEND, max_new_tokens=1).ttft_s
                    got.setdefault(f"{g} full ms", []).append(full * 1e3)
                    got.setdefault(f"{g} blend ms", []).append(blend * 1e3)
                    got.setdefault(f"{g} blend / own full", []).append(blend / full)
                    got.setdefault(f"{g} blend / fp32 full", []).append(blend / ref)
                    got.setdefault(f"{g} full / fp32 full", []).append(full / ref)
                    got.setdefault(f"{g} decode ms/token", []).append(decode_ms_per_token(e, p))
                got.setdefault("fp32 full ms", []).append(ref * 1e3)
        print(f"\nsize {size} ({int(statistics.median(len(p) for p in prompts))} tokens), medians over "
              f"{len(prompts)} items x {REPEATS}:")
        for k in sorted(got):
            print(f"  {k:24s} {statistics.median(got[k]):9.3f}")
        for k in ("full ms", "blend ms", "decode ms/token"):
            pairs = [b / a for a, b in zip(got[f"torch {k}"], got[f"onednn {k}"])]
            print(f"  onednn / torch, {k:16s} {statistics.median(pairs):.3f} (paired median)")


if __name__ == "__main__":
    main()
