"""The ``kvblend`` command line.

    kvblend ask QUESTION --doc FILE [--doc FILE ...] [--reuse exact|blend|none] [--json]
    kvblend check [--model M] [--json]
    kvblend eval ...      (see blend.evals.cli)
    kvblend ingest ...    (see blend.retrieval.cli)
    kvblend demo          (the README's main job)
    kvblend store stats|ls|verify|clear

Errors a user can cause print one line and exit 2; no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Sequence

from blend.errors import InvalidRequestError, KVBlendError
from blend.generation_cli import add_sampling_arguments, generate_answer, generation_config_from_args, stream_answer
from blend.policy import SELECTOR_NAMES, ReusePolicy

EXIT_USER_ERROR = 2


def read_document(path: str) -> str:
    """Read a UTF-8 text document, with a clear error for missing or non-UTF-8 files."""
    p = Path(path)
    if not p.is_file():
        raise InvalidRequestError(f"document {path}: no such file")
    data = p.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequestError(f"document {path}: not UTF-8 text (byte {e.start})") from None
    if not text.strip():
        raise InvalidRequestError(f"document {path}: empty")
    return text


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer numbers, got {text!r}") from None


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """--model, --dtype, --kv-dtype, --store: shared by every command that computes."""
    from blend.store.spec import add_store_argument

    p.add_argument("--model", default="smollm2-135m", help="model name or checkpoint directory")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--kv-dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="dtype KV is stored at (default: --dtype)")
    add_store_argument(p)


def add_policy_arguments(p: argparse.ArgumentParser) -> None:
    """--reuse and the blend knobs."""
    p.add_argument("--reuse", default="exact", choices=["exact", "blend", "none"],
                   help="exact prefix reuse (default), blended reuse (opt-in), or none")
    p.add_argument("--ratio", type=float, default=0.15, help="blend: share of reused tokens recomputed")
    p.add_argument("--selector", default="combo", choices=SELECTOR_NAMES,
                   help="blend: which rows to recompute (default combo: attention-weighted V deviation)")
    p.add_argument("--check-layers", type=_int_list, default=(1,), help="blend: e.g. 1 or 1,2")
    p.add_argument("--threshold", type=float, default=None,
                   help="blend: recompute rows whose relative deviation exceeds this (capped by --max-ratio)")
    p.add_argument("--max-ratio", type=float, default=0.5)
    p.add_argument("--min-prompt-tokens", type=int, default=0, help="blend: compute fully below this length")
    p.add_argument("--force-blend", action="store_true", help="blend even if the model's quality gate failed")
    p.add_argument("--semantic", action="store_true", help="blend: also reuse near-duplicate donor KV")
    p.add_argument("--experimental-semantic", action="store_true",
                   help="enable the experimental semantic-reuse path in the engine")


def policy_from_args(args: argparse.Namespace) -> ReusePolicy:
    """The request's :class:`ReusePolicy` from parsed arguments."""
    if args.reuse == "none":
        return ReusePolicy.none()
    if args.reuse == "exact":
        return ReusePolicy.exact()
    return ReusePolicy.blend(
        ratio=args.ratio, selector=args.selector, check_layers=args.check_layers, threshold=args.threshold,
        max_ratio=args.max_ratio, min_prompt_tokens=args.min_prompt_tokens, force=args.force_blend,
        semantic=args.semantic,
    )


def engine_from_args(args: argparse.Namespace):
    """Load the engine a command's arguments describe."""
    from blend.engine import Engine
    from blend.store.spec import open_store

    return Engine.load(args.model, dtype=args.dtype, store=open_store(args.store), kv_dtype=args.kv_dtype,
                       experimental_semantic=getattr(args, "experimental_semantic", False))


def answer_json(engine, ans) -> dict:
    """The JSON object ``kvblend ask --json`` prints."""
    report = ans.report.to_dict()
    return {
        "answer": ans.text,
        "answer_token_ids": ans.token_ids,
        "prompt_token_ids": ans.prompt_token_ids,
        "ttft_s": ans.ttft_s,
        "logits_sha256": ans.logits_sha256(),
        "model": engine.model_name,
        "provenance_sha256": engine.provenance.digest().hex(),
        "report": report,
    }


