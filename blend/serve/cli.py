"""``kvblend serve``: argument parsing and start-up.

    kvblend serve [--host 127.0.0.1] [--port 8000] [--model M] [--store SPEC]
                  [--api-key KEY | $KVBLEND_API_KEY] [--max-concurrency N] [--max-queue N]
                  [--prefill-workers N] [--batch-invariant] [--experimental-semantic] ...

``blend.cli`` imports this module only when ``serve`` runs, so the other
commands never load FastAPI or uvicorn.
"""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING, Sequence

from blend.decode_batching import DecodeBatching
from blend.defaults import (
    DEFAULT_ATTENTION_PRECISION, DEFAULT_LINEAR_PRECISION, DEFAULT_LOG_LEVEL, DTYPE_NAMES, LOG_LEVELS,
)
from blend.serve.config import (
    API_KEY_ENV, Limits, SchedulerConfig, ServeConfig, default_allowed_hosts, default_torch_threads, resolve_api_key,
)
from blend.cli_messages import OneLineParser, flag_names, in_flag_words
from blend.options import add_store_argument
from blend.policy import RECOMPUTE_PRECISION_NAMES, RecomputePrecision
from blend.store.spec import open_store

if TYPE_CHECKING:
    from blend.engine import Engine

# The engine (torch, transformers), the app (FastAPI) and uvicorn load in build_engine and main: the parser
# alone (`kvblend serve --help`, a bad flag) imports none of them.

_DEFAULT = ServeConfig()


def _port(text: str) -> int:
    """--port: a TCP port number, 0-65535 (0: any free port)."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 0-65535, got {text!r}")
    return port


def build_parser() -> argparse.ArgumentParser:
    """The ``kvblend serve`` parser (defaults from :mod:`blend.serve.config`).

    Returns:
        The parser; it reports a bad flag in one line and exits with status 2.
    """
    lim, sch = _DEFAULT.limits, _DEFAULT.scheduler
    p = OneLineParser(prog="kvblend serve",
                                description="OpenAI-compatible HTTP server with KV reuse of explicit documents")
    p.add_argument("--host", default=_DEFAULT.host, help="bind address (default loopback)")
    p.add_argument("--port", type=_port, default=_DEFAULT.port)
    p.add_argument("--model", default=_DEFAULT.model, help="model name or checkpoint directory")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default --model)")
    p.add_argument("--dtype", default=_DEFAULT.dtype, choices=DTYPE_NAMES)
    add_store_argument(p)
    p.add_argument("--api-key", default=None, help=f"require 'Authorization: Bearer KEY' (default ${API_KEY_ENV})")
    p.add_argument("--max-concurrency", type=int, default=sch.max_concurrency,
                   help="requests prefilling or decoding at once (the decode batch's bound)")
    p.add_argument("--max-queue", type=int, default=sch.max_queue, help="requests waiting beyond that; more get 429")
    p.add_argument("--prefill-workers", type=int, default=sch.prefill_workers,
                   help="prefill threads beside the decode loop")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="intra-op threads per prefill worker and for the decode loop "
                        "(default: the cores divided among them)")
    p.add_argument("--idle-decode-threads", type=int, default=None,
                   help="intra-op threads of the decode loop while no prefill runs (default: --torch-threads; "
                        "more helps only on cores nobody else uses: OpenMP teams on shared cores stall)")
    p.add_argument("--share-decode-min-batch", type=int, default=sch.share_decode_min_batch,
                   help="a decode step over at least this many sequences runs part of them on an idle "
                        "prefill worker's core (0: never)")
    p.add_argument("--decode-pool-tokens", type=int, default=sch.decode_pool_tokens,
                   help="rows per slot of the decode pool: a decoding sequence whose cache fits moves into a "
                        "slot, and a step attends once per layer over all slots (0: no pool, attention per "
                        "sequence; memory is touched only where sequences write)")
    p.add_argument("--no-decode-loop-prefills", action="store_true",
                   help="never let an idle decode loop run a waiting prefill (default: it does while every "
                        "prefill worker is busy)")
    p.add_argument("--decode-loop-prefill-share", type=float, default=None, metavar="S",
                   help="let the decode loop also run waiting prefills while it has sequences to decode, "
                        "up to this share of its time (above 0, at most 1; default: only when it has nothing to decode): "
                        "more tokens/s under a queue, streams pause while it prefills")
    p.add_argument("--refine-after", type=int, default=sch.refine_after or 0, metavar="N",
                   help="compute the exact KV of a document order on an idle prefill worker once N blends saw "
                        "it, so later blends of that order are exact (bit-identical to a full prefill); "
                        "0: off (default)")
    p.add_argument("--attention-precision", default=DEFAULT_ATTENTION_PRECISION, choices=RECOMPUTE_PRECISION_NAMES,
                   help="blend requests that name no kvblend.attention_precision: dtype of the recomputed rows' "
                        "attention above the last check layer (compute, bf16, auto: bf16 on a CPU with native "
                        "bf16; default: %(default)s)")
    p.add_argument("--linear-precision", default=DEFAULT_LINEAR_PRECISION, choices=RECOMPUTE_PRECISION_NAMES,
                   help="the same for their linear layers (kvblend.linear_precision; default: %(default)s)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="decode in fixed 16-row GEMM tiles: concurrent answers bit-identical to one-at-a-time "
                        "(slower on CPU)")
    p.add_argument("--no-single-flight", action="store_true",
                   help="let in-flight requests compute a shared missing chunk each")
    p.add_argument("--experimental-semantic", action="store_true",
                   help="allow kvblend.semantic (donor KV from near-duplicate documents)")
    p.add_argument("--max-documents", type=int, default=lim.max_documents)
    p.add_argument("--max-messages", type=int, default=lim.max_messages,
                   help="most chat messages per request (a conversation's cost grows faster than its length)")
    p.add_argument("--max-prompt-tokens", type=int, default=lim.max_prompt_tokens,
                   help="default: the model's context")
    p.add_argument("--max-tokens-limit", type=int, default=lim.max_tokens, help="largest max_tokens a request may ask")
    p.add_argument("--default-max-tokens", type=int, default=lim.default_max_tokens)
    p.add_argument("--max-body-bytes", type=int, default=lim.max_body_bytes)
    p.add_argument("--body-timeout", type=float, default=lim.body_timeout_s,
                   help="seconds a client has to send its whole request body (408 after)")
    p.add_argument("--header-timeout", type=float, default=lim.head_timeout_s,
                   help="seconds a client has to send a request's line and headers once its connection is "
                        "ready for one (opened, or done with its last response); the connection ends after it")
    p.add_argument("--write-timeout", type=float, default=lim.write_timeout_s, metavar="S",
                   help="seconds a client may take none of its response's bytes while the server waits on it (a "
                        "client that stopped reading); its connection is then closed. A slow client that keeps "
                        "reading is never cut (default: %(default)s)")
    p.add_argument("--graceful-shutdown", type=float, default=lim.graceful_shutdown_s, metavar="S",
                   help="on SIGTERM or Ctrl-C: queued requests get a 503 at once, running ones this many seconds "
                        "to finish (then a 503, or an error event in their stream) (default: %(default)s)")
    p.add_argument("--allowed-hosts", default=None, metavar="NAMES",
                   help="Host header names to answer, comma-separated ('*': any). On loopback without an API "
                        "key the loopback names are always allowed and no other (a DNS-rebinding page is refused)")
    p.add_argument("--max-connections", type=int, default=lim.max_connections,
                   help="connections held at once (503 past it)")
    p.add_argument("--log-level", default=DEFAULT_LOG_LEVEL, choices=LOG_LEVELS)
    return p


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The :class:`ServeConfig` the parsed arguments describe.

    Args:
        args: the parsed ``kvblend serve`` arguments.

    Returns:
        The server's config (``--torch-threads`` unset: the cores shared out by :func:`default_torch_threads`).

    Raises:
        ValueError: a setting the config's own checks refuse (it names the field).
    """
    return ServeConfig(
        host=args.host, port=args.port, model=args.model, dtype=args.dtype, store=args.store,
        api_key=resolve_api_key(args.api_key), experimental_semantic=args.experimental_semantic,
        served_model_name=args.served_model_name,
        allowed_hosts=default_allowed_hosts(args.host, resolve_api_key(args.api_key), args.allowed_hosts),
        limits=Limits(max_body_bytes=args.max_body_bytes, max_documents=args.max_documents,
                      max_messages=args.max_messages,
                      max_prompt_tokens=args.max_prompt_tokens, max_tokens=args.max_tokens_limit,
                      default_max_tokens=args.default_max_tokens, body_timeout_s=args.body_timeout,
                      head_timeout_s=args.header_timeout, write_timeout_s=args.write_timeout,
                      max_connections=args.max_connections,
                      graceful_shutdown_s=args.graceful_shutdown),
        attention_precision=args.attention_precision, linear_precision=args.linear_precision,
        scheduler=SchedulerConfig(
            max_concurrency=args.max_concurrency, max_queue=args.max_queue, prefill_workers=args.prefill_workers,
            batching=DecodeBatching.INVARIANT if args.batch_invariant else DecodeBatching.THROUGHPUT,
            single_flight=not args.no_single_flight,
            torch_threads=(default_torch_threads(args.prefill_workers) if args.torch_threads is None
                           else args.torch_threads),  # 0 is refused by SchedulerConfig, not read as the default
            idle_decode_threads=args.idle_decode_threads,
            share_decode_min_batch=args.share_decode_min_batch or None,
            decode_loop_prefills=not args.no_decode_loop_prefills,
            decode_loop_prefill_share=args.decode_loop_prefill_share,
            decode_pool_tokens=args.decode_pool_tokens or None,
            refine_after=args.refine_after or None,
        ),
    )


