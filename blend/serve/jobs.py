"""A request inside the scheduler: its job, the events its client receives, its handle, how it ended,
and the errors that refuse it."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

import torch

from blend.errors import KVBlendError
from blend.generation import Completion, TokenStream
from blend.kvcache import KVCache
from blend.logprobs import TokenLogprob
from blend.policy import ReusePolicy
from blend.prompt import Prompt
from blend.report import ReuseReport
from blend.sampling import GenerationConfig


class QueueFullError(KVBlendError):
    """Every slot and queue place is taken; retry after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ShuttingDownError(RuntimeError):
    """The scheduler stopped (or is stopping) before the request could finish: the server's 503."""

    def __init__(self, message: str = "server shutting down") -> None:
        super().__init__(message)


class EventKind(Enum):
    """What an :class:`Event` tells a request's client."""

    STARTED = "started"  # prefill done: report, TTFT and the first text
    TEXT = "text"  # more text
    DONE = "done"  # finished: the completion
    FAILED = "failed"  # the request failed (error)


@dataclass(frozen=True)
class Event:
    """One thing a request's sink receives: its first text with the report and TTFT, more text, its
    completion, or its error (which fields are set follows ``kind``)."""

    kind: EventKind
    text: str = ""
    report: ReuseReport | None = None
    ttft_s: float = 0.0
    completion: Completion | None = None
    error: BaseException | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # answer tokens decided since the last event (streams' chunks)


Sink = Callable[[Event], None]  # must not block: called from the scheduler's threads


@dataclass(eq=False)
class SchedulerJob:
    """One request inside the scheduler: what it asked, where its events go, and its state as it runs."""

    id: int
    prompt: Prompt
    policy: ReusePolicy
    config: GenerationConfig
    sink: Sink
    submitted: float
    cancelled: threading.Event = field(default_factory=threading.Event)
    stream: TokenStream | None = None
    cache: KVCache | None = None
    first_logits: torch.Tensor | None = None
    report: ReuseReport | None = None
    ttft_s: float = 0.0
    retired: bool = False


class Ending(Enum):
    """How a request left the scheduler (which counter it adds to)."""

    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


class Ticket:
    """A submitted request's handle."""

    def __init__(self, job: SchedulerJob, cancel: Callable[[SchedulerJob], None]) -> None:
        """Args:
            job: the request.
            cancel: what :meth:`cancel` calls with it (the scheduler's ``cancel``).
        """
        self._job = job
        self._cancel = cancel

    @property
    def id(self) -> int:
        return self._job.id

    def cancel(self) -> None:
        """Stop the request (its client went away): a queued one leaves the queue now (its place is
        free for the next request), a running one the batch at the next step."""
        self._cancel(self._job)
