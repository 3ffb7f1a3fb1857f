"""Command-line options -> engine, policy and store: shared by every CLI and the API.

The argument *definitions* import nothing heavy (no torch, no faiss, no eval
harness), so building any parser stays fast; the engine is imported when an
engine is actually built.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from blend import safeio
from blend.defaults import (
    DEFAULT_ATTENTION_PRECISION, DEFAULT_AUTO_TARGET, DEFAULT_CANDIDATES, DEFAULT_CHECK_LAYERS, DEFAULT_DTYPE,
    DEFAULT_GEMM, DEFAULT_GUARD_MARGIN, DEFAULT_GUARD_MODE, DEFAULT_GUARD_RATIO, DEFAULT_LINEAR_PRECISION,
    DEFAULT_MAX_RATIO, DEFAULT_MIN_PROMPT_TOKENS, DEFAULT_MODEL, DEFAULT_PROBE_PRECISION, DEFAULT_RATIO,
    DEFAULT_REUSED_TEMPERATURE, DEFAULT_SELECTOR, DTYPE_NAMES, GEMM_CHOICES, MAX_DOCUMENT_BYTES,
    REUSED_TEMPERATURE_RANGE,
)
from blend.errors import InvalidPolicyError, InvalidRequestError
from blend.policy import (
    GUARD_MODE_NAMES, POLICY_DEFAULTS, PROBE_PRECISION_NAMES, RECOMPUTE_PRECISION_NAMES, SELECTOR_NAMES, BudgetMode,
    GuardMode, ProbePrecision, RecomputePrecision, ReuseMode, ReusePolicy,
)
from blend.policy_rules import BLEND_OPTIONS, setting_changed

if TYPE_CHECKING:
    from blend.engine import Engine

REUSE_CHOICES = tuple(m.value for m in ReuseMode)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer numbers, got {text!r}") from None


def read_document(path: str) -> str:
    """Read a UTF-8 text document, with a clear error for missing or non-UTF-8 files.

    Args:
        path: the document's file (a symbolic link is followed).

    Returns:
        The document's text.

    Raises:
        InvalidRequestError: the path is a folder, missing, not a regular file, unreadable, over
            :data:`MAX_DOCUMENT_BYTES`, not UTF-8, or blank.
    """
    p = Path(path)
    if p.is_dir():
        raise InvalidRequestError(f"document {path}: is a directory (give a file; `kvblend ingest` takes folders)")
    if not p.is_file():
        raise InvalidRequestError(f"document {path}: no such file" if not p.exists() else
                                  f"document {path}: not a regular file")
    try:  # never more than a document can be: a prompt holds a few characters per token of the context
        data = safeio.read_regular(p, MAX_DOCUMENT_BYTES, follow_symlinks=True)
    except safeio.FileTooLargeError:
        raise InvalidRequestError(f"document {path}: over {MAX_DOCUMENT_BYTES >> 20} MiB: no model's context holds "
                                  "it (split it, or `kvblend ingest` it and ask with --index)") from None
    except OSError as e:
        raise InvalidRequestError(f"document {path}: cannot be read ({e})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequestError(f"document {path}: not UTF-8 text (byte {e.start})") from None
    if not text.strip():
        raise InvalidRequestError(f"document {path}: empty")
    return text


def add_store_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--store SPEC`` to a command that computes (or inspects) KV.

    Args:
        parser: the command's parser.
    """
    parser.add_argument(
        "--store", default=None, metavar="SPEC",
        help="memory | disk:PATH[?max_bytes=20G] | redis://HOST:PORT/DB[?prefix=P&ttl=S] | a comma chain "
             "(default: $KVBLEND_STORE or disk:$KVBLEND_HOME/store)",
    )


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """--model and --dtype.

    Args:
        p: the command's parser.
    """
    p.add_argument("--model", default=DEFAULT_MODEL, help="model name or checkpoint directory (default: %(default)s)")
    p.add_argument("--dtype", default=DEFAULT_DTYPE, choices=DTYPE_NAMES)


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """--model, --dtype, --kv-dtype, --store: shared by every command that computes.

    Args:
        p: the command's parser.
    """
    add_model_arguments(p)
    p.add_argument("--kv-dtype", default=None, choices=DTYPE_NAMES, help="dtype KV is stored at (default: --dtype)")
    p.add_argument("--gemm", default=DEFAULT_GEMM, choices=GEMM_CHOICES,
                   help="linear layers: oneDNN over packed weights (auto: a float32 engine on a CPU, or a "
                        "bfloat16 one on a CPU with native bf16) or "
                        "torch's F.linear; part of the KV's provenance (default: %(default)s)")
    add_store_argument(p)


