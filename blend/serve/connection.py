"""The server's HTTP connections: uvicorn's h11 protocol with a deadline for a request's head.

uvicorn times nothing out between a connection's opening and the end of its request's headers: a
client that opens a connection and sends nothing, or sends its headers a byte at a time, holds it for
as long as it likes (slowloris). ``--max-connections`` caps how many connections uvicorn holds, so a
few hundred such clients made every other request a 503. :class:`HeadTimeoutProtocol` gives each
request's head (request line and headers) ``head_timeout_s`` from the moment the connection is ready
for it: opened, or done with the previous response (keep-alive). A head that has not arrived by then
ends the connection: with a 408 if some of it had arrived, silently if none had (as uvicorn closes an
idle keep-alive connection). A request answered before its body ended (a 401, 413 or the app's 408)
has as long from that answer for the rest of the body to arrive. The body has its own deadline
(``Limits.body_timeout_s``, in the app).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Callable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


if TYPE_CHECKING:
    from blend.serve.config import ServeConfig

_TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                     b"connection: close\r\ncontent-length: %d\r\n\r\n%s")
_TIMEOUT_BODY = b'{"error":{"message":"request headers not received in time","type":"invalid_request_error",' \
                b'"param":null,"code":"request_timeout"}}'


class HeadTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol; a request's head must arrive within ``head_timeout_s`` (class attribute,
    set by :func:`protocol_with_head_timeout`)."""

    head_timeout_s: float = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0  # bytes of the awaited head received so far
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

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
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


def protocol_with_head_timeout(head_timeout_s: float) -> Callable[..., asyncio.Protocol]:
    """The protocol class uvicorn's ``http=`` takes: :class:`HeadTimeoutProtocol` with this deadline.

    Args:
        head_timeout_s: seconds a request's head may take to arrive (> 0).

    Returns:
        A subclass of :class:`HeadTimeoutProtocol` (one per deadline, so servers in one process can differ).
    """
    if not head_timeout_s > 0:
        raise ValueError(f"head timeout must be > 0 seconds, not {head_timeout_s}")
    return type("HeadTimeoutProtocol", (HeadTimeoutProtocol,), {"head_timeout_s": float(head_timeout_s)})


def uvicorn_options(config: "ServeConfig") -> dict[str, Any]:
    """The connection settings ``uvicorn.run``/``uvicorn.Config`` take for a server of ``config``: its
    address, the connection cap, the head deadline (:class:`HeadTimeoutProtocol`) and the graceful
    shutdown. ``kvblend serve`` and the tests' in-process servers both start from these."""
    return {"host": config.host, "port": config.port, "timeout_graceful_shutdown": config.limits.graceful_shutdown_s,
            "limit_concurrency": config.limits.max_connections,
            "http": protocol_with_head_timeout(config.limits.head_timeout_s)}