def print_report(ans, out=sys.stdout, with_answer: bool = True) -> None:
    """Human-readable answer and reuse report."""
    r = ans.report
    if with_answer:
        print(f"answer: {ans.text}", file=out)
    print(f"ttft: {ans.ttft_s * 1000:.1f} ms   policy: {r.policy}   prompt tokens: {r.prompt_tokens}   "
          f"reused: {r.reused_tokens}   recomputed: {r.recomputed_tokens}", file=out)
    for s in r.segments:
        extra = f" recomputed={s.recomputed}" if s.recomputed else ""
        note = f" ({s.note})" if s.note else ""
        print(f"  {s.kind.value:9s} {s.reuse_class.value:9s} {s.tokens:5d} tok @{s.start:<5d}{extra}{note}", file=out)
    if r.gate:
        print(f"gate: {r.gate}", file=out)


def run_ask(args: argparse.Namespace) -> int:
    if getattr(args, "index", None):
        from blend.retrieval.cli import ask_over_index

        return ask_over_index(args)
    if not args.doc:
        raise InvalidRequestError("give at least one --doc FILE (or --index DIR)")
    docs = [read_document(p) for p in args.doc]
    policy = policy_from_args(args)
    engine = engine_from_args(args)
    prompt = engine.build_prompt(args.question, docs, args.system)
    config = generation_config_from_args(args)  # issue 16: sampling options; streamed output
    if args.json:
        print(json.dumps(answer_json(engine, generate_answer(engine, prompt, policy, config))))
    else:
        print_report(stream_answer(engine, prompt, policy, config), with_answer=False)
    return 0


def run_check(args: argparse.Namespace) -> int:
    from blend.gate import run_gate_cli

    return run_gate_cli(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvblend", description="KV reuse for RAG prompts")
    sub = parser.add_subparsers(dest="command", required=True)

    ask = sub.add_parser("ask", help="answer a question over documents")
    ask.add_argument("question")
    ask.add_argument("--doc", action="append", default=[], metavar="FILE", help="a document (repeatable)")
    ask.add_argument("--index", default=None, metavar="DIR", help="retrieve documents from an index")
    ask.add_argument("--top-k", type=int, default=5)
    ask.add_argument("--system", default=None, help="system prompt")
    ask.add_argument("--max-new-tokens", type=int, default=32)
    ask.add_argument("--json", action="store_true", help="print one JSON object")
    add_sampling_arguments(ask)
    add_engine_arguments(ask)
    add_policy_arguments(ask)
    ask.set_defaults(func=run_ask)

    check = sub.add_parser("check", help="the per-model quality gate for blended reuse")
    check.add_argument("--json", action="store_true")
    check.add_argument("--items", type=int, default=4, help="calibration prompts")
    add_engine_arguments(check)
    check.set_defaults(func=run_check)

    # --- kvblend serve (issue 16): parsed by blend.serve.cli, imported only when serve runs (FastAPI) ---
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (kvblend serve --help)",
                           add_help=False, prefix_chars="+")  # "+": every -- option reaches serve's own parser
    serve.add_argument("serve_args", nargs="*", help=argparse.SUPPRESS)
    serve.set_defaults(func=lambda args: importlib.import_module("blend.serve.cli").main(args.serve_args))
    # --- end kvblend serve ---
    _add_optional(sub, "blend.store.cli", "add_store_commands", "run_store_command")
    _add_optional(sub, "blend.evals.cli", "add_eval_command", "run_eval")
    _add_optional(sub, "blend.retrieval.cli", "add_retrieval_commands", None)
    return parser


def _add_optional(sub, module: str, adder: str, runner: str | None) -> None:
    import importlib

    try:
        mod = importlib.import_module(module)
    except ImportError:
        return
    p = getattr(mod, adder)(sub)
    if runner is not None and p is not None:
        p.set_defaults(func=getattr(mod, runner))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvblend`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KVBlendError as e:
        print(f"kvblend: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except (ValueError, OSError) as e:  # typed errors of the store/eval/retrieval layers
        print(f"kvblend: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("kvblend: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