def _margin(text: str) -> float | None:
    """--guard-margin: a number of nats, or ``off``."""
    if text.strip().lower() in ("off", "none"):
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of nats or 'off', got {text!r}") from None


def _factor(text: str) -> float | None:
    """--candidates: a factor >= 1, or ``off``."""
    if text.strip().lower() in ("off", "none"):
        return None
    try:
        f = float(text)
    except ValueError:
        f = float("nan")
    if not f >= 1:
        raise argparse.ArgumentTypeError(f"expected a factor >= 1 or 'off', got {text!r}")
    return f


def _temperature(text: str) -> float:
    """--reused-temperature: a number in :data:`~blend.defaults.REUSED_TEMPERATURE_RANGE`."""
    lo, hi = REUSED_TEMPERATURE_RANGE
    try:
        t = float(text)
    except ValueError:
        t = math.nan
    if not math.isfinite(t) or not lo <= t <= hi:
        raise argparse.ArgumentTypeError(f"expected a number in [{lo:g}, {hi:g}], got {text!r}")
    return t


def add_policy_arguments(p: argparse.ArgumentParser) -> None:
    """--reuse and the blend knobs.

    Args:
        p: the command's parser.
    """
    p.add_argument("--reuse", default=ReuseMode.EXACT.value, choices=REUSE_CHOICES,
                   help="exact prefix reuse (default), blended reuse (opt-in), or none")
    p.add_argument("--ratio", type=float, default=DEFAULT_RATIO,
                   help="blend: share of reused tokens recomputed (default: %(default)s)")
    p.add_argument("--selector", default=DEFAULT_SELECTOR, choices=SELECTOR_NAMES,
                   help="blend: which rows to recompute (default probe: the question's attention at depth x V deviation)")
    p.add_argument("--check-layers", type=_int_list, default=DEFAULT_CHECK_LAYERS, help="blend: e.g. 1 or 1,2")
    p.add_argument("--threshold", type=float, default=None,
                   help="blend: recompute rows whose relative deviation exceeds this (capped by --max-ratio)")
    p.add_argument("--budget", default=BudgetMode.FIXED.value, choices=[b.value for b in BudgetMode],
                   help="blend: fixed --ratio, or auto: per prompt, the fewest rows whose estimated left-over "
                        "error is under --auto-target, at most --max-ratio (the report gives the ratio chosen)")
    p.add_argument("--auto-target", type=float, default=DEFAULT_AUTO_TARGET, help="blend: the auto budget's target")
    p.add_argument("--max-ratio", type=float, default=DEFAULT_MAX_RATIO,
                   help="blend: cap of --threshold and --budget auto (default: %(default)s)")
    p.add_argument("--guard-margin", type=_margin, default=DEFAULT_GUARD_MARGIN,
                   help="blend: near-tie guard: when the blend's first-token top-2 gap is under this many nats, "
                        "blend the request again at --guard-ratio ('off': no guard; default: %(default)s)")
    p.add_argument("--guard-ratio", type=float, default=DEFAULT_GUARD_RATIO,
                   help="blend: the near-tie guard's ratio; 1.0, or one at or below the blend's own, runs the exact "
                        "path (default: %(default)s)")
    p.add_argument("--guard-mode", default=DEFAULT_GUARD_MODE, choices=GUARD_MODE_NAMES,
                   help="blend: how the guard's recompute at a ratio below 1 runs: 'restart' blends again from the "
                        "start; 'widen' goes on from the first pass's check layer, choosing among its candidates "
                        "(~10%% cheaper guarded prompts, one more flip on validation; default: %(default)s)")
    p.add_argument("--candidates", type=_factor, default=DEFAULT_CANDIDATES,
                   help="blend, probe selectors: run the probe first and compute the layers up to the check only "
                        "for this many times the budget of rows the question reads most ('off': every row; "
                        "default: %(default)s)")
    p.add_argument("--reused-temperature", type=_temperature, default=DEFAULT_REUSED_TEMPERATURE,
                   help="blend: attention temperature of the reused (not recomputed) document rows above the "
                        "first check layer: their attention logits are divided by it (1: off; default: %(default)s)")
    p.add_argument("--probe-precision", default=DEFAULT_PROBE_PRECISION, choices=PROBE_PRECISION_NAMES,
                   help="blend, probe selectors: dtype of the query probe's GEMMs (its numbers only rank rows): "
                        "compute, bf16, or auto (bf16 on a CPU with native bf16, else compute; default: %(default)s)")
    p.add_argument("--attention-precision", default=DEFAULT_ATTENTION_PRECISION, choices=RECOMPUTE_PRECISION_NAMES,
                   help="blend: dtype of the recomputed rows' attention above the last check layer: compute, "
                        "bf16 (~2.5x faster attention on CPUs with AMX; the answer's numbers move by bf16 "
                        "rounding), or auto (bf16 for a float32 engine on a CPU with native bf16, else compute; "
                        "default: %(default)s)")
    p.add_argument("--linear-precision", default=DEFAULT_LINEAR_PRECISION, choices=RECOMPUTE_PRECISION_NAMES,
                   help="blend: dtype of the recomputed rows' linear layers (QKV, output, MLP) above the last check "
                        "layer: compute, bf16 (on a bf16 copy of the weights: ~3x faster GEMMs with AMX; the "
                        "answer's numbers move by bf16 rounding), or auto (as for --attention-precision; default: "
                        "%(default)s)")
    p.add_argument("--min-prompt-tokens", type=int, default=DEFAULT_MIN_PROMPT_TOKENS,
                   help="blend: compute fully below this length")
    p.add_argument("--force-blend", action="store_true", help="blend even if the model's quality gate failed")
    p.add_argument("--semantic", action="store_true", help="blend: also reuse near-duplicate donor KV")
    p.add_argument("--take-exact", action="store_true",
                   help="blend: load the documents this order's exact path stored before as they are (the answer "
                        "then depends on what the store holds)")
    p.add_argument("--experimental-semantic", action="store_true",
                   help="enable the experimental semantic-reuse path in the engine")


