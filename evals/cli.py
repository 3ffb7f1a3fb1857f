"""``kvblend eval``: the evaluation command.

The main CLI registers it with :func:`add_eval_command` and dispatches to
:func:`run_eval`; ``python -m blend.evals.cli ...`` runs it standalone.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from blend.defaults import DEFAULT_DTYPE, DEFAULT_MODEL
from blend.evals.data import DataError, load_items
from blend.evals.eval_config import EvalConfig
from blend.evals.splits import parse_item_range
from blend.evals.methods import DEFAULT_METHODS, MethodError, parse_methods
from blend.progress import Progress
from blend.exit_codes import ExitCode
from blend.termination import Terminated


def _config_default(name: str) -> Any:
    """An :class:`EvalConfig` field's default: the command line's, stated once."""
    return EvalConfig.__dataclass_fields__[name].default


def _positive(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def configure_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the eval options to a parser.

    Args:
        p: the (sub)parser.

    Returns:
        The same parser.
    """
    p.add_argument("--data", required=True,
                   help="JSON/JSONL file of CacheBlend records ({ctxs, question, answers}) or of your own questions "
                        "({question, documents}; answers optional), or synthetic:single / synthetic:two-hop")
    p.add_argument("--limit", type=_positive, default=30,
                   help="number of items from item 0 (default 30: musique_dev's tuning split, 0-29; results.md "
                        "names the range and its split)")
    p.add_argument("--items", default=None,
                   help="item range A-B of the data, 0-based inclusive (overrides --limit), e.g. 30-99 "
                        "(musique_dev: 0-29 is the tuning split, 30-99 the validation split)")
    p.add_argument("--passages", type=_positive, default=5, help="documents per item (default 5)")
    p.add_argument("--methods", default=DEFAULT_METHODS,
                   help="comma list: full, prefix, reuse, blend@R[:selector][:check=L,...] "
                        f"(default {DEFAULT_METHODS}; full is always run)")
    p.add_argument("--out", required=True, type=Path, help="output folder")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model name or path (default {DEFAULT_MODEL})")
    p.add_argument("--dtype", default=DEFAULT_DTYPE, help="compute dtype (default %(default)s)")
    p.add_argument("--store", default=None, help="KV store spec passed to the engine (default: in memory)")
    p.add_argument("--max-new-tokens", type=_positive, default=_config_default("max_new_tokens"),
                   help="answer length limit (default %(default)s)")
    p.add_argument("--repeats", type=_positive, default=_config_default("repeats"),
                   help="TTFT samples per method and item; the median is kept (default %(default)s)")
    p.add_argument("--warmup", type=int, default=_config_default("warmup"),
                   help="untimed warm-up rounds before timing (default %(default)s)")
    p.add_argument("--seed", type=int, default=_config_default("seed"),
                   help="seed of synthetic data and bootstrap (default %(default)s)")
    p.add_argument("--system", default=None, help="system prompt (default: the engine's)")
    p.add_argument("--bootstrap", type=_positive, default=_config_default("bootstrap"),
                   help="bootstrap resamples (default %(default)s)")
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted run from --out/rows.jsonl; methods added to --methods are "
                        "run on the items already done (beside a freshly timed full prefill)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def add_eval_command(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``eval`` on an ``argparse`` subparsers object.

    Args:
        subparsers: the result of ``parser.add_subparsers()``.

    Returns:
        The eval parser (its ``func`` default is :func:`run_eval`).
    """
    p = subparsers.add_parser("eval", help="evaluate reuse methods against full prefill",
                              description=__doc__.splitlines()[0])
    configure_parser(p)
    p.set_defaults(func=run_eval)
    return p


def config_from_args(args: argparse.Namespace) -> EvalConfig:
    """The run config of parsed arguments (methods already canonical, ``full`` first)."""
    methods = parse_methods(args.methods)
    return EvalConfig(
        data=args.data, limit=args.limit, passages=args.passages, methods=tuple(m.name for m in methods),
        model=args.model, dtype=args.dtype, store=args.store, max_new_tokens=args.max_new_tokens,
        repeats=args.repeats, warmup=args.warmup, seed=args.seed, system=args.system, bootstrap=args.bootstrap,
        items=getattr(args, "items", None),
    )


def _load_engine(config: EvalConfig) -> Any:
    """The engine of a run; the default store is in-process memory (``--store`` opens another)."""
    from blend.engine import Engine
    from blend.store.spec import open_store

    store = open_store(config.store) if config.store else None
    # the harness measures blend quality itself: the per-model gate must not refuse or pre-empt it
    return Engine.load(model=config.model, dtype=config.dtype, store=store, quality_gate=False)


def _engine_errors() -> tuple[type[Exception], ...]:
    """The engine's user-facing errors (unknown model, over-long prompt, bad policy, bad store)."""
    try:
        from blend.errors import KVBlendError
        from blend.store.spec import StoreSpecError
    except ImportError:
        return ()
    return (KVBlendError, StoreSpecError)


