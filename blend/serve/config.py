"""Every setting of ``kvblend serve``, with its default, in one place."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from blend.defaults import (
    DEFAULT_ATTENTION_PRECISION, DEFAULT_DTYPE, DEFAULT_GRACEFUL_SHUTDOWN_S, DEFAULT_LINEAR_PRECISION, DEFAULT_MODEL,
    DEFAULT_SERVE_TEMPERATURE,
)
from blend.decode_batching import DecodeBatching
from blend.policy import RECOMPUTE_PRECISION_FIELDS, RECOMPUTE_PRECISION_NAMES

API_KEY_ENV = "KVBLEND_API_KEY"
LOOP_SHARE_WINDOW_S = 10.0  # the decode loop's prefill share is measured over its last this many seconds


@dataclass(frozen=True)
class Limits:
    """What one request may ask for (beyond them: 413 or 400 with the limit in the message)."""

    max_body_bytes: int = 1 << 20  # 413
    # 408: a client that has not sent its whole body this long after the request began (a stalled or
    # slow upload held the connection and its buffered bytes for ever)
    body_timeout_s: float = 30.0
    # a request's head (request line and headers) must arrive this long after the connection is ready
    # for it (opened, or done with its last response); after it the connection ends (408 if part of a
    # head came). uvicorn has no such deadline: idle or trickling connections held --max-connections
    head_timeout_s: float = 15.0
    # a client the server waits on to take its response's bytes (its socket's buffers full, or a finished
    # response's last bytes still buffered) must take some this often; after it the connection is aborted and
    # counted (kvblend_write_timeouts_total). A client that stopped reading but stayed connected held its
    # connection, its buffers and its queued text until it left; one that keeps reading, however slowly, is never
    # cut (the wait starts again whenever it takes bytes, as nginx's send_timeout)
    write_timeout_s: float = 30.0
    # connections uvicorn holds at once; one more is answered 503 (each stalled connection holds a
    # descriptor and its buffers; streams and requests waiting for a slot count too)
    max_connections: int = 512
    # a stopping server's wait for running requests (the queued ones get a 503 at once)
    graceful_shutdown_s: float = DEFAULT_GRACEFUL_SHUTDOWN_S
    max_documents: int = 32  # 413
    # 413: a conversation's prompt is rendered again for each earlier turn (to find where its KV can be
    # reused), so its cost grows faster than its length; 256 messages take ~0.5 s on one core
    max_messages: int = 256
    max_prompt_tokens: int | None = None  # 413; None = the model's context
    max_tokens: int = 1024  # 400 when a request asks for more
    default_max_tokens: int = 256  # when a request names none

    def __post_init__(self) -> None:
        if not (self.body_timeout_s > 0 and self.head_timeout_s > 0 and self.write_timeout_s > 0):  # NaN refused
            raise ValueError("body, header and write timeouts must be > 0 seconds")
        if not self.graceful_shutdown_s >= 0:
            raise ValueError("the graceful shutdown must be >= 0 seconds")
        if self.max_connections < 1 or self.max_body_bytes < 1:
            raise ValueError("max_connections and max_body_bytes must be >= 1")


@dataclass(frozen=True)
class SchedulerConfig:
    """How requests share the engine.

    Attributes:
        max_concurrency: requests prefilling or decoding at once (the decode batch's bound).
        max_queue: requests waiting for a slot; one more is answered 429.
        prefill_workers: threads running prefills beside the decode loop.
        batching: decode GEMM mode (INVARIANT: bit-identical to one-at-a-time).
        single_flight: a chunk several in-flight requests miss is computed once.
        flight_timeout_s: longest a request waits for another one's computation.
        torch_threads: intra-op threads of each prefill worker and of the decode loop
            (None: leave torch's setting). They run at once, so together they should not
            exceed the cores: OpenMP threads that outnumber cores spin-wait and can run
            many times slower. A prefill's numbers depend on its thread count, so it is
            fixed for prefills.
        idle_decode_threads: threads the decode loop takes while no prefill runs
            (THROUGHPUT mode only; None: always ``torch_threads``). A decode step's
            numbers change with the thread count by float rounding at most (tested; on
            some CPUs not at all, on AMD EPYC a 5-row GEMM differs by ~1e-6), which
            THROUGHPUT mode already allows; INVARIANT mode refuses it. It pays only on
            cores no other process uses (on shared cores an OpenMP team
            waits for its descheduled members: a 16-row step took 15x longer on 2 threads).
        share_decode_min_batch: a decode step over at least this many sequences hands
            part of its rows to an idle prefill worker, which runs them as its own batched
            step on its own core (None: never). Each thread keeps one intra-op count, so no
            OpenMP team spans the cores. THROUGHPUT mode splits the batch in halves (a row's
            numbers move by float rounding at most, as batching does); INVARIANT mode only
            at whole 16-row tiles, which keeps every row bit-identical.
        decode_loop_prefills: the decode loop, when it has no sequence to decode and every
            prefill worker is busy, runs the next waiting prefill itself (same thread count,
            so the same numbers as on a worker).
        decode_loop_prefill_share: with sequences to decode too, the decode loop also runs a
            waiting prefill (every worker busy) while prefills took less than this share of its
            time over the last :data:`LOOP_SHARE_WINDOW_S` seconds (None: only when it has nothing
            to decode). Both cores then prefill under a queue, at the cost of a pause in the
            streams of the batch while the loop prefills: more tokens/s and shorter queues, a
            longer inter-token gap now and then. Needs ``decode_loop_prefills``.
        decode_pool_tokens: rows per slot of the decode pool (:mod:`blend.decode_pool`): a
            sequence whose cache fits moves into one of ``max_concurrency`` slots when it starts
            decoding, so a step over several of them attends once per layer over the pool
            instead of once per sequence (THROUGHPUT mode only: float rounding, as batching, in
            bf16 a few bf16 steps since the bmm pair rounds there; a step of one sequence keeps
            its bits). None: no pool. The pool's memory is only touched where sequences write.
        refine_after: idle-time refinement (:mod:`blend.serve.refine`): a document order that
            this many blends saw with some document not exact gets its exact KV computed by an
            idle prefill worker, a segment at a time and after any waiting request, so later
            blends of that order take the exact path (bit-identical to a full prefill, an exact
            hit's cost). None: off (a blend's answer then never depends on earlier traffic
            beyond the chunks it finds).
        refine_max_pending: orders waiting for refinement at most (the oldest dropped beyond).
        refine_max_tracked: orders whose blends are counted (least recently seen forgotten first).
    """

    max_concurrency: int = 16
    max_queue: int = 64
    prefill_workers: int = 1
    batching: DecodeBatching = DecodeBatching.THROUGHPUT
    single_flight: bool = True
    flight_timeout_s: float = 60.0
    torch_threads: int | None = None
    idle_decode_threads: int | None = None
    decode_loop_prefills: bool = True
    decode_loop_prefill_share: float | None = None
    share_decode_min_batch: int | None = 8  # smaller steps gain nothing split (4 rows: 0.97-1.2x the one-thread time)
    decode_pool_tokens: int | None = 4096
    refine_after: int | None = None
    refine_max_pending: int = 16
    refine_max_tracked: int = 4096

    def __post_init__(self) -> None:
        if self.max_concurrency < 1 or self.max_queue < 0 or self.prefill_workers < 1:
            raise ValueError("max_concurrency and prefill_workers must be >= 1, max_queue >= 0")
        if any(n is not None and n < 1 for n in (self.torch_threads, self.idle_decode_threads)):
            raise ValueError("torch_threads and idle_decode_threads must be >= 1")
        share = self.decode_loop_prefill_share
        if share is not None and not (0.0 < share <= 1.0 and self.decode_loop_prefills):
            raise ValueError("decode_loop_prefill_share must be in (0, 1] (or None) and needs decode_loop_prefills")
        if self.decode_pool_tokens is not None and self.decode_pool_tokens < 1:
            raise ValueError("decode_pool_tokens must be >= 1 (or None: no pool)")
        if self.share_decode_min_batch is not None and self.share_decode_min_batch < 2:
            raise ValueError("share_decode_min_batch must be >= 2 (or None: never share)")
        if self.refine_after is not None and self.refine_after < 1:
            raise ValueError("refine_after must be >= 1 (or None: no refinement)")
        if self.refine_max_pending < 1 or self.refine_max_tracked < 1:
            raise ValueError("refine_max_pending and refine_max_tracked must be >= 1")
        if self.idle_decode_threads is not None and self.batching is DecodeBatching.INVARIANT:
            raise ValueError("idle_decode_threads changes the decode thread count, which changes float "
                             "rounding: it cannot be combined with batch-invariant decoding")


def default_torch_threads(prefill_workers: int) -> int:
    """Cores shared out between the prefill workers and the decode loop (at least one each).

    Args:
        prefill_workers: the number of prefill threads.

    Returns:
        Intra-op threads per worker and for the decode loop: the cores over ``prefill_workers + 1``, at least 1.
    """
    return max(1, (os.cpu_count() or 1) // (prefill_workers + 1))



@dataclass(frozen=True)
class ServeConfig:
    """The server as ``kvblend serve`` starts it."""

    host: str = "127.0.0.1"  # loopback unless asked
    port: int = 8000
    model: str = DEFAULT_MODEL
    dtype: str = DEFAULT_DTYPE
    store: str | None = None  # --store spec; None = the default store
    api_key: str | None = None  # None: no auth (or $KVBLEND_API_KEY, see resolve_api_key)
    experimental_semantic: bool = False
    served_model_name: str | None = None  # the id /v1/models reports; default the model argument
    default_temperature: float = DEFAULT_SERVE_TEMPERATURE  # when a request names none (OpenAI's default)
    inline_prepare_chars: int = 16_384  # smaller requests are tokenized on the event loop (no thread hop)
    inline_prepare_messages: int = 2  # ... and only with at most this many messages (no conversation history)
    limits: Limits = field(default_factory=Limits)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # blend requests that name no kvblend.attention_precision / linear_precision get these
    # (blend.policy.RecomputePrecision values; "compute": float32 above the check layer, as without them)
    attention_precision: str = DEFAULT_ATTENTION_PRECISION
    linear_precision: str = DEFAULT_LINEAR_PRECISION
    # the names a request's Host header may carry (None: any). `kvblend serve` on loopback without an API key
    # answers only loopback names (LOOPBACK_NAMES): a web page whose own name an attacker points at 127.0.0.1
    # (DNS rebinding) is then refused, where it could read every answer as same-origin
    allowed_hosts: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        for name, _ in RECOMPUTE_PRECISION_FIELDS:
            if getattr(self, name) not in RECOMPUTE_PRECISION_NAMES:
                raise ValueError(f"{name} must be one of {', '.join(RECOMPUTE_PRECISION_NAMES)}, "
                                 f"got {getattr(self, name)!r:.40}")

    @property
    def model_id(self) -> str:
        return self.served_model_name or self.model


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def default_allowed_hosts(host: str, api_key: str | None, extra: str | None) -> tuple[str, ...] | None:
    """The Host names a server answers: ``extra`` (comma-separated; ``*``: any) added to the loopback names
    when it listens on loopback without an API key; otherwise ``extra`` alone (None: any).

    Args:
        host: the address it listens on.
        api_key: its API key (None: none).
        extra: ``--allowed-hosts``.

    Returns:
        Lowercase names, or None for any.
    """
    names = tuple(n.strip().lower() for n in (extra or "").split(",") if n.strip())
    if "*" in names:
        return None
    if host in LOOPBACK_NAMES and api_key is None:
        return LOOPBACK_NAMES + tuple(n for n in names if n not in LOOPBACK_NAMES)
    return names or None


def host_name(header: str) -> str:
    """The name in a Host header ("[::1]:8000" -> "::1", "Example.com:80" -> "example.com").

    Args:
        header: the Host header's value.

    Returns:
        The host, lowercased, without its port or IPv6 brackets.
    """
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def resolve_api_key(explicit: str | None) -> str | None:
    """``--api-key`` if given, else ``$KVBLEND_API_KEY``; empty means none.

    Args:
        explicit: the ``--api-key`` value, or None where it was not given.

    Returns:
        The key, or None where the server takes requests without one.
    """
    key = explicit if explicit is not None else os.environ.get(API_KEY_ENV)
    return key or None
