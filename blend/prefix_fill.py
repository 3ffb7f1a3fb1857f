"""The exact KV of a document order, filled in a segment at a time.

A blend re-positions canonical chunk KV and recomputes a few rows of it. The exact KV
of the same documents in the same order (what a full prefill computes) is what turns a
later request with that order into the exact path: a ``take_exact`` blend takes the exact prefix
it finds (:func:`blend.blend_fetch.exact_run`), bit for bit what a full prefill
gives, at an exact hit's cost. Computing it is a prefill of the whole prefix, too long
to run while requests wait, so :class:`PrefixFill` cuts it at segment boundaries::

    step 1: preamble (a hit) + document 1 (canonical: a hit) + document 2 computed, stored
    step 2:                                   document 3 computed, stored
    ...                                       done: every document has its exact-prefix entry

Each :meth:`PrefixFill.step` computes at most one segment and stores it under the key an
exact request would (:meth:`~blend.segments.SegmentCache.prefix_keys`, the same program as
the exact path, so the entries are those an exact request writes); segments already
stored are loaded. The server runs steps on an idle prefill worker
(:mod:`blend.serve.refine`).
"""

from __future__ import annotations

from typing import Sequence

import torch

from blend.keys import Namespace, StoreKey
from blend.kvcache import KVCache
from blend.prompt import Prompt, Segment
from blend.report import ReuseClass
from blend.segments import SegmentCache


def order_segments(prompt: Prompt) -> tuple[Segment, ...]:
    """The segments whose exact KV makes a blend of ``prompt`` exact: preamble and documents, in order.

    Args:
        prompt: the request's prompt.

    Returns:
        The preamble, then every document in prompt order.
    """
    return (prompt.preamble, *prompt.documents)


class PrefixFill:
    """Computes and stores the exact-prefix KV of one document order, a segment per step.

    Args:
        segments: the engine's segment cache (store, provenance, model).
        prefix: preamble and documents in prompt order (:func:`order_segments`).
        salt: the requests' cache salt (part of every key).
    """

    def __init__(self, segments: SegmentCache, prefix: Sequence[Segment], salt: str = "") -> None:
        if len(prefix) < 2:
            raise ValueError("a prefix to fill needs a preamble and at least one document")
        self._segments = segments
        self.prefix = tuple(prefix)
        self.salt = salt
        # the order's identity: the last segment's exact-prefix key commits to every token before it
        self.key: StoreKey = segments.exact_keys(self.prefix, salt)[-1]
        self._keys: list[tuple[Namespace, StoreKey]] | None = None  # where each segment goes: at the first step
        self._cache: KVCache | None = None  # the prefix so far; freed when done
        self._next = 0  # index of the next segment to append
        self.computed = 0  # segments this fill computed (the others were stored already)

    @property
    def done(self) -> bool:
        return self._next >= len(self.prefix)

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.prefix)

    def step(self) -> bool:
        """Append segments until one was computed (and stored) or the prefix is complete.

        Returns:
            True when the prefix is complete (every segment stored under its exact key).
        """
        if self._keys is None:  # a fill is built for every sighting of an order, run for few of them
            self._keys = self._segments.prefix_keys(self.prefix, self.salt)
        with torch.inference_mode():
            if self._cache is None and not self.done:
                self._cache = self._segments.model.new_cache(self.tokens)
            while not self.done:
                ns, key = self._keys[self._next]
                try:
                    got = self._segments.append_exact(self._cache, self.prefix[self._next], key, ns)
                except BaseException:
                    # the segment may be in the cache already (a failed put after it was appended): a retry
                    # would append it twice and store what follows, computed after the duplicate, under
                    # exact keys. Start over instead: what was stored before is found again.
                    self._cache, self._next = None, 0
                    raise
                self._next += 1
                if got.reuse_class is not ReuseClass.EXACT:  # computed (a miss or an unusable entry)
                    self.computed += 1
                    break
        if self.done:
            self._cache = None
        return self.done

    def run(self) -> int:
        """Fill the whole prefix now.

        Returns:
            Segments computed (0: it was stored already).
        """
        while not self.step():
            pass
        return self.computed
