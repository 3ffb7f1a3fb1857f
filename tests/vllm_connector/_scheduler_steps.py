"""A stand-in for vLLM's SchedulerOutput: only the fields kvblend's connector reads (shared by the
connector tests that drive it step by step)."""

from __future__ import annotations

from types import SimpleNamespace


def scheduler_step(new=(), cached=(), scheduled=None) -> SimpleNamespace:
    """A scheduler output.

    Args:
        new: (req_id, block ids, computed tokens) of newly scheduled requests.
        cached: (req_id, new block ids or None, computed tokens, resumed) of running ones.
        scheduled: req_id -> tokens scheduled this step.

    Returns:
        The fake output.
    """
    cached = list(cached)
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(b,), num_computed_tokens=n) for r, b, n in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, *_ in cached], new_block_ids=[(b,) if b is not None else None for _, b, _, _ in cached],
            num_computed_tokens=[n for _, _, n, _ in cached],
            resumed_req_ids={r for r, _, _, resumed in cached if resumed}),
        num_scheduled_tokens=scheduled or {})
