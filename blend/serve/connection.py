"""The server's HTTP connections: uvicorn's h11 protocol with deadlines for a request's head and for a client
to take its response.

uvicorn times nothing out between a connection's opening and the end of its request's headers: a
client that opens a connection and sends nothing, or sends its headers a byte at a time, holds it for
as long as it likes (slowloris). ``--max-connections`` caps how many connections uvicorn holds, so a
few hundred such clients made every other request a 503. :class:`DeadlineProtocol` gives each
request's head (request line and headers) ``head_timeout_s`` from the moment the connection is ready
for it: opened, or done with the previous response (keep-alive). A head that has not arrived by then
ends the connection: with a 408 if some of it had arrived, silently if none had (as uvicorn closes an
idle keep-alive connection). A request answered before its body ended (a 401, 413 or the app's 408)
has as long from that answer for the rest of the body to arrive. The body has its own deadline
(``Limits.body_timeout_s``, in the app).

Nor does uvicorn time its writes: a client that stops reading but stays connected fills the socket's
buffers, and then a streamed response's next write waits for ever, and a finished response's last
bytes sit in the transport, whose close waits for them: the connection (its slot under
``--max-connections``, its buffers and the text queued for it) was held until the client left. While
the server waits for the client to take bytes (writes paused on full buffers, or a finished or closing
response's bytes still buffered), the client must take some within ``write_timeout_s``: each time the
buffered bytes go down the wait starts again, so a slow client that keeps reading is never cut (the
timeout is between two takes, as nginx's ``send_timeout``). One that takes nothing for that long has its
connection aborted (its buffered bytes dropped) and counted; a stream it was reading is cancelled as
any client's that leaves.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Callable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from blend.serve.config import Limits, ServeConfig

if TYPE_CHECKING:
    from blend.serve.metrics import ServeMetrics

_TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                     b"connection: close\r\ncontent-length: %d\r\n\r\n%s")
_TIMEOUT_BODY = b'{"error":{"message":"request headers not received in time","type":"invalid_request_error",' \
                b'"param":null,"code":"request_timeout"}}'


class DeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol; a request's head must arrive within ``head_timeout_s``, and a client the server
    waits on must take some of its response's bytes within ``write_timeout_s`` (class attributes, set by
    :func:`protocol_with_deadlines`; ``on_write_timeout`` is called for each connection that one closes)."""

    head_timeout_s: float = Limits.head_timeout_s
    write_timeout_s: float = Limits.write_timeout_s
    on_write_timeout: Callable[[], None] | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0  # bytes of the awaited head received so far
        self._write_timer: asyncio.TimerHandle | None = None
        self._write_buffered = 0  # bytes the transport held at the last look
        self._write_progress = 0.0  # loop time the client last took bytes (or the wait began)
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        if self._head_timer is None and self._waiting():  # a keep-alive connection's next request
            self._arm_head_timer()
        if self._head_timer is not None:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._head_timer is not None and not self._waiting():
            self._disarm_head_timer()
        elif self._head_timer is None and self._waiting():  # a body answered early just ended: the next head
            self._arm_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self._waiting():
            # the next request's head, if the client sends one; or the rest of a body the response came
            # before (a 401, 413 or 408): it must end by then too, or the connection does
            self._arm_head_timer(buffered=len(self.conn.trailing_data[0]))
        self._watch_writes()  # the response's last bytes may still wait for the client

    def pause_writing(self) -> None:
        super().pause_writing()  # the transport's buffer is full: the next write waits for the client
        self._watch_writes()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        if getattr(self, "_write_timer", None) is not None:
            self._write_timer.cancel()
            self._write_timer = None
        super().connection_lost(exc)

    def _awaiting_head(self) -> bool:
        """Whether the connection waits for a request's head: h11 has no request under way (the client
        is IDLE; a request whose headers arrived moves it on) and no response is being sent."""
        return self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete)

    def _draining(self) -> bool:
        """Whether a response is complete while its request's body is still arriving (answered early)."""
        return self.conn.their_state is h11.SEND_BODY and self.cycle is not None and self.cycle.response_complete

    def _waiting(self) -> bool:
        """Whether the client owes the connection something with no request being served: a head, or the
        rest of a body already answered."""
        return self._awaiting_head() or self._draining()

    def _arm_head_timer(self, buffered: int = 0) -> None:
        self._disarm_head_timer()
        self._head_bytes = buffered  # part of a pipelined head may already sit in h11's buffer
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        timer = getattr(self, "_head_timer", None)
        if timer is not None:
            timer.cancel()
        self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self._waiting():
            return
        if self._head_bytes and self._awaiting_head():  # part of a head arrived: say why the connection ends
            self.transport.write(_TIMEOUT_RESPONSE % (len(_TIMEOUT_BODY), _TIMEOUT_BODY))
        self.transport.close()  # (a body still arriving after its answer: that answer was the response)


    # ---- the client must take its response's bytes --------------------------------------------------------

    def _owed(self) -> int:
        """Bytes the connection waits for its client to take: what the transport holds while writes are paused,
        or once the response is finished (or the connection closing), when nothing more is written; else 0."""
        buffered = self.transport.get_write_buffer_size()
        waiting = (self.flow.write_paused or self.transport.is_closing() or self.cycle is None
                   or self.cycle.response_complete)
        return buffered if waiting else 0

    def _watch_writes(self) -> None:
        """Start (or start again: the buffer filled anew, so the client took bytes) the wait for the client."""
        buffered = self.transport.get_write_buffer_size()
        if not buffered:  # the socket took everything: nothing waits for the client
            return
        self._write_buffered = buffered
        self._write_progress = self.loop.time()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self._write_poll_s(), self._check_writes)

    def _write_poll_s(self) -> float:
        """How often a waiting connection looks whether its client took bytes: a quarter of the timeout, so a
        client is cut at most that long after the timeout from the last bytes it took."""
        return self.write_timeout_s / 4

    def _check_writes(self) -> None:
        self._write_timer = None
        owed = self._owed()
        if not owed:  # the client took everything, or the server writes again (a new wait starts at a pause)
            return
        now = self.loop.time()
        if owed != self._write_buffered:  # down: the client took bytes; up: a new response was written
            self._write_buffered, self._write_progress = owed, now
        elif now - self._write_progress >= self.write_timeout_s:
            self.transport.abort()  # close() would wait for the buffered bytes; connection_lost follows
            if self.on_write_timeout is not None:
                self.on_write_timeout()
            return
        wait = min(self._write_poll_s(), self._write_progress + self.write_timeout_s - now)
        self._write_timer = self.loop.call_later(max(wait, 0.0), self._check_writes)