def build_engine(config: ServeConfig) -> Engine:
    """The engine a server runs: its store wrapped for single-flight claims.

    Args:
        config: the server's config (model, dtype, store spec, semantic reuse, linear precision).

    Returns:
        The loaded engine, its blend weight copies prepared.
    """
    from blend.engine import Engine
    from blend.serve.flight import FlightStore

    store = FlightStore(open_store(config.store))
    engine = Engine.load(config.model, dtype=config.dtype, store=store,
                         experimental_semantic=config.experimental_semantic)
    # the probe's bf16 weight copy (and the recomputed rows', under --linear-precision) now, not on the first blend
    engine.prepare_blend(linear=RecomputePrecision(config.linear_precision))
    return engine


def main(argv: Sequence[str] | None = None) -> int:
    """Run the server until interrupted.

    Args:
        argv: the arguments after ``serve``; None: ``sys.argv[1:]``.

    Returns:
        0 once the server has shut down (a bad flag or setting exits with status 2, argparse's usage error).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as e:  # a setting's own check names its field: say the flag
        parser.error(str(e))
    import uvicorn

    from blend.serve.app import create_app
    from blend.serve.connection import uvicorn_options
    from blend.serve.shutdown import DrainingServer

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    engine = build_engine(config)
    app = create_app(engine, config)
    if config.api_key is None and config.host not in ("127.0.0.1", "localhost", "::1"):
        logging.getLogger(__name__).warning("serving on %s without an API key", config.host)
    DrainingServer(uvicorn.Config(app, log_level=args.log_level, **uvicorn_options(config, app.state.metrics)),
                   app.state.scheduler).run()
    return 0
