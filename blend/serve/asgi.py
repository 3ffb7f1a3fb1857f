"""Small ASGI pieces shared by kvblend serve's middleware and the vLLM documents middleware (no imports
beyond the standard library, so vLLM's server can load them without kvblend serve's app)."""

from __future__ import annotations

from typing import Any, Awaitable, Callable

Receive = Callable[[], Awaitable[dict[str, Any]]]


async def read_body(receive: Receive, limit: int) -> tuple[bytes, bool]:
    """Read a request body until it ends or passes ``limit`` bytes.

    Args:
        receive: the connection's receive.
        limit: stop once more than this many bytes were read.

    Returns:
        The bytes read (the chunk that passed the limit included), and whether the client had more
        to send (unread; :func:`replay_body` with ``more=True`` hands it on). A disconnect ends the body.
    """
    parts, size = [], 0
    while True:
        msg = await receive()
        if msg["type"] != "http.request":  # the client left while sending
            return b"".join(parts), False
        chunk = msg.get("body", b"")
        parts.append(chunk)
        size += len(chunk)
        if not msg.get("more_body", False):
            return b"".join(parts), False
        if size > limit:
            return b"".join(parts), True


def replay_body(body: bytes, receive: Receive, more: bool = False) -> Receive:
    """A ``receive`` that yields a body already read, then the client's own messages.

    Args:
        body: the bytes read so far.
        receive: the connection's receive.
        more: whether the client has more body to send (it then follows from ``receive``).

    Returns:
        The replaying receive (disconnects and the rest of the body come from ``receive``).
    """
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": more}
        return await receive()

    return replay