def protocol_with_deadlines(head_timeout_s: float, write_timeout_s: float,
                            on_write_timeout: Callable[[], None] | None = None) -> Callable[..., asyncio.Protocol]:
    """The protocol class uvicorn's ``http=`` takes: :class:`DeadlineProtocol` with these deadlines.

    Args:
        head_timeout_s: seconds a request's head may take to arrive (> 0).
        write_timeout_s: seconds a client the server waits on may take none of its response's bytes (> 0).
        on_write_timeout: called for each connection closed for that (the server's metric), or None.

    Returns:
        A subclass of :class:`DeadlineProtocol` (one per setting, so servers in one process can differ).
    """
    if not (head_timeout_s > 0 and write_timeout_s > 0):
        raise ValueError(f"head and write timeouts must be > 0 seconds, not {head_timeout_s}, {write_timeout_s}")
    return type("DeadlineProtocol", (DeadlineProtocol,), {
        "head_timeout_s": float(head_timeout_s), "write_timeout_s": float(write_timeout_s),
        "on_write_timeout": None if on_write_timeout is None else staticmethod(on_write_timeout)})


def uvicorn_options(config: ServeConfig, metrics: "ServeMetrics | None" = None) -> dict[str, Any]:
    """The connection settings ``uvicorn.run``/``uvicorn.Config`` take for a server of ``config``: its
    address, the connection cap, the head and write deadlines (:class:`DeadlineProtocol`) and the graceful
    shutdown. ``kvblend serve`` and the tests' in-process servers both start from these.

    Args:
        config: the server's settings.
        metrics: the app's metrics, which count the connections the write deadline closes (None: uncounted).

    Returns:
        Keyword arguments for ``uvicorn.Config``.
    """
    limits = config.limits
    return {"host": config.host, "port": config.port, "timeout_graceful_shutdown": limits.graceful_shutdown_s,
            "limit_concurrency": limits.max_connections,
            "http": protocol_with_deadlines(limits.head_timeout_s, limits.write_timeout_s,
                                            None if metrics is None else metrics.on_write_timeout)}
