"""An ASGI middleware for vLLM's OpenAI server: chat requests with ``documents`` laid out by kvblend.

    python -m vllm.entrypoints.openai.api_server --model DIR \\
        --kv-transfer-config '{"kv_connector": "KVBlendConnector", ...}' \\
        --middleware blend.integrations.vllm.middleware.DocumentsMiddleware

A ``POST /v1/chat/completions`` whose body carries ``documents`` and a
``kvblend`` entry in ``kv_transfer_params`` is rewritten (see
:mod:`blend.integrations.vllm.chat`) into a ``/v1/completions`` request over
kvblend's segmented prompt, and vLLM's answer is turned back into a chat
completion, streamed or not. Every other request passes through untouched.

vLLM's streamed completions carry no ``kv_transfer_params``, so a streamed
kvblend chat would lose the connector's reuse report. :class:`StreamReports`
catches it where vLLM has it: the final ``RequestOutput`` of the engine
client's ``generate`` (wrapped once per engine client; the request is marked by
a nonce under :data:`STREAM_KEY` in its ``kv_transfer_params``), and the
middleware puts it in the chat chunk that carries the finish reason.
A malformed kvblend chat request gets a 400 in OpenAI's error shape. No vLLM
import: the served model comes from ``scope["app"].state.vllm_config``, which
vLLM's server sets (tests pass a tokenizer instead).

vLLM adds ``--middleware`` classes after its own (authentication included), so
this one runs first. It therefore checks the bearer token itself, against the
keys vLLM was started with (``--api-key``, else ``VLLM_API_KEY``, read from
the same places vLLM reads them): a request without a valid key passes
through unread, and vLLM's own authentication answers it 401 before any
tokenizer work.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import secrets
import threading
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

from blend import json_text
from blend.errors import InvalidRequestError
from blend.integrations.vllm.chat import CHAT_PATH, COMPLETIONS_PATH, ChunkConverter, TokenNamer, \
    chat_to_completion, completion_to_chat, is_kvblend_chat
from blend.integrations.vllm.plan import PARAMS_KEY
from blend.serve.asgi import Receive, read_body, replay_body

Scope = dict[str, Any]
Send = Callable[[dict[str, Any]], Awaitable[None]]
MAX_BODY_BYTES = 64 << 20  # a chat body larger than this passes through unread by kvblend's rewrite
STREAM_KEY = "kvblend_stream"  # kv_transfer_params key: the nonce of a streamed request whose report is caught

_TOKENIZERS: dict[str, Any] = {}
_TOKENIZERS_LOCK = threading.Lock()


def served_tokenizer(path: str):
    """The served model's tokenizer, loaded once per process (as kvblend's engine loads it).

    Args:
        path: the served model's folder (vLLM's ``--model``).

    Returns:
        The transformers tokenizer, the same object on every later call for ``path``.
    """
    with _TOKENIZERS_LOCK:
        if path not in _TOKENIZERS:
            from transformers import AutoTokenizer

            _TOKENIZERS[path] = AutoTokenizer.from_pretrained(path)
        return _TOKENIZERS[path]


def _error_body(status: int, message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "BadRequestError", "param": None,
                                 "code": status}}).encode()


def _api_key_hashes(scope: Scope) -> list[bytes]:
    """SHA-256 of each key vLLM's server was started with, as vLLM's AuthenticationMiddleware derives
    them (``args.api_key``, else the ``VLLM_API_KEY`` environment variable); empty: no authentication."""
    args = getattr(getattr(scope.get("app"), "state", None), "args", None)
    keys = getattr(args, "api_key", None) or [os.environ.get("VLLM_API_KEY")]
    if isinstance(keys, str):  # a single key (older vLLM releases kept one string)
        keys = [keys]
    return [hashlib.sha256(k.encode("utf-8")).digest() for k in keys if isinstance(k, str) and k]


def authorized(scope: Scope) -> bool:
    """Whether the request carries a bearer token vLLM will accept.

    Args:
        scope: the ASGI scope (vLLM's app, with its server arguments, in ``scope["app"]``).

    Returns:
        True when the token matches one of vLLM's keys, or when vLLM checks none.
    """
    hashes = _api_key_hashes(scope)
    if not hashes:
        return True
    value = (_header(scope.get("headers", []), b"authorization") or b"").decode("latin-1")
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer":
        return False
    digest = hashlib.sha256(token.encode("utf-8")).digest()
    ok = False
    for h in hashes:  # compare with every key, as vLLM does: no early exit on a match
        ok |= secrets.compare_digest(digest, h)
    return ok


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for k, v in headers:
        if k.lower() == name:
            return v
    return None


class StreamReports:
    """The reuse reports of streamed kvblend chats, caught from vLLM's engine client.

    One owner for the pending nonces; a nonce is registered by :meth:`open` before the request goes
    to vLLM and removed by :meth:`close` when its response ends, so nothing accumulates.
    """

    def __init__(self) -> None:
        self._pending: dict[str, dict[str, Any] | None] = {}  # nonce -> report (None until caught)
        self._watched: set[int] = set()  # id() of engine clients whose generate is wrapped

    def watch(self, engine_client: Any) -> bool:
        """Wrap ``engine_client.generate`` once (idempotent) so that marked requests' reports are caught.

        Args:
            engine_client: vLLM's engine client (``app.state.engine_client``), or None.

        Returns:
            False when there is no ``generate`` to wrap (the stream then goes without a report).
        """
        gen = getattr(engine_client, "generate", None)
        if gen is None or not callable(gen):
            return False
        if id(engine_client) in self._watched:
            return True
        reports = self

        def generate(*args: Any, **kwargs: Any):
            out = gen(*args, **kwargs)
            sp = kwargs.get("sampling_params", args[1] if len(args) > 1 else None)
            extra = getattr(sp, "extra_args", None)
            params = extra.get("kv_transfer_params") if isinstance(extra, dict) else None
            nonce = params.get(STREAM_KEY) if isinstance(params, dict) else None  # any client may send one
            return reports._catch(out, nonce) if isinstance(nonce, str) and nonce in reports._pending else out

        engine_client.generate = generate
        self._watched.add(id(engine_client))
        return True

    async def _catch(self, outputs: AsyncIterator[Any], nonce: str) -> AsyncIterator[Any]:
        try:
            async for out in outputs:
                params = getattr(out, "kv_transfer_params", None)
                if getattr(out, "finished", False) and isinstance(params, dict) and PARAMS_KEY in params \
                        and nonce in self._pending:
                    self._pending[nonce] = params
                yield out
        finally:
            await outputs.aclose()  # a closed stream closes vLLM's own generator (which aborts the request)

    def open(self) -> str:
        """A new nonce to put under :data:`STREAM_KEY`."""
        nonce = uuid.uuid4().hex
        self._pending[nonce] = None
        return nonce

    def report(self, nonce: str) -> dict[str, Any] | None:
        """The request's ``kv_transfer_params`` (kvblend's report), once vLLM has finished it."""
        return self._pending.get(nonce)

    def close(self, nonce: str) -> None:
        self._pending.pop(nonce, None)


class DocumentsMiddleware:
    """Rewrites kvblend chat requests with documents into completions over kvblend's prompt.

    Args:
        app: the ASGI app (vLLM's FastAPI app).
        tokenizer: the served model's tokenizer; None: loaded from the served model's directory.
    """

    def __init__(self, app: Callable, tokenizer: Any = None) -> None:
        self.app = app
        self._tokenizer = tokenizer
        self.stream_reports = StreamReports()

    def _tokenizer_for(self, scope: Scope):
        if self._tokenizer is not None:
            return self._tokenizer
        state = getattr(scope.get("app"), "state", None)
        cfg = getattr(state, "vllm_config", None)
        if cfg is None:
            raise InvalidRequestError("kvblend documents: the server's model config is not available")
        mc = cfg.model_config
        return served_tokenizer(str(getattr(mc, "tokenizer", None) or mc.model))

    def _rewrite(self, scope: Scope, body: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """The served tokenizer and the chat body laid out as a completions body (one worker-thread hop)."""
        tokenizer = self._tokenizer_for(scope)
        return tokenizer, chat_to_completion(body, tokenizer)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope.get("type") != "http" or scope.get("method") != "POST"
                or not scope.get("path", "").endswith(CHAT_PATH) or not authorized(scope)):
            await self.app(scope, receive, send)  # not ours, or vLLM's 401 to give: passed on unread
            return
        raw, more = await read_body(receive, MAX_BODY_BYTES)
        replay = replay_body(raw, receive, more)
        if more or not raw.strip().startswith(b"{"):
            await self.app(scope, replay, send)  # too large or not an object: vLLM answers it
            return
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):  # malformed, or nested past the decoder's limit
            await self.app(scope, replay, send)  # vLLM's own answer, as without this middleware
            return
        if not is_kvblend_chat(body):
            await self.app(scope, replay, send)
            return
        try:
            tokenizer, completion = await asyncio.to_thread(self._rewrite, scope, body)
        except InvalidRequestError as e:
            await _respond(send, 400, _error_body(400, str(e)))
            return
        nonce = None
        state = getattr(scope.get("app"), "state", None)
        if completion.get("stream") and self.stream_reports.watch(getattr(state, "engine_client", None)):
            nonce = self.stream_reports.open()
            completion["kv_transfer_params"] = {**completion["kv_transfer_params"], STREAM_KEY: nonce}
        new_raw = json.dumps(completion).encode()
        path = scope["path"][: -len(CHAT_PATH)] + COMPLETIONS_PATH
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(new_raw)).encode()))
        inner = {**scope, "path": path, "raw_path": path.encode(), "headers": headers}
        report = None if nonce is None else (lambda: self.stream_reports.report(nonce))
        try:
            namer = TokenNamer(tokenizer, as_ids=body.get("return_tokens_as_token_ids") is True)
            await self.app(inner, replay_body(new_raw, receive), _ChatSend(send, report, completion.get("logprobs"),
                                                                           namer))
        finally:
            if nonce is not None:
                self.stream_reports.close(nonce)


async def _respond(send: Send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class _ChatSend:
    """Wraps ``send``: a completions answer goes out as a chat answer (JSON buffered; SSE event by event)."""

    def __init__(self, send: Send, report: Callable[[], dict[str, Any] | None] | None = None,
                 top_logprobs: int | None = None, namer: TokenNamer | None = None) -> None:
        self.send = send
        self.top_logprobs = top_logprobs  # the chat request's alternatives per token (None: no logprobs)
        self.report = report  # a streamed request's caught kv_transfer_params (None: not caught)
        self.reported = False
        self.start: dict[str, Any] | None = None
        self.mode = "pass"  # "json" | "sse" | "pass" (errors and anything else, as vLLM sent them)
        self.buf = b""
        self.namer = namer  # the logprobs' token_id:N placeholders -> text and exact bytes
        self.chunks = ChunkConverter(top_logprobs, namer)

    async def __call__(self, msg: dict[str, Any]) -> None:
        if msg["type"] == "http.response.start":
            ctype = (_header(msg.get("headers", []), b"content-type") or b"").lower()
            if msg.get("status") == 200 and ctype.startswith(b"application/json"):
                self.mode, self.start = "json", msg  # sent once the body is known (its length changes)
                return
            if msg.get("status") == 200 and ctype.startswith(b"text/event-stream"):
                self.mode = "sse"
                msg = {**msg, "headers": [(k, v) for k, v in msg.get("headers", []) if k.lower() != b"content-length"]}
            await self.send(msg)
            return
        if msg["type"] != "http.response.body" or self.mode == "pass":
            await self.send(msg)
            return
        self.buf += msg.get("body", b"")
        more = msg.get("more_body", False)
        if self.mode == "json":
            if more:
                return
            try:
                out = json_text.dumps(completion_to_chat(json.loads(self.buf), self.top_logprobs, self.namer)).encode()
            except (ValueError, TypeError, AttributeError):
                out = self.buf  # not a completion body: as vLLM sent it
            headers = [(k, v) for k, v in self.start.get("headers", []) if k.lower() != b"content-length"]
            await self.send({**self.start, "headers": headers + [(b"content-length", str(len(out)).encode())]})
            await self.send({"type": "http.response.body", "body": out})
            return
        events, _, self.buf = self.buf.rpartition(b"\n\n")
        out = b"".join(self._event(e) for e in events.split(b"\n\n") if e.strip()) if events else b""
        if not more and self.buf.strip():
            out, self.buf = out + self._event(self.buf), b""
        if out or not more:
            await self.send({"type": "http.response.body", "body": out, "more_body": more})

    def _event(self, event: bytes) -> bytes:
        """One SSE event, its completion chunk turned into a chat chunk (``[DONE]`` and others as they are)."""
        lines = []
        for line in event.split(b"\n"):
            if line.startswith(b"data: ") and line[6:].strip() != b"[DONE]":
                try:
                    chunk = json.loads(line[6:])
                    if isinstance(chunk, dict) and "error" not in chunk:  # a mid-stream error goes as it is
                        out = self.chunks(chunk)
                        if self.report is not None and not self.reported and \
                                any(c.get("finish_reason") for c in out["choices"]):
                            params = self.report()  # caught before vLLM yielded its final chunk
                            if params is not None:
                                out["kv_transfer_params"], self.reported = params, True
                        line = b"data: " + json_text.dumps(out).encode()  # a NaN: null (valid JSON)
                except (ValueError, TypeError, AttributeError):
                    pass
            lines.append(line)
        return b"\n".join(lines) + b"\n\n"
