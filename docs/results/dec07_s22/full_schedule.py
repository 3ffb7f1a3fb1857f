"""Full prefill as the benches time it (ReusePolicy.none(): the exact path's segment-by-segment schedule)
against the engine's own one-pass causal prefill of the same prompt (compute_rest over every segment)."""
import statistics, sys, time, torch
from blend.engine import Engine
from blend.policy import ReusePolicy
from blend.evals.bench_phases import SIZES, size_prompts
size = sys.argv[1] if len(sys.argv) > 1 else "600"
eng = Engine.load("smollm2-135m", quality_gate=False)
prompts = size_prompts(eng, "../shared/data/musique_dev.json", range(0, 2), SIZES[size])
def none(p):
    return eng.generate(p, ReusePolicy.none(), max_new_tokens=1)
def one_pass(p):
    t0 = time.perf_counter()
    cache = eng.runner.new_cache(len(p) + 1)
    with torch.inference_mode():
        logits, _ = eng.segments.compute_rest(cache, p.segments)
    return time.perf_counter() - t0, logits
for p in prompts:
    none(p); one_pass(p)  # warm-up
a, b = [], []
for r in range(int(sys.argv[2]) if len(sys.argv) > 2 else 3):
    for p in prompts:
        ans = none(p); a.append(ans.ttft_s)
        t, lg = one_pass(p); b.append(t)
        assert torch.allclose(ans.first_logits, lg, atol=1e-3), (ans.first_logits - lg).abs().max()
print(f"size {size}: tokens {[len(p) for p in prompts]} none (segment schedule) median {statistics.median(a)*1e3:.0f} ms;"
      f" one causal pass {statistics.median(b)*1e3:.0f} ms; ratio {statistics.median(x/y for x, y in zip(a, b)):.3f}")
# transformers' own forward on the same ids, interleaved with both
hf = eng.runner.loaded.model
c, a2, b2 = [], [], []
with torch.inference_mode():
    for r in range(int(sys.argv[2]) if len(sys.argv) > 2 else 3):
        for p in prompts:
            ids = torch.tensor(p.token_ids)[None]
            t0 = time.perf_counter(); hf(ids, use_cache=False, logits_to_keep=1); c.append(time.perf_counter() - t0)
            a2.append(none(p).ttft_s); b2.append(one_pass(p)[0])
print(f"  interleaved again: none {statistics.median(a2)*1e3:.0f} ms, one pass {statistics.median(b2)*1e3:.0f} ms, "
      f"transformers forward {statistics.median(c)*1e3:.0f} ms")
