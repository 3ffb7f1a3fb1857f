"""Small ASGI pieces shared by kvblend serve's middleware and the vLLM documents middleware (no imports
beyond the standard library, so vLLM's server can load them without kvblend serve's app)."""

from __future__ import annotations

from typing import Any, Awaitable, Callable

Receive = Callable[[], Awaitable[dict[str, Any]]]


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
