"""Intra-op thread counts of the scheduler's threads (torch's count is per calling thread)."""

from __future__ import annotations

import torch

from blend.batch_decode import DecodeBatching
from blend.serve.config import SchedulerConfig


def set_worker_threads(config: SchedulerConfig) -> None:
    """A prefill worker's count, set once on its own thread: ``torch_threads`` (None: torch's default).

    Args:
        config: the scheduler's settings.
    """
    if config.torch_threads is not None:
        torch.set_num_threads(config.torch_threads)


class LoopThreads:
    """The decode loop's intra-op thread count, which it changes between prefills and decode steps.

    Only the decode loop's thread uses one (each thread keeps its own count).

    Args:
        config: the scheduler's settings (``torch_threads``, ``idle_decode_threads``, batching).
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self._config = config
        self.current: int | None = None  # the count this thread runs with (None: torch's default, never set)

    def setup(self) -> None:
        """At the loop's start: the workers' count."""
        if self._config.torch_threads is not None:
            self._set(self._config.torch_threads)

    def for_prefill(self) -> None:
        """Before the loop runs a prefill: a prefill's numbers depend on its thread count, so it gets
        the workers' count (not ``idle_decode_threads``)."""
        if self._config.torch_threads is not None:
            self._set(self._config.torch_threads)

    def for_decode(self, prefilling: int) -> None:
        """Before a decode step: every core while no prefill runs (THROUGHPUT mode), else its own share.

        Args:
            prefilling: prefills running now on the workers.
        """
        cfg = self._config
        if (cfg.torch_threads is None or cfg.idle_decode_threads is None
                or cfg.batching is not DecodeBatching.THROUGHPUT):
            return
        self._set(cfg.idle_decode_threads if prefilling == 0 else cfg.torch_threads)

    def _set(self, want: int) -> None:
        if want != self.current:  # a no-op when it has it already
            torch.set_num_threads(want)
            self.current = want
