"""The stress test's clients: one request sent through the openai client, httpx (sync or async) or a raw
socket, read whole or left early, and what came back as one :class:`Outcome` whatever the client was.

A request is a :class:`Spec` (its body, its client, whether and when its client leaves); the outcome keeps only
what a request's answer is (text, tokens, logprobs, finish reason, usage, the ``kvblend`` extension, or its
error), so answers read by different clients, streamed or not, compare with ``==``.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

import httpx
import openai

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
# the body fields the openai client takes as arguments; the others (kvblend's, vLLM's) ride in extra_body
OPENAI_FIELDS = {
    CHAT: {"model", "messages", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options",
           "logprobs", "top_logprobs", "n"},
    COMPLETIONS: {"model", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "stream",
                  "stream_options", "logprobs", "n"},
}


class Client(Enum):
    OPENAI = "openai"
    HTTPX = "httpx"
    ASYNC = "async-httpx"
    RAW = "raw-socket"  # sends the request and leaves (Leave.EARLY only)


class Leave(Enum):
    NEVER = "never"
    MID_STREAM = "mid-stream"  # after ``after_chunks`` chunks of its stream
    EARLY = "early"  # ``after_s`` after sending, whatever came by then (before its first token, or not)


@dataclass(frozen=True)
class Spec:
    """One request of a schedule."""

    index: int
    path: str
    body: dict
    client: Client
    leave: Leave = Leave.NEVER
    after_chunks: int = 0
    after_s: float = 0.0
    refused: tuple[int, str | None] | None = None  # an invalid request's status and the field its error names

    def whole(self) -> "Spec":
        """The same request, read to its end (the reference run)."""
        return Spec(self.index, self.path, self.body, Client.HTTPX if self.client is Client.RAW else self.client,
                    refused=self.refused)

    def unstreamed(self) -> "Spec":
        """The same request answered whole (not streamed), read to its end."""
        body = {k: v for k, v in self.body.items() if k not in ("stream", "stream_options")}
        return Spec(self.index, self.path, body, self.whole().client)

    def without_stop(self) -> "Spec":
        """The same request without its stop strings, unstreamed, read to its end."""
        body = {k: v for k, v in self.unstreamed().body.items() if k != "stop"}
        return Spec(self.index, self.path, body, self.whole().client)

    def describe(self) -> str:
        return f"#{self.index} {self.client.value} {self.leave.value} {self.path} {json.dumps(self.body)}"


@dataclass
class Outcome:
    """What one request got back (``left``: its client went away before the end)."""

    status: int | None = None
    text: str = ""
    finish: str | None = None
    usage: dict | None = None
    ext: dict | None = None
    logprobs: list = field(default_factory=list)
    error: dict | None = None  # an error response's or a stream's error event's ``error`` object
    left: bool = False
    chunks: int = 0


class Entry(NamedTuple):
    """One answer token's logprobs entry, of either endpoint (what the endpoint's format leaves out is None)."""

    token: str
    logprob: float
    bytes: tuple[int, ...] | None  # chat's
    alternatives: tuple[tuple[str, float], ...]  # most likely first
    offset: int | None  # completions' text_offset


def _ranked(pairs) -> tuple[tuple[str, float], ...]:
    return tuple(sorted(pairs, key=lambda p: (-p[1], p[0])))


def _choice_logprobs(path: str, lp: dict | None) -> list[Entry]:
    """A choice's (or chunk's) logprobs object as one entry per token."""
    if lp is None:
        return []
    if path == CHAT:
        return [Entry(e["token"], e["logprob"], tuple(e["bytes"] or ()),
                      _ranked((t["token"], t["logprob"]) for t in e["top_logprobs"]), None) for e in lp["content"] or ()]
    return [Entry(t, p, None, _ranked((top or {}).items()), off) for t, p, top, off in
            zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], lp["text_offset"])]


def _usage(u: dict | None) -> dict | None:
    if u is None:
        return None
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
    return {"prompt": u["prompt_tokens"], "completion": u["completion_tokens"], "cached": cached}


def from_body(path: str, status: int, body: dict) -> Outcome:
    """The outcome of a whole (non-streamed) response."""
    if status != 200:
        return Outcome(status, error=body.get("error"))
    choice = body["choices"][0]
    text = choice["message"]["content"] if path == CHAT else choice["text"]
    return Outcome(status, text or "", choice["finish_reason"], _usage(body["usage"]), body.get("kvblend"),
                   _choice_logprobs(path, choice.get("logprobs")))


def from_chunks(path: str, chunks: list[dict], left: bool) -> Outcome:
    """The outcome of a streamed response from its chunks (as JSON objects; an error event's included)."""
    out = Outcome(200, left=left, chunks=len(chunks))
    for c in chunks:
        if "error" in c:
            out.error = c["error"]
            continue
        if c.get("usage"):
            out.usage = _usage(c["usage"])
        if "kvblend" in c:
            out.ext = c["kvblend"]
        for choice in c.get("choices") or ():
            piece = choice["delta"].get("content") if path == CHAT else choice.get("text")
            out.text += piece or ""
            out.logprobs += _choice_logprobs(path, choice.get("logprobs"))
            if choice.get("finish_reason"):
                out.finish = choice["finish_reason"]
    return out


def _sse(line: str) -> dict | None:
    """A chunk from one SSE line (None for ``[DONE]`` and anything that is not data)."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return None
    return json.loads(line[len("data: "):])


def _error(status: int, text: str) -> Outcome:
    try:
        return Outcome(status, error=json.loads(text).get("error"))
    except ValueError:
        return Outcome(status, error={"message": text})


def send_httpx(http: httpx.Client, spec: Spec) -> Outcome:
    """``spec`` over a synchronous httpx client."""
    if not spec.body.get("stream"):
        r = http.post(spec.path, json=spec.body)
        return from_body(spec.path, r.status_code, r.json()) if r.status_code == 200 else _error(r.status_code, r.text)
    chunks, left = [], False
    with http.stream("POST", spec.path, json=spec.body) as r:
        if r.status_code != 200:
            return _error(r.status_code, r.read().decode())
        for line in r.iter_lines():
            chunk = _sse(line)
            if chunk is not None:
                chunks.append(chunk)
            if spec.leave is Leave.MID_STREAM and len(chunks) >= spec.after_chunks:
                left = True
                break  # leaving the block closes the connection mid-stream
    return from_chunks(spec.path, chunks, left)


async def send_async(http: httpx.AsyncClient, spec: Spec) -> Outcome:
    """``spec`` over an asynchronous httpx client."""
    if not spec.body.get("stream"):
        r = await http.post(spec.path, json=spec.body)
        return from_body(spec.path, r.status_code, r.json()) if r.status_code == 200 else _error(r.status_code, r.text)
    chunks, left = [], False
    async with http.stream("POST", spec.path, json=spec.body) as r:
        if r.status_code != 200:
            return _error(r.status_code, (await r.aread()).decode())
        async for line in r.aiter_lines():
            chunk = _sse(line)
            if chunk is not None:
                chunks.append(chunk)
            if spec.leave is Leave.MID_STREAM and len(chunks) >= spec.after_chunks:
                left = True
                break
    return from_chunks(spec.path, chunks, left)


def send_openai(client: openai.OpenAI, spec: Spec) -> Outcome:
    """``spec`` through the official openai client (kvblend's and vLLM's fields in ``extra_body``)."""
    known = OPENAI_FIELDS[spec.path]
    args = {k: v for k, v in spec.body.items() if k in known}
    extra = {k: v for k, v in spec.body.items() if k not in known}
    create = client.chat.completions.create if spec.path == CHAT else client.completions.create
    try:
        got = create(**args, extra_body=extra or None)
        if not spec.body.get("stream"):
            return from_body(spec.path, 200, got.model_dump())
        chunks, left = [], False
        try:
            for chunk in got:
                chunks.append(chunk.model_dump())
                if spec.leave is Leave.MID_STREAM and len(chunks) >= spec.after_chunks:
                    left = True
                    break
        except openai.APIError as e:  # an error event in the stream
            chunks.append({"error": e.body if isinstance(e.body, dict) else {"message": e.message}})
        finally:
            got.close()
        return from_chunks(spec.path, chunks, left)
    except openai.APIStatusError as e:
        return _error(e.status_code, e.response.text)


def send_raw_and_leave(url: str, spec: Spec) -> Outcome:
    """Send ``spec`` on a socket of its own and close it ``spec.after_s`` later, reading nothing."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(spec.body).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (spec.path.encode(), len(data), data))
        time.sleep(spec.after_s)
    return Outcome(left=True)


class Lane:
    """One client thread's connections to a server (an openai client and an httpx client)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.http = httpx.Client(base_url=url, timeout=60)
        self.openai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def send(self, spec: Spec) -> Outcome:
        if spec.client is Client.RAW:
            return send_raw_and_leave(self.url, spec)
        if spec.client is Client.OPENAI:
            return send_openai(self.openai, spec)
        if spec.client is Client.ASYNC:
            return asyncio.run(_send_one_async(self.url, spec))
        return send_httpx(self.http, spec)

    def close(self) -> None:
        self.http.close()
        self.openai.close()


async def _send_one_async(url: str, spec: Spec) -> Outcome:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        return await send_async(http, spec)


async def send_all_async(url: str, specs: list[Spec], tasks: int) -> dict[int, Outcome]:
    """``specs`` from ``tasks`` concurrent tasks over one async httpx client (each task takes the next)."""
    todo = list(reversed(specs))
    out: dict[int, Outcome] = {}

    async def task(http: httpx.AsyncClient) -> None:
        while todo:
            spec = todo.pop()
            out[spec.index] = await send_async(http, spec)

    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        await asyncio.gather(*(task(http) for _ in range(tasks)))
    return out
