"""The blend's attention per query-key pair against the full prefill's, at ~6k tokens (issue 18).

Captures the query and key positions a real default blend (SmolLM2 fp32, musique item 0, 10 passages)
attends at after its check layer, then times, on random q/K/V of those shapes, interleaved in one
process:
- the blend's attention as the engine runs it (``sparse_query_attention_blocked``, its default plan);
- the same call with fewer or more query blocks;
- the blocks regrouped as a staircase (the keys every later block sees, attended by all of them in one
  call: larger query tiles, more merges);
- the full prefill's causal attention over all rows;
- torch's CPU flash op on rectangles of 204 to 2,847 grouped query rows (its rate per pair by tile size).

    OMP_NUM_THREADS=2 python docs/results/issue18/attention_per_pair/per_pair.py > per_pair.txt
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

import blend.blending as blending
import blend.kernels.query_blocks as query_blocks
from blend.defaults import DEFAULT_EVAL_DATA, DEFAULT_MODEL
from blend.engine import Engine
from blend.evals.bench_phases import SIZES, size_prompts
from blend.evals.methods import parse_methods
from blend.kernels.suffix_attention import flash
from blend.store.memory import MemoryStore

REPEATS = 7


def median_s(fn, repeats: int = REPEATS) -> float:
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def captured_positions() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(q_pos, k_pos) of every blocked attention plan a default blend makes at ~6k tokens."""
    engine = Engine.load(DEFAULT_MODEL, dtype="float32", store=MemoryStore(), quality_gate=False)
    prompt = size_prompts(engine, DEFAULT_EVAL_DATA, range(0, 1), SIZES["6k"])[0]
    policy = parse_methods("blend@0.15")[-1].policy()
    engine.precompute(prompt, policy)
    got, plan = [], blending.plan_query_blocks

    def capture(q_pos, k_pos, *a, **kw):
        got.append((q_pos.clone(), k_pos.clone()))
        return plan(q_pos, k_pos, *a, **kw)

    blending.plan_query_blocks = capture
    engine.generate(prompt, policy, max_new_tokens=1)
    blending.plan_query_blocks = plan
    return got


def merge(o1, l1, o2, l2):
    m = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    return (o1 * w1[..., None] + o2 * w2[..., None]) / (w1 + w2)[..., None], m + torch.log(w1 + w2)


def staircase(q, k, v, q_pos, k_pos, scale, cuts: int):
    """The default plan's blocks, their shared key prefixes cut at ``cuts`` block starts: keys
    [c_j-1, c_j) run once for every query of the blocks at or after the cut (one call), the rest of a
    block's prefix and its masked span per block; partial results merge by log-sum-exp."""
    hq, s, d = q.shape
    hkv = k.shape[0]
    g = hq // hkv
    plan = query_blocks.plan_query_blocks(q_pos, k_pos, hq, hkv)
    blocks = plan.blocks
    picks = sorted({blocks[round(i * len(blocks) / (cuts + 1))].lo for i in range(1, cuts + 1)} - {0})
    q4 = q.view(hkv, g, s, d)
    acc_o = acc_l = None
    acc_start, prev, starts = 0, 0, []
    for c in picks:
        s0 = next(b.a for b in blocks if b.lo >= c)
        qs = q4[:, :, s0:].reshape(hkv, g * (s - s0), d)
        o, lse = flash(qs[None], k[None, :, prev:c], v[None, :, prev:c], scale=scale)
        o, lse = o[0].view(hkv, g, s - s0, d), lse[0].view(hkv, g, s - s0)
        if acc_o is None:
            acc_o, acc_l, acc_start = o, lse, s0
        else:
            sh = s0 - acc_start
            no, nl = merge(acc_o[:, :, sh:], acc_l[:, :, sh:], o, lse)
            acc_o, acc_l = torch.cat([acc_o[:, :, :sh], no], 2), torch.cat([acc_l[:, :, :sh], nl], 2)
        prev = c
        starts.append((c, s0))
    out = torch.empty(hq, s, d)
    for b in blocks:
        cb = max([c for c, s0 in starts if b.a >= s0], default=0)
        qb = q4[:, :, b.a:b.b].reshape(hkv, g * (b.b - b.a), d)
        parts = []
        if cb:
            sl = slice(b.a - acc_start, b.b - acc_start)
            parts.append((acc_o[:, :, sl].reshape(1, hkv, -1, d), acc_l[:, :, sl].reshape(1, hkv, -1)))
        lo = b.lo if b.lo - cb >= query_blocks.SPLIT_MIN_PREFIX else cb
        if lo > cb:
            parts.append(flash(qb[None], k[None, :, cb:lo], v[None, :, cb:lo], scale=scale))
        if b.tb > lo:
            vis = k_pos[None, lo:b.tb] <= q_pos[b.a:b.b, None]
            mask = torch.zeros(vis.shape).masked_fill_(~vis, float("-inf")).repeat(g, 1)[None, None]
            none = (torch.searchsorted(k_pos, q_pos[b.a:b.b], right=True) == lo).repeat(g)
            o, lse = flash(qb[None], k[None, :, lo:b.tb], v[None, :, lo:b.tb], attn_mask=mask, scale=scale)
            parts.append((o, lse.masked_fill(none, float("-inf"))))
        o, lse = parts[0]
        for o2, l2 in parts[1:]:
            o, lse = merge(o.float(), lse, o2.float(), l2)
        out.view(hkv, g, s, d)[:, :, b.a:b.b] = o[0].view(hkv, g, b.b - b.a, d)
    return out


