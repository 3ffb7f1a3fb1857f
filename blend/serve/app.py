"""The HTTP app (FastAPI): OpenAI's endpoints over the scheduler.

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models   GET /v1/models/{id}
    GET /health                 GET /metrics           GET /   (playground page)

A request is validated (pydantic), checked against the limits
(:mod:`blend.serve.intake`), and submitted to the scheduler, whose threads
hand events back to the event loop through an ``asyncio.Queue``. A response
starts only after the request's first event, so a refusal found while
prefilling (a policy the model cannot serve) still gets its 4xx status;
then it streams (SSE, ``data: [DONE]`` at the end) or is sent whole. A
client that goes away cancels its request: it leaves the queue, or the
decode batch at the next step.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import re
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncGenerator

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from blend.serve.asgi import read_body, replay_body
from blend.serve.config import ServeConfig, host_name
from blend.serve.http_errors import add_error_handlers, error_for, json_error
from blend.serve.metrics import ServeMetrics
from blend.serve.protocol import (
    DONE, Endpoint, ErrorType, LogprobFormat, ResponseHead, error_body, final_chunk, full_body, kvblend_extension, sse,
    text_chunk, usage_chunk,
)
from blend.serve.intake import ApiError, Job, prepare
from blend.serve.jobs import Event, EventKind, QueueFullError, ShuttingDownError, Ticket
from blend.serve.scheduler import Scheduler
from blend.serve.schemas import ChatCompletionRequest, CompletionRequest


PLAYGROUND = Path(__file__).with_name("static") / "playground.html"
KNOWN_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/")
BODY_PATHS = ("/v1/chat/completions", "/v1/completions")  # the only routes that read a body
MODEL_PATH = "/v1/models/"  # a model's own path: counted under one label, whatever the id
STATUS_CLIENT_GONE = 499  # nginx's "client closed request": nobody reads it


class Guard:
    """ASGI middleware in front of everything: request counting, API key, body size.

    The key is checked before the body is read or parsed (a request without it
    learns nothing else); the body is read up to the limit and replayed to the app.
    """

    def __init__(self, app: ASGIApp, config: ServeConfig, metrics: ServeMetrics) -> None:
        self.app = app
        self.key = config.api_key.encode() if config.api_key else None
        self.hosts = None if config.allowed_hosts is None else frozenset(config.allowed_hosts)
        self.max_body = config.limits.max_body_bytes
        self.body_timeout_s = config.limits.body_timeout_s
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        label = path if path in KNOWN_PATHS else MODEL_PATH + "{id}" if path.startswith(MODEL_PATH) else "other"

        started = False

        async def counting_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.metrics.on_request(label, int(message["status"]))
            await send(message)

        if self.hosts is not None and host_name(_header(scope, b"host")) not in self.hosts:
            await json_error(400, "this server does not answer for that Host name (see --allowed-hosts)",
                             ErrorType.INVALID_REQUEST, code="host_not_allowed")(scope, receive, counting_send)
            return
        if self.key is not None and path.startswith("/v1/") and not self._authorized(scope):
            await json_error(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                             ErrorType.AUTHENTICATION, code="invalid_api_key",
                             headers={"WWW-Authenticate": "Bearer"})(scope, receive, counting_send)
            return
        if scope["method"] in ("POST", "PUT", "PATCH") and path in BODY_PATHS:  # any other route: never buffered
            try:
                replay = await asyncio.wait_for(self._read_body(scope, receive), self.body_timeout_s)
            except asyncio.TimeoutError:
                await json_error(408, f"request body not received within {self.body_timeout_s:g} s",
                                 ErrorType.INVALID_REQUEST)(scope, receive, counting_send)
                return
            if replay is None:
                await json_error(413, f"request body exceeds {self.max_body} bytes", ErrorType.TOO_LARGE)(
                    scope, receive, counting_send)
                return
            receive = replay
        try:
            await self.app(scope, receive, counting_send)
        except (Exception, asyncio.CancelledError):
            # an unhandled error's 500 is sent by Starlette's outermost middleware, around this one, and a handler
            # a stopping uvicorn cancelled gets uvicorn's own 500: count them here
            if not started:
                self.metrics.on_request(label, 500)
            raise

    def _authorized(self, scope: Scope) -> bool:
        """Whether the request carries this server's API key (compared in constant time)."""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)
        return False

    async def _read_body(self, scope: Scope, receive: Receive) -> Receive | None:
        """The body, if within the limit, as a replaying ``receive``; None if over it."""
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_body:
                return None
        body, more = await read_body(receive, self.max_body)
        if more or len(body) > self.max_body:
            return None
        return replay_body(body, receive)


class ClientGone(Exception):
    """The client disconnected before its answer."""


