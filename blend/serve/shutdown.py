"""How a stopping server ends its requests (SIGTERM, Ctrl-C).

uvicorn stops in this order: it closes its listeners, waits up to
``timeout_graceful_shutdown`` for running requests, cancels the ones left,
and only then runs the app's lifespan shutdown, which closes the scheduler.
By then every unfinished request's handler was cancelled: a stream was cut
without an error event or ``[DONE]``, a queued request got uvicorn's plain
500, and the scheduler's ``shutting_down`` 503 reached nobody.

:class:`DrainingServer` acts first:

- at the signal, the scheduler drains (:meth:`Scheduler.drain`): queued
  requests get a 503 ``shutting_down`` at once (another replica may answer
  them), and so does any request arriving on a connection still open;
- running requests get the grace period to finish;
- ``margin_s`` before uvicorn would cancel them, the scheduler closes: each
  request still running gets its 503, or an error event and ``[DONE]`` in its
  stream, while its handler can still send them.
"""

from __future__ import annotations

import asyncio
import socket

import uvicorn

from blend.defaults import DEFAULT_SHUTDOWN_MARGIN_S
from blend.serve.scheduler import Scheduler


class DrainingServer(uvicorn.Server):
    """uvicorn's server, ending the scheduler's requests before uvicorn cancels their handlers.

    Args:
        config: uvicorn's config (its ``timeout_graceful_shutdown`` is the grace period; None: no limit).
        scheduler: the app's scheduler.
        margin_s: how long before the grace period ends the scheduler closes.
    """

    def __init__(self, config: uvicorn.Config, scheduler: Scheduler, margin_s: float = DEFAULT_SHUTDOWN_MARGIN_S):
        super().__init__(config)
        self.scheduler = scheduler
        self.margin_s = margin_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.scheduler.drain()
        grace = self.config.timeout_graceful_shutdown
        loop = asyncio.get_running_loop()
        closing: list[asyncio.Future] = []
        timer = None
        if grace is not None:  # close in a thread: it joins the scheduler's threads, the loop must go on
            timer = loop.call_later(max(0.0, grace - self.margin_s),
                                    lambda: closing.append(loop.run_in_executor(None, self.scheduler.close)))
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()
            for f in closing:
                await f