def main() -> None:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    torch.manual_seed(0)
    for q_pos, k_pos in captured_positions():
        s, t = q_pos.numel(), k_pos.numel()
        q, k, v = torch.randn(9, s, 64), torch.randn(3, t, 64), torch.randn(3, t, 64)
        qf = torch.randn(9, t, 64)
        default = query_blocks.plan_query_blocks(q_pos, k_pos, 9, 3)
        want = query_blocks.sparse_query_attention_blocked(q, q_pos, k, v, k_pos, 0.125, plan=default)
        pairs = int(torch.searchsorted(k_pos, q_pos, right=True).sum())
        full_pairs = t * (t + 1) // 2
        runs = {"engine's plan (%d blocks)" % len(default.blocks):
                lambda: query_blocks.sparse_query_attention_blocked(q, q_pos, k, v, k_pos, 0.125, plan=default)}
        for n in (3, 6):
            p = query_blocks.plan_query_blocks(q_pos, k_pos, 9, 3, n)
            runs[f"{n} blocks"] = lambda p=p: query_blocks.sparse_query_attention_blocked(q, q_pos, k, v, k_pos, 0.125, plan=p)
        for c in (2, 4, 6):
            runs[f"staircase, {c} cuts"] = lambda c=c: staircase(q, k, v, q_pos, k_pos, 0.125, c)
        runs["full prefill, causal"] = lambda: F.scaled_dot_product_attention(
            qf[None], k[None], v[None], is_causal=True, scale=0.125, enable_gqa=True)
        times = {name: [] for name in runs}
        for _ in range(REPEATS):  # interleaved
            for name, fn in runs.items():
                times[name].append(median_s(fn, 1))
        full_ns = statistics.median(times["full prefill, causal"]) / full_pairs * 1e9
        print(f"\n{s} queries over {t} keys: {pairs / full_pairs:.3f} of the full prefill's pairs "
              f"(full prefill {full_ns:.2f} ns per pair, 9 query heads)")
        for name, ts in times.items():
            sec = statistics.median(ts)
            n = full_pairs if name.startswith("full") else pairs
            diff = "" if name.startswith("full") or name.startswith("engine") else \
                f"  max diff {(runs[name]() - want).abs().max().item():.1e}" if "staircase" in name else ""
            print(f"  {name:28s} {sec * 1e3:7.1f} ms  {sec / n * 1e9 / full_ns:5.2f}x the full prefill per pair{diff}")
    print("\nthe CPU flash op on rectangles (3 KV heads, grouped query rows x 4,096 keys):")
    k, v = torch.randn(1, 3, 4096, 64), torch.randn(1, 3, 4096, 64)
    for rows in (204, 384, 768, 1024, 2847):
        q = torch.randn(1, 3, rows, 64)
        sec = median_s(lambda: flash(q, k, v, scale=0.125))
        print(f"  {rows:5d} rows: {sec * 1e9 / (rows * 4096):.2f} ns per grouped row and key")


if __name__ == "__main__":
    main()