class _Watch:
    """A request's events, raced against its client's disconnect."""

    def __init__(self, request: Request, queue: asyncio.Queue, ticket: Ticket) -> None:
        self.queue = queue
        self.ticket = ticket
        self._gone = asyncio.ensure_future(self._disconnected(request.receive))

    @staticmethod
    async def _disconnected(receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    async def next(self) -> Event:
        if not self.queue.empty():
            return self.queue.get_nowait()
        get = asyncio.ensure_future(self.queue.get())
        done, _ = await asyncio.wait({get, self._gone}, return_when=asyncio.FIRST_COMPLETED)
        if get in done:
            return get.result()
        get.cancel()
        self.ticket.cancel()
        raise ClientGone

    def close(self) -> None:
        self._gone.cancel()


class _TicketStream(StreamingResponse):
    """A streamed answer that stops its request however the response ends.

    The body generator's own ``finally`` is not enough: when the client leaves while a write
    waits for the socket to drain (a client that stopped reading), Starlette cancels the write
    and leaves the generator suspended at its ``yield``, where only the garbage collector would
    close it (and a generator that never started has no ``finally`` to run). Until then the
    request would keep its slot and its KV and decode every token it may.

    Args:
        content: the SSE chunks (an async generator).
        ticket: the request's ticket.
    """

    def __init__(self, content: AsyncGenerator[str, None], ticket: Ticket) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.ticket = ticket

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.ticket.cancel()  # a no-op when the answer finished
            await self.body_iterator.aclose()  # the content itself (an async generator is kept as given)


def _header(scope: Scope, name: bytes) -> str:
    """A request header's value ("" if absent), as text."""
    for key, value in scope.get("headers", []):
        if key == name:
            return value.decode("latin-1")
    return ""


def playground_headers(page: str) -> dict[str, str]:
    """The playground page's security headers: only its own inline script runs (by hash), it talks only to
    this server, and no other site may frame it (a click through an invisible frame asked with the key the
    user had typed).

    Args:
        page: the playground's HTML (each ``<script>`` body in it is allowed by its sha256).

    Returns:
        Header name to value: Content-Security-Policy, X-Frame-Options, X-Content-Type-Options and
        Referrer-Policy.
    """
    hashes = " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(body.encode()).digest()).decode()}'"
                      for body in re.findall(r"<script>(.*?)</script>", page, flags=re.S))
    return {
        "Content-Security-Policy": f"default-src 'none'; script-src {hashes}; style-src 'unsafe-inline'; "
                                   "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
                                   "frame-ancestors 'none'",
        "X-Frame-Options": "DENY", "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
    }


class _Answers:
    """The completion endpoints' work over one engine and its scheduler."""

    def __init__(self, engine, config: ServeConfig, scheduler: Scheduler) -> None:
        self.engine, self.config, self.scheduler = engine, config, scheduler

    async def stored(self) -> None:
        """A request is done once what it stored is in every tier (write-behind): its answer waits
        for the background writes, off the event loop, and only when some are pending."""
        if not self.engine.segments.flush(0):
            await run_in_threadpool(self.engine.segments.flush)

    async def answer(self, request: Request, body, endpoint: Endpoint) -> Response:
        """A completion request: its job through the scheduler, then its JSON body or its event stream."""
        engine, config, scheduler = self.engine, self.config, self.scheduler
        # tokenizing a small request beats a thread hop; a conversation renders its template once per earlier
        # turn, so it never blocks the event loop
        if (body.text_chars() <= config.inline_prepare_chars
                and len(getattr(body, "messages", ())) <= config.inline_prepare_messages):
            job: Job = prepare(engine, config, body, endpoint)
        else:
            job = await run_in_threadpool(prepare, engine, config, body, endpoint)
        head = ResponseHead.new(endpoint, config.model_id)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event] = asyncio.Queue()

        def sink(ev: Event) -> None:  # scheduler threads -> this request's event loop
            if job.stream or ev.kind is not EventKind.TEXT:
                loop.call_soon_threadsafe(queue.put_nowait, ev)

        try:
            ticket = scheduler.submit(job.prompt, job.policy, job.config, sink)
        except QueueFullError as e:
            raise ApiError(429, str(e), ErrorType.RATE_LIMIT, code="queue_full",
                           headers={"Retry-After": str(e.retry_after_s)}) from None
        except ShuttingDownError as e:
            raise error_for(e) from None
        watch = _Watch(request, queue, ticket)
        try:
            first = await watch.next()
            if first.kind is EventKind.FAILED:
                raise error_for(first.error)
            if job.stream:
                return _TicketStream(self._events(first, queue, ticket, head, job), ticket)
            ev = first
            while ev.kind not in (EventKind.DONE, EventKind.FAILED):
                ev = await watch.next()
            if ev.kind is EventKind.FAILED:
                raise error_for(ev.error)
            await self.stored()
            c = ev.completion
            ext = kvblend_extension(c, job.prompt, engine.tokenizer, job.return_tokens)
            return JSONResponse(full_body(head, c, ext, LogprobFormat(endpoint, engine.tokenizer, job.logprobs)))
        except ClientGone:
            return Response(status_code=STATUS_CLIENT_GONE)
        except asyncio.CancelledError:  # a stopping uvicorn cancelled the handler: the request stops too
            ticket.cancel()
            raise
        finally:
            watch.close()

    async def _events(self, first: Event, queue: asyncio.Queue, ticket: Ticket, head: ResponseHead, job: Job):
        """A streamed answer's server-sent events after its first one."""
        engine = self.engine
        lp = LogprobFormat(head.endpoint, engine.tokenizer, job.logprobs)
        try:
            usage = job.include_usage  # every chunk before the usage chunk says "usage": null
            yield text_chunk(head, first.text, first=True, logprobs=lp.format(first.logprobs), include_usage=usage)
            while True:
                ev: Event = await queue.get()
                if ev.kind is EventKind.TEXT:
                    yield text_chunk(head, ev.text, logprobs=lp.format(ev.logprobs), include_usage=usage)
                elif ev.kind is EventKind.DONE:
                    try:
                        await self.stored()
                        c = ev.completion
                        last = final_chunk(head, c, kvblend_extension(c, job.prompt, engine.tokenizer,
                                                                      job.return_tokens),
                                           lp.format(ev.logprobs), include_usage=usage)
                    except Exception as e:  # the last chunk could not be built: the client is told, not cut off
                        err = error_for(e)
                        yield sse(error_body(err.message, err.kind, err.param, err.code))
                        break
                    yield last
                    if job.include_usage:
                        yield usage_chunk(head, c)
                    break
                elif ev.kind is EventKind.FAILED:  # headers are sent: the error goes in the stream
                    err = error_for(ev.error)
                    yield sse(error_body(err.message, err.kind, err.param, err.code))
                    break
            yield DONE
        finally:
            ticket.cancel()  # a no-op when finished; stops the request when the client left


