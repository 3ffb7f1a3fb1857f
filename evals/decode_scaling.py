"""Decode steps alone, as ``kvblend serve``'s decode loop runs them (bench_serve's ``decode_scaling``): one
batched step over each sequence's own cache, over slots of a decode pool, and split over two threads."""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from blend.batch_decode import decode_batch
from blend.decode_pool import DecodePool
from blend.engine import Engine
from blend.evals.demo_requests import demo_requests
from blend.policy import ReusePolicy


def split_step(runner, caches: list, tokens: list[int], helper: ThreadPoolExecutor) -> None:
    """One decode step as the server runs it with an idle prefill worker: the second half of the
    sequences on a helper thread (its own single intra-op thread), the first half here."""
    m = len(caches) - len(caches) // 2
    tail = helper.submit(decode_batch, runner, caches[m:], tokens[m:])
    decode_batch(runner, caches[:m], tokens[:m])
    tail.result()


def decode_scaling(model: str, batches: list[int], steps: int = 4) -> list[dict]:
    """Decode steps alone (no HTTP, no prefill beside them), as the server's decode loop runs them on its
    one intra-op thread: tokens/s of one batched step at each batch size over each sequence's own cache,
    over slots of a decode pool (the server's default), and split over two threads (a decode share),
    interleaved.

    Args:
        model: model name or path.
        batches: batch sizes.
        steps: timed steps per layout and batch size (the median is kept).

    Returns:
        One dict per batch size: step_ms / tok_per_s (own caches), pool_step_ms / pool_tok_per_s,
        split_step_ms / split_tok_per_s.
    """
    engine = Engine.load(model, quality_gate=False)
    reqs = demo_requests()
    d, runner = engine.runner.dims, engine.runner
    out = []
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(1, initializer=torch.set_num_threads, initargs=(1,)) as helper:
            for b in batches:
                def prefilled() -> list:
                    return [engine.prefill(engine.build_prompt(*reqs[i % len(reqs)]), ReusePolicy.exact(),
                                           3 * steps + 1)[1] for i in range(b)]
                caches = prefilled()
                pool = DecodePool(d.num_layers, d.num_kv_heads, d.head_dim, b, max(c.capacity for c in caches),
                                  runner.dtype, runner.device)
                slots = [pool.adopt(c) for c in prefilled()]
                toks = [engine.tokenizer.eos_token_id or 0] * b
                one, pooled, two = [], [], []
                for _ in range(steps):
                    for layout, times in ((caches, one), (slots, pooled)):
                        t0 = time.perf_counter()
                        decode_batch(runner, layout, toks)
                        times.append(time.perf_counter() - t0)
                    if b >= 2:
                        t0 = time.perf_counter()
                        split_step(runner, caches, toks, helper)
                        two.append(time.perf_counter() - t0)
                step, pool_step = statistics.median(one), statistics.median(pooled)
                split = statistics.median(two) if two else step
                out.append({"batch": b, "step_ms": step * 1000, "tok_per_s": b / step,
                            "pool_step_ms": pool_step * 1000, "pool_tok_per_s": b / pool_step,
                            "split_step_ms": split * 1000, "split_tok_per_s": b / split})
    finally:
        torch.set_num_threads(before)
    return out
