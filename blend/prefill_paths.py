"""The prefill paths the engine dispatches to, and the near-tie guard.

:meth:`blend.engine.Engine.prefill` decides refusals and times the request; it then runs one of:

- :func:`prefill_unreused`: no reuse (asked for, or refused): the exact schedule with the store off;
- :func:`prefill_segments`: exact reuse, segment by segment (a hot prefix attached, not loaded);
- :func:`prefill_blended`: a blended prefill (:func:`blend.blending.prefill_blend`), which
  :func:`guard` may send back for recompute when its first token is a near tie.

Each fills the request's cache and returns a :class:`~blend.prefilled.Prefilled`; none of them
touches a report or a clock.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from blend.blending import prefill_blend, widen_blend
from blend.keys import key_hex
from blend.kvcache import KVCache
from blend.model import ModelRunner
from blend.policy import ReuseMode, ReusePolicy
from blend.prefilled import Prefilled, document_rows, keep_first_pass_misses, report_ratio, with_forced
from blend.prefix_cache import attach_hot, remember_hot
from blend.probe import top2_margin
from blend.prompt import Prompt, SegmentKind
from blend.report import ReuseClass, SegmentReport
from blend.rope import RopeTables
from blend.segment_values import prefix_namespaces
from blend.segments import SegmentCache


# The guard's exact recompute reuses the preamble and the first document: both sit where their
# stored KV was computed (the first document's canonical chunk is its exact KV there). The rest is
# computed in one pass and not stored: exact-prefix entries would make every later blend of this order
# (another policy's, an evaluation's other methods) an exact hit.
GUARD_PREFIX_SEGMENTS = 2


def length_dependent(rope: RopeTables, prompt: Prompt) -> bool:
    """Dynamic-NTK RoPE past its trained length: every row's KV depends on the prompt's
    length, so the prompt is computed in one pass (and nothing is reused or stored).

    Args:
        rope: the model's RoPE tables.
        prompt: the request's prompt.

    Returns:
        Whether the prompt is longer than the tables' length-independent range.
    """
    past = rope.length_dependent_after
    return past is not None and len(prompt) > past


def prefill_unreused(runner: ModelRunner, segments: SegmentCache, prompt: Prompt, cache: KVCache, refused: str = "",
                     kinds: frozenset[SegmentKind] = frozenset()) -> Prefilled:
    """No reuse (asked for, or refused): the exact schedule with the store off, so it is
    bit-identical to an exact run; one pass where dynamic NTK makes KV length-dependent.
    Segments of ``kinds`` are reported as fallback when reuse was ``refused``.

    Args:
        runner: the model; segments: the engine's segment cache (its store unused here).
        prompt: the request's prompt; cache: the request's empty cache, filled here.
        refused: why reuse was refused ("" if it was not asked for).
        kinds: the segment kinds reported as fallback when ``refused``.

    Returns:
        The prefill's logits and segment rows.
    """
    if length_dependent(runner.rope, prompt):
        logits, rows = segments.compute_rest(cache, prompt.segments)
        done = Prefilled(logits, rows, ReuseMode.NONE)
    else:
        done = prefill_segments(segments, prompt, None, False, cache)
    if not refused:
        return done
    rows = tuple(replace(r, reuse_class=ReuseClass.FALLBACK, note=refused) if r.kind in kinds else r
                 for r in done.segments)
    return replace(done, segments=rows)


def prefill_segments(segments: SegmentCache, prompt: Prompt, prefix_limit: int | None, use_store: bool,
                     cache: KVCache, salt: str = "") -> Prefilled:
    """Segment by segment: each segment but the question is looked up, else computed and
    stored (exact reuse); without the store, the same schedule computes every segment.

    Args:
        segments: the engine's segment cache.
        prompt: the request's prompt.
        prefix_limit: reuse at most this many leading segments (None: every segment but the question).
        use_store: look segments up and store them (False: compute every one).
        cache: the request's cache, filled here.
        salt: the request's cache salt.

    Returns:
        The prefill's logits, segment rows and lookup seconds (applied: exact, or none without the store).
    """
    applied = ReuseMode.EXACT if use_store else ReuseMode.NONE
    cacheable = prompt.segments[:-1]
    if prefix_limit is not None:
        cacheable = cacheable[:prefix_limit]
    whole = len(cacheable) == len(prompt.segments) - 1  # the whole prefix: a conversation's turns too
    if use_store and whole:
        hot = attach_hot(segments, cache, cacheable, prompt.question, salt)
        if hot is not None:  # a prefix found stored again: attached, not loaded (the same rows)
            logits, tail, _ = segments.compute_question(cache, cacheable, prompt.question, True, salt,
                                                        attached=True)
            return Prefilled(logits, (*hot, *tail), applied, 0.0)
    keys = (segments.prefix_keys(cacheable, salt) if use_store
            else [(ns, None) for ns in prefix_namespaces(cacheable)])
    rows, lookup_s, start = [], 0.0, cache.length
    for seg, (_, key), done in zip(cacheable, keys, segments.append_run(cache, cacheable, keys)):
        rows.append(SegmentReport(seg.kind, done.reuse_class, len(seg), start, key_hex(key) if key else "",
                                  note=done.note))
        lookup_s += done.lookup_s
        start += len(seg)
    if whole:
        logits, tail, waited = segments.compute_question(cache, cacheable, prompt.question, use_store, salt)
        if use_store:
            remember_hot(segments, cache, cacheable, prompt.question, (*rows, *tail), salt)
        return Prefilled(logits, (*rows, *tail), applied, lookup_s + waited)
    # Everything after the reusable prefix (the question included) is one block:
    # one causal pass is cheaper than segment-by-segment masked attention.
    logits, tail = segments.compute_rest(cache, prompt.segments[len(cacheable):])
    return Prefilled(logits, (*rows, *tail), applied, lookup_s)


def prefill_blended(runner: ModelRunner, segments: SegmentCache, prompt: Prompt, policy: ReusePolicy, cache: KVCache,
                    question: bool = True) -> Prefilled:
    """A blended prefill into ``cache`` (see :func:`~blend.blending.prefill_blend`).

    Args:
        runner: the model; segments: the engine's segment cache.
        prompt, policy: the request's.
        cache: the request's cache, filled here.
        question: False: the question's rows stop after the check layer (see
            :meth:`blend.engine.Engine.prefill`).

    Returns:
        The blend as a :class:`~blend.prefilled.Prefilled` (its resume point kept for :func:`guard`).
    """
    out = prefill_blend(runner, segments, prompt, policy, cache, question=question)
    return Prefilled(out.logits, out.segments, out.applied, out.lookup_s, out.deviation, out.ratio,
                     approximate=out.approximate, resume=out.resume, check_rows=out.check_rows)


def guard(runner: ModelRunner, segments: SegmentCache, prompt: Prompt, policy: ReusePolicy, done: Prefilled,
          cache: KVCache) -> tuple[Prefilled, KVCache]:
    """The near-tie guard: a blend whose first token is a near tie is recomputed.

    Args:
        runner: the model; segments: the engine's segment cache.
        prompt, policy: the request's.
        done: the blend (:func:`prefill_blended`); cache: the cache it filled.

    Returns:
        The result to answer from (``done`` with its first-token gap, or the recompute's) and its cache.
    """
    if done.logits is None:  # the caller computes the question (and so its first token) itself
        return done, cache
    margin = top2_margin(done.logits)
    # decided by what the blend computed, not by where its KV came from: a cold request (chunks computed
    # canonically, then blended) guards exactly where the warm one does, so cold == warm holds
    if not policy.guarded or not done.approximate or margin >= policy.guard_margin:
        return replace(done, margin=margin, resume=None), cache
    # what the blend spent: the share an adaptive budget or a threshold selected, or the fixed ratio
    # (forced rows counted)
    spent = report_ratio(done, policy)
    _, base = document_rows(done.segments)  # the budget's rows
    target = policy.guard_ratio_for(spent, base)
    why = f"first-token gap {margin:.3g} < {policy.guard_margin:g} nats: recomputed at ratio {target:g}"
    if done.resume is not None and policy.guard_widens(target):  # on from the first pass's check layer
        out = widen_blend(runner, done.resume, cache, target)
        why += f" ({policy.guard_mode.value}: from check layer {done.resume.at.layer}"
        rows, _ = document_rows(out.segments)
        if rows < round(target * base):  # the candidates, sized before rounding, held fewer rows
            why += f", its candidates only {out.ratio:.3g} of the document rows"
        why += ")"
        return replace(done, logits=out.logits, segments=out.segments, deviation=out.deviation,
                       ratio=out.ratio, spent=spent + with_forced(out.segments, out.ratio), margin=margin,
                       guard=why, approximate=out.approximate, resume=None, check_rows=out.check_rows), cache
    with torch.inference_mode(False):  # a normal tensor, as the first cache: decoding writes it later
        again = runner.new_cache(cache.capacity)
    if target >= 1.0:  # the exact path: preamble and first document reused (both exact
        # there, the blend just fetched them), the rest computed, nothing else stored
        redo = prefill_segments(segments, prompt, GUARD_PREFIX_SEGMENTS, True, again, policy.cache_salt)
    else:  # a fixed ratio: the recompute reports a share of its own only where it had fewer rows
        redo = prefill_blended(runner, segments, prompt, policy.at_guard_ratio(target), again)
    share = target if redo.ratio is None else redo.ratio  # what the recompute recomputed
    reports = keep_first_pass_misses(done.segments, redo.segments)
    return replace(redo, segments=reports, lookup_s=done.lookup_s + redo.lookup_s, ratio=share,
                   spent=spent + with_forced(reports, share), margin=margin, guard=why, resume=None), again