# blend settings whose names the command line does not take as the policy's: --semantic is refused above with a
# message of its own, and --seed is the sampling seed (the policy's random-selector seed has no flag)
_NOT_POLICY_FLAGS = frozenset({"semantic", "seed"})


def policy_from_args(args: argparse.Namespace) -> ReusePolicy:
    """The request's :class:`ReusePolicy` from parsed arguments (missing blend knobs take their defaults).

    Args:
        args: parsed arguments (a command without :func:`add_policy_arguments`' flags gets exact reuse).

    Returns:
        The policy: ``none``, ``exact`` or a blend with every knob read from ``args``.

    Raises:
        InvalidPolicyError: ``--semantic`` outside a blend or without ``--experimental-semantic``, or a blend
            setting changed under another ``--reuse``; the policy's own checks raise theirs on a bad value.
    """
    mode = ReuseMode(getattr(args, "reuse", ReuseMode.EXACT.value))
    if mode is not ReuseMode.BLEND and getattr(args, "semantic", False):
        # semantic reuse is never dropped without a word (the server and ReusePolicy refuse it too);
        # --force-blend outside a blend forces nothing and is let through
        raise InvalidPolicyError(f"--semantic only applies with --reuse blend (got --reuse {mode.value})")
    if getattr(args, "semantic", False) and not getattr(args, "experimental_semantic", False):
        # refused before the model loads, in the command line's words (the engine's refusal names
        # EngineConfig's field, which the flag rewrite made "EngineConfig(--experimental-semantic=True)")
        raise InvalidPolicyError("semantic reuse is experimental: --semantic needs --experimental-semantic as well")
    if mode is not ReuseMode.BLEND:  # a blend setting under another mode is never dropped without a word either
        for name in BLEND_OPTIONS:  # the policy's own list (blend.policy_rules), as the server's intake uses
            if name not in _NOT_POLICY_FLAGS and hasattr(args, name) and setting_changed(name, getattr(args, name),
                                                                                       POLICY_DEFAULTS):
                raise InvalidPolicyError(f"--{name.replace('_', '-')} only applies with --reuse blend "
                                         f"(got --reuse {mode.value})")
    if mode is ReuseMode.NONE:
        return ReusePolicy.none()
    if mode is ReuseMode.EXACT:
        return ReusePolicy.exact()
    return ReusePolicy.blend(
        ratio=getattr(args, "ratio", DEFAULT_RATIO), selector=getattr(args, "selector", DEFAULT_SELECTOR),
        check_layers=getattr(args, "check_layers", DEFAULT_CHECK_LAYERS),
        threshold=getattr(args, "threshold", None), max_ratio=getattr(args, "max_ratio", DEFAULT_MAX_RATIO),
        min_prompt_tokens=getattr(args, "min_prompt_tokens", DEFAULT_MIN_PROMPT_TOKENS),
        force=getattr(args, "force_blend", False), semantic=getattr(args, "semantic", False),
        budget=BudgetMode(getattr(args, "budget", BudgetMode.FIXED.value)),
        auto_target=getattr(args, "auto_target", DEFAULT_AUTO_TARGET),
        guard_margin=getattr(args, "guard_margin", DEFAULT_GUARD_MARGIN),
        guard_ratio=getattr(args, "guard_ratio", DEFAULT_GUARD_RATIO),
        guard_mode=GuardMode(getattr(args, "guard_mode", DEFAULT_GUARD_MODE)),
        candidates=getattr(args, "candidates", DEFAULT_CANDIDATES),
        reused_temperature=getattr(args, "reused_temperature", DEFAULT_REUSED_TEMPERATURE),
        probe_precision=ProbePrecision(getattr(args, "probe_precision", DEFAULT_PROBE_PRECISION)),
        take_exact=getattr(args, "take_exact", False),
        attention_precision=RecomputePrecision(getattr(args, "attention_precision", DEFAULT_ATTENTION_PRECISION)),
        linear_precision=RecomputePrecision(getattr(args, "linear_precision", DEFAULT_LINEAR_PRECISION)),
    )