def run_eval(
    args: argparse.Namespace,
    engine_factory: Callable[[EvalConfig], Any] | None = None,
    policy_of: Callable[[Any], Any] | None = None,
) -> int:
    """Run ``kvblend eval``.

    Args:
        args: parsed arguments (see :func:`configure_parser`).
        engine_factory: config -> engine-like object (default :meth:`Engine.load`); tests inject fakes.
        policy_of: method -> policy (default :meth:`Method.policy`); tests inject fakes.

    Returns:
        Exit status: 0 on success, 2 on bad input (data, methods, resume mismatch, an
        engine error such as an unknown model or an over-long prompt; rows done so far are kept).
    """
    # the harness, its metrics (torch) and the plots load here: `kvblend --help` and eval's parser stay light
    from blend.evals.answer_survival import write_plot as write_survival
    from blend.evals.harness import ResumeError, run_harness
    from blend.evals.plot import write_pareto
    from blend.evals.report import markdown, write_markdown
    from blend.evals.results_schema import write_json

    try:
        methods = parse_methods(args.methods)
        config = config_from_args(args)
        if config.warmup < 0:
            raise MethodError(f"--warmup must be >= 0, got {config.warmup}")
        first = 0
        if config.items is not None:
            first, last = parse_item_range(config.items)
            loaded = load_items(config.data, last + 1, config.passages, seed=config.seed)
            items = loaded[first:]
            if len(items) < last + 1 - first:
                raise DataError(f"--items {config.items}: the data holds only {len(loaded)} items")
        else:
            items = load_items(config.data, config.limit, config.passages, seed=config.seed)
    except (DataError, MethodError, ValueError) as e:
        print(f"kvblend eval: error: {e}", file=sys.stderr)
        return ExitCode.USER_ERROR
    out: Path = args.out
    progress = None if args.no_progress else Progress(total=len(items))
    try:
        engine = (engine_factory or _load_engine)(config)
        results = run_harness(
            engine, items, methods, config, out, resume=args.resume, progress=progress, policy_of=policy_of,
            first_index=first,
        )
    except (ResumeError, *_engine_errors()) as e:
        print(f"kvblend eval: error: {e}", file=sys.stderr)
        return ExitCode.USER_ERROR
    except (KeyboardInterrupt, Terminated) as e:
        print(f"kvblend eval: {'terminated' if isinstance(e, Terminated) else 'interrupted'}: the items done are "
              f"in {out / 'rows.jsonl'}; the same command with --resume goes on from there", file=sys.stderr)
        return ExitCode.TERMINATED if isinstance(e, Terminated) else ExitCode.INTERRUPTED
    write_json(results, out / "results.json")
    write_markdown(results, out / "results.md")
    write_pareto(results, out / "pareto.png")
    survival = write_survival(results, out / "answer_survival.png")
    print(markdown(results))
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'pareto.png'}"
          + (f", {survival}" if survival else ""))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point: ``python -m blend.evals.cli --data ... --out ...``."""
    parser = configure_parser(argparse.ArgumentParser(prog="kvblend eval", description=__doc__.splitlines()[0]))
    return run_eval(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
