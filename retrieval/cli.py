"""``kvblend ingest``, ``kvblend demo`` and ``kvblend ask --index``.

The main CLI (``blend.cli``) calls :func:`add_ingest_command` and
:func:`add_demo_command` to register ``ingest`` and ``demo``, and
:func:`ask_over_index` when ``ask --index`` is set; options and engine
loading come from :mod:`blend.options`.
Every ``run_*`` returns an exit status: 0 ok; 1 the run finished but some input
or answer was bad (listed); 2 a user error, printed as one ``kvblend: error:`` line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import blend
from blend import json_text
from blend.cli_messages import flag_names, in_flag_words, named_fields
from blend.exit_codes import ExitCode
from blend.defaults import (
    DEFAULT_APPROX_THRESHOLD, DEFAULT_CHUNK_TOKENS, DEFAULT_DEMO_TOP_K, DEFAULT_MAX_NEW_TOKENS, DEFAULT_RATIO,
    kvblend_home,
)
from blend.errors import KVBlendError
from blend.generation_cli import generation_config_from_args, print_stream
from blend.options import (
    add_engine_arguments, add_model_arguments, add_store_argument, engine_from_args, load_engine, policy_from_args,
    read_document,
)
from blend.policy import ReuseMode, ReusePolicy
from blend.retrieval.chunker import ChunkerConfig
from blend.retrieval.corpus import RetrievalError, expand_paths
from blend.retrieval.index_kind import IndexKind
from blend.store.spec import default_spec, redacted_spec
from blend.terminal_text import shown

# The index (faiss), the embedder, ingestion and the RAG pipeline (torch) load in the run_* functions that use
# them: registering these commands (`kvblend --help`, an argument error) imports none of them.

USER_ERRORS: tuple[type[BaseException], ...] = (RetrievalError, FileNotFoundError, ValueError, KVBlendError)


def demo_dir() -> Path:
    """The demo corpus shipped in the package (``blend/data/demo``).

    Returns:
        The folder inside the installed ``blend`` package.
    """
    return Path(blend.__file__).resolve().parent / "data" / "demo"


RESUMABLE = "kvblend: interrupted (finished files are saved; re-run to resume)"


def _guard(fn: Callable[[argparse.Namespace], int], args: argparse.Namespace,
           interrupted: str = "kvblend: interrupted") -> int:
    try:
        return fn(args)
    except USER_ERRORS as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        parser = getattr(args, "parser", None)
        if parser is not None:  # the flag a user typed
            msg = in_flag_words(msg, flag_names(parser), named_fields(e))
        print(f"kvblend: error: {shown(msg)}", file=sys.stderr)  # an index's recorded names may hold escapes
        return ExitCode.USER_ERROR
    except KeyboardInterrupt:
        print(interrupted, file=sys.stderr)
        return ExitCode.INTERRUPTED


def add_ingest_command(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``ingest`` on the main CLI's subparsers.

    Args:
        subparsers: the result of ``parser.add_subparsers(dest="command")``.

    Returns:
        The ``ingest`` parser.
    """
    p = subparsers.add_parser("ingest", help="chunk, embed, index and precompute KV for a corpus")
    p.add_argument("paths", nargs="+", metavar="PATH", help=".txt, .md, .jsonl files or folders")
    p.add_argument("--index", required=True, metavar="DIR", help="index folder (created if absent)")
    add_engine_arguments(p)  # --model, --dtype, --kv-dtype, --gemm, --store: the chunk KV's keys, as `ask`'s
    p.add_argument("--system", default=None,
                   help="the system prompt the chunks will be asked under (part of their KV's key, as in `ask`)")
    p.add_argument("--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS,
                   help="target tokens per chunk (default: %(default)s)")
    p.add_argument("--overlap", type=int, default=0, help="tokens of whole sentences repeated between chunks")
    p.add_argument("--index-kind", choices=[k.value for k in IndexKind], default="auto",
                   help="auto: exact below --approx-threshold vectors, HNSW above")
    p.add_argument("--approx-threshold", type=int, default=DEFAULT_APPROX_THRESHOLD)
    p.add_argument("--no-kv", action="store_true", help="index only; do not precompute chunk KV")
    p.add_argument("--refresh-kv", action="store_true",
                   help="make sure every indexed chunk's KV is in the store (e.g. after emptying it); "
                        "done anyway when the engine's KV keys changed since the last ingest")
    p.add_argument("--experimental-semantic", action="store_true",
                   help="also register each chunk it precomputes KV for as a semantic donor (in the store's donor "
                        "log), as a semantic engine does on first use, so `ask --semantic` finds near-duplicates "
                        "of chunks never asked about (default: off)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run_ingest)
    return p


def add_demo_command(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``demo`` on the main CLI's subparsers.

    Args:
        subparsers: the result of ``parser.add_subparsers(dest="command")``.

    Returns:
        The ``demo`` parser.
    """
    d = subparsers.add_parser("demo", help="ingest the bundled corpus and answer its questions with KV reuse")
    add_store_argument(d)
    add_model_arguments(d)
    d.add_argument("--top-k", type=int, default=DEFAULT_DEMO_TOP_K)
    d.add_argument("--reuse", choices=[ReuseMode.EXACT.value, ReuseMode.BLEND.value], default=ReuseMode.BLEND.value)
    d.add_argument("--ratio", type=float, default=DEFAULT_RATIO, help="blend recompute ratio (default: %(default)s)")
    d.add_argument("--force-blend", action="store_true", help="blend even if the model's quality gate failed")
    d.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    d.add_argument("--index", default=None, metavar="DIR", help="default: $KVBLEND_HOME/demo-index")
    d.set_defaults(func=run_demo)
    return d


def run_ingest(args: argparse.Namespace) -> int:
    """``kvblend ingest PATH... --index DIR [--store SPEC]``.

    Args:
        args: the parsed ``ingest`` arguments.

    Returns:
        The exit status: 0; 1 when a file had an issue or some chunk KV was not saved; 2 for an error a user
        caused (one line on stderr); 130 on Ctrl-C (finished files are kept).
    """
    return _guard(_ingest, args, RESUMABLE)


def _ingest(args: argparse.Namespace) -> int:
    from blend.retrieval.catalog import Catalog
    from blend.retrieval.embedder import Embedder
    from blend.retrieval.engine_kv import engine_kv_sync
    from blend.retrieval.ingest import ingest, nothing_to_ingest, print_issues
    from blend.retrieval.ingest_options import IngestOptions

    files, issues = expand_paths(args.paths)
    if not files and not Catalog.exists(Path(args.index).expanduser()):  # fail before loading any model
        raise RetrievalError(nothing_to_ingest(issues))  # (an existing index may still lose files that went)
    config = ChunkerConfig(target_tokens=args.chunk_tokens, overlap_tokens=args.overlap)
    engine = engine_from_args(args)
    summary = ingest(args.paths, args.index, tokenizer=engine.tokenizer, embedder=Embedder.load(),
                     tokenizer_fp=engine.provenance.tokenizer_sha256,
                     kv=engine_kv_sync(engine, args.system, write=not args.no_kv, refresh=args.refresh_kv),
                     options=IngestOptions(config=config, kind=IndexKind(args.index_kind),
                                           threshold=args.approx_threshold, progress=not args.quiet))
    print_issues(summary.issues)
    print(f"ingest: {summary.format()}")
    return ExitCode.FAILED if summary.issues or summary.kv_unsaved else ExitCode.OK


def ask_over_index(args: argparse.Namespace) -> int:
    """``kvblend ask QUESTION --index DIR --top-k K --reuse exact|blend``.

    Args:
        args: the parsed ``ask`` arguments (``--index`` given).

    Returns:
        The exit status: 0; 2 for an error a user caused (one line on stderr); 130 on Ctrl-C.
    """
    return _guard(_ask, args)


def _ask(args: argparse.Namespace) -> int:
    from blend.retrieval.pipeline import RAG

    rag = RAG.open(args.index, system=args.system)  # a missing index fails before any model loads
    policy = policy_from_args(args)
    config = generation_config_from_args(args)  # --temperature, --top-p, --seed, --stop, --multiline: before the load
    extra = [read_document(p) for p in args.doc]  # --doc beside --index: after the retrieved chunks
    rag = RAG(rag.catalog, None, engine_from_args(args), system=rag.system)
    if rag.kv_stale():
        print(f"kvblend: note: {args.index}'s chunk KV was precomputed by another engine or system prompt; "
              f"its chunks are computed per request until `kvblend ingest` runs again with this one",
              file=sys.stderr)
    if args.json:
        ans = rag.ask(args.question, top_k=args.top_k, policy=policy, extra_documents=extra, config=config)
        print(json_text.dumps({  # a --doc document's score (NaN: it was not retrieved) is null
            "answer": ans.answer, "ttft_s": ans.ttft_s, "policy": ans.policy, "finish_reason": ans.finish_reason,
            "seed": ans.seed, "retrieved": [r.__dict__ for r in ans.retrieved],
            "reuse": [c.__dict__ for c in ans.reuse], "report": ans.report,
        }, indent=1))
        return 0
    g = rag.stream(args.question, top_k=args.top_k, policy=policy, extra_documents=extra, config=config)
    print_stream(g, sys.stdout, prefix="")  # the answer as it is decoded
    ans = g.result()
    seed = f"; seed {ans.seed}" if config.temperature > 0 else ""
    gate = f" ({ans.report['gate']})" if ans.report.get("gate") else ""  # why reuse was refused
    print(f"  policy {ans.policy}; ran {ans.report.get('applied', '')}{gate}; TTFT {ans.ttft_s * 1000:.1f} ms{seed}")
    _print_chunks(ans)
    return 0


def _print_chunks(ans: Any, indent: str = "  ") -> None:
    for r, c in zip(ans.retrieved, ans.reuse):
        where = os.path.basename(r.source.split(":")[0]) + (":" + r.source.split(":")[1] if r.source.count(":") else "")
        where = shown(where)  # an index records any path string: escape sequences are shown escaped
        score = f"{r.score:.3f}" if math.isfinite(r.score) else "  -  "  # a --doc document has none
        print(f"{indent}[{score}] {shown(r.chunk_id[:12])} {where:<18} {c.reuse_class:<9} "
              f"{c.tokens} tok, {c.recomputed} recomputed")


def run_demo(args: argparse.Namespace) -> int:
    """``kvblend demo``: ingest the bundled corpus, answer its questions, compare TTFT.

    Args:
        args: the parsed ``demo`` arguments.

    Returns:
        The exit status: 0 when every answer holds an accepted string, else 1; 2 for an error a user caused;
        130 on Ctrl-C.
    """
    return _guard(_demo, args, RESUMABLE)  # its ingest resumes as ingest's does


def _demo(args: argparse.Namespace) -> int:
    from blend.retrieval.embedder import Embedder
    from blend.retrieval.engine_kv import engine_kv_sync
    from blend.retrieval.ingest import ingest, print_issues
    from blend.retrieval.pipeline import RAG

    policy = policy_from_args(args)  # every setting checked before the minutes of loading and ingesting
    if args.top_k < 1:
        raise ValueError(f"--top-k must be >= 1, got {args.top_k}")
    home = kvblend_home()
    index = Path(args.index) if args.index else home / "demo-index"
    spec = args.store if args.store else default_spec()  # $KVBLEND_STORE, else disk:$KVBLEND_HOME/store
    print(f"demo: model {args.model}, index {index}, store {redacted_spec(spec)}")
    t0 = time.perf_counter()
    engine = load_engine(args.model, args.dtype, spec)
    embedder = Embedder.load()
    print(f"demo: loaded model and embedder in {time.perf_counter() - t0:.1f} s")
    summary = ingest([demo_dir()], index, tokenizer=engine.tokenizer, embedder=embedder,
                     tokenizer_fp=engine.provenance.tokenizer_sha256, kv=engine_kv_sync(engine))
    print_issues(summary.issues)
    print(f"ingest: {summary.format()}")
    questions = json.loads((demo_dir() / "questions.json").read_text())["questions"]
    rag = RAG.open(index, engine=engine, embedder=embedder)
    full = ReusePolicy.one_pass()  # the fastest full prefill: the ratio's reference
    for warm in (full, policy):  # untimed warm-up (a first blend request may also run the quality gate once)
        rag.ask(questions[0]["question"], top_k=args.top_k, policy=warm, max_new_tokens=2)
    correct, ratios, classes = 0, [], {}  # classes: reuse class -> chunks
    for i, q in enumerate(questions, start=1):
        ans = rag.ask(q["question"], top_k=args.top_k, policy=policy, max_new_tokens=args.max_new_tokens)
        ref = rag.ask(q["question"], top_k=args.top_k, policy=full, max_new_tokens=args.max_new_tokens)
        ok = answer_matches(ans.answer, q.get("accept") or [q["answer"]])
        correct += ok
        ratios.append(ans.ttft_s / max(ref.ttft_s, 1e-9))
        print(f"\nQ{i}: {q['question']}")
        print(f"  answer ({args.reuse}): {ans.answer!r}  expected {q['answer']!r} {'OK' if ok else 'WRONG'}")
        print(f"  full prefill answer: {ref.answer!r}")
        print(f"  TTFT {args.reuse} {ans.ttft_s * 1000:.1f} ms vs full prefill {ref.ttft_s * 1000:.1f} ms "
              f"({ratios[-1]:.2f}x)")
        _print_chunks(ans)
        for c in ans.reuse:
            classes[c.reuse_class] = classes.get(c.reuse_class, 0) + 1
    tally = ", ".join(f"{k} {v}" for k, v in sorted(classes.items()))
    print(f"\ndemo: {correct}/{len(questions)} answered correctly; chunk reuse: {tally}; mean TTFT "
          f"{sum(ratios) / len(ratios):.2f}x of full prefill")
    return ExitCode.OK if correct == len(questions) else ExitCode.FAILED


def answer_matches(answer: str, accepted: list[str]) -> bool:
    """Whether any accepted string occurs in the answer (case- and space-insensitive).

    Args:
        answer: the model's answer (``*`` marks ignored).
        accepted: the accepted answers.

    Returns:
        Whether one of them occurs in it.
    """
    norm = " ".join(answer.lower().replace("*", "").split())
    return any(" ".join(a.lower().split()) in norm for a in accepted)