def load_engine(model: str = DEFAULT_MODEL, dtype: str = DEFAULT_DTYPE, store: Any = None, **config) -> "Engine":
    """Load an engine with a store given as a ``--store`` spec string, a store object or None.

    Args:
        model: model name or path.
        dtype: compute dtype.
        store: spec string (``memory``, ``disk:PATH``, ...), a store, or None (the default spec).
        **config: other :class:`~blend.engine_setup.EngineConfig` fields.

    Returns:
        The engine.
    """
    from blend.engine import Engine  # loaded on use: parsers stay light (no cycle: the engine never imports this)
    from blend.store.spec import open_store

    if store is None or isinstance(store, str):
        store = open_store(store)
    return Engine.load(model, dtype=dtype, store=store, **config)


def engine_from_args(args: argparse.Namespace) -> "Engine":
    """Load the engine a command's arguments describe.

    Args:
        args: parsed arguments (``--model``, ``--dtype``, ``--kv-dtype``, ``--gemm``, ``--store``,
            ``--experimental-semantic``; an absent one takes its default).

    Returns:
        The engine (see :func:`load_engine`).
    """
    return load_engine(getattr(args, "model", DEFAULT_MODEL), getattr(args, "dtype", DEFAULT_DTYPE),
                       getattr(args, "store", None), kv_dtype=getattr(args, "kv_dtype", None),
                       gemm=getattr(args, "gemm", DEFAULT_GEMM),
                       experimental_semantic=getattr(args, "experimental_semantic", False))