def _add_info_routes(app: FastAPI, config: ServeConfig, scheduler: Scheduler, metrics: ServeMetrics) -> None:
    """The model list, one model, health, Prometheus metrics and the playground page."""
    created = int(time.time())
    model_object = {"id": config.model_id, "object": "model", "created": created, "owned_by": "kvblend"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_object]}

    @app.get(MODEL_PATH + "{model_id:path}")
    async def model(model_id: str) -> dict:
        if model_id != config.model_id:
            raise ApiError(404, f"model {model_id!r} is not served here; this server serves {config.model_id!r}",
                           ErrorType.NOT_FOUND, "model", "model_not_found")
        return model_object

    @app.get("/health")
    async def health() -> JSONResponse:
        state = {"model": config.model_id, "active": scheduler.active, "queued": scheduler.queue_depth}
        dead = scheduler.dead_threads()
        if dead:  # requests would queue and never be answered
            return JSONResponse({"status": "unavailable", "reason": f"scheduler thread(s) stopped: {', '.join(dead)}",
                                 **state}, status_code=503)
        return JSONResponse({"status": "ok", **state})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    page = PLAYGROUND.read_text(encoding="utf-8")
    page_headers = playground_headers(page)

    @app.get("/", response_class=HTMLResponse)
    async def playground() -> HTMLResponse:
        return HTMLResponse(page, headers=page_headers)


def create_app(engine, config: ServeConfig | None = None, metrics: ServeMetrics | None = None) -> FastAPI:
    """The server's ASGI app over ``engine`` (its scheduler starts and stops with the app).

    Args:
        engine: the engine (wrap its store in a FlightStore for single-flight).
        config: server settings.
        metrics: metrics to export (default: new ones over the engine's store).

    Returns:
        The FastAPI app; ``app.state.scheduler`` is its scheduler.
    """
    config = config or ServeConfig()
    metrics = metrics or ServeMetrics(engine.store, engine.runner.kv_pool)
    scheduler = Scheduler(engine, config.scheduler, metrics)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        scheduler.start()
        try:
            yield
        finally:
            scheduler.close()
            engine.segments.flush()  # pending background store writes land before the process ends

    app = FastAPI(title="kvblend", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.scheduler = scheduler
    app.state.metrics = metrics
    app.add_middleware(Guard, config=config, metrics=metrics)

    add_error_handlers(app)
    answers = _Answers(engine, config, scheduler)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        return await answers.answer(request, body, Endpoint.CHAT)

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest) -> Response:
        return await answers.answer(request, body, Endpoint.COMPLETIONS)

    _add_info_routes(app, config, scheduler, metrics)
    return app
