"""The near-tie guard's margin, what it buys and what it costs, from one ``kvblend eval`` run.

A guarded blend (``guard=M@G``) fires where its first pass's first-token top-2 gap is under M nats; its
first pass is the unguarded blend's whole computation. So a run holding both, item by item, gives every
smaller margin m <= M exactly: an item is the guarded method's row where its gap is under m, else the
unguarded method's row (time included). One run, every margin: no re-running per setting::

    kvblend eval ... --methods full,blend@0.15:probe:guard=2@0.3,blend@0.15:probe:guard=off --out RUN
    python -m blend.evals.guard_curve --run RUN --guarded blend@0.15:probe:guard=2@0.3 \\
        --off blend@0.15:probe:guard=off [--margins 0,0.1,...] [--out RUN/guard_curve]

Writes ``guard_curve.md`` (a row per margin: the share of items guarded, mean / p90 / max first-token KL,
top-1 agreement, TTFT ratio median / mean / p90) and ``guard_curve.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

from blend import safeio
from blend.defaults import DEFAULT_GUARD_MARGIN
from blend.evals import metrics as M
from blend.evals.harness import MAX_RUN_FILE_BYTES, RUN_FILE
from blend.evals.methods import Method, MethodError, MethodKind, parse_method
from blend.evals.rows import MAX_ROWS_BYTES, ItemRow, MethodRow, RowError, read_jsonl
from blend.evals.splits import items_caption

# what two rows of one item may differ by in their first pass's gap and still be the same first pass
# (the eval's JSON keeps floats exactly; a run resumed on another host could round differently)
MARGIN_TOLERANCE = 1e-4
# the margins a results.md shows (those up to the guarded method's own, and that one)
MARGIN_STEPS = (0.0, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0, 1.5, 2.0, 3.0, 5.0)
# the plot's x: the mean over items of each item's TTFT ratio (CurvePoint.ttft_mean), not mean TTFT over mean full
PLOT_X_LABEL = "TTFT / full prefill (same item), mean over items"


class CurveError(ValueError):
    """A run that cannot give the curve (a method missing, rows without margins, first passes that differ)."""


@dataclass(frozen=True)
class CurvePoint:
    """The outcome over a run's items of a guard at one margin."""

    margin: float
    guarded: float  # share of items the guard re-ran at this margin: gap under it, and the guard fired (it
    # does not where the blend kept no re-positioned row: one passage, every document exact)
    kl_mean: float
    kl_p90: float
    kl_max: float
    top1: float
    ttft_median: float | None
    ttft_mean: float | None
    ttft_p90: float | None



def guard_margin_of(name: str) -> float:
    """The guard margin of a blend method spec: M of ``guard=M@G``, the engine's default where the spec
    names no guard.

    Raises:
        CurveError: the spec is not a blend, or its guard is off.
    """
    try:
        method = parse_method(name)
    except MethodError as e:
        raise CurveError(str(e)) from e
    margin = _margin(method)
    if method.kind is not MethodKind.BLEND or margin is None:
        raise CurveError(f"{name!r} names no guard margin (a blend with guard=M@G, or the default guard)")
    return float(margin)


def _margin(method: Method) -> float | None:
    """The guard margin a parsed method runs with: its ``guard=`` margin, else the engine's default (None: off)."""
    return DEFAULT_GUARD_MARGIN if method.guard is None else method.guard[0]


def default_margins(top: float) -> list[float]:
    """:data:`MARGIN_STEPS` up to ``top``, and ``top`` itself."""
    return sorted({m for m in MARGIN_STEPS if m <= top} | {top})


def guard_pairs(names: Sequence[str]) -> list[tuple[str, str]]:
    """The (guarded, unguarded) pairs among a run's method names: a guarded blend (its own margin or the
    default guard) and the same blend with ``guard=off``, whatever the guard's ratio and mode.

    Args:
        names: method specs as a run keys them.

    Returns:
        Pairs in the order the guarded methods come.
    """
    blends: dict[str, Method] = {}
    for n in names:
        try:
            m = parse_method(n)
        except MethodError:
            continue
        if m.kind is MethodKind.BLEND:
            blends[n] = m

    def base(m: Method) -> Method:
        return replace(m, name="", canonical="", guard=None, guard_mode=None)

    offs = [n for n, m in blends.items() if m.guard == (None, None)]
    pairs = []
    for n, m in blends.items():
        if _margin(m) is None:  # unguarded itself
            continue
        off = next((o for o in offs if base(blends[o]) == base(m)), None)
        if off is not None:
            pairs.append((n, off))
    return pairs


def run_caption(run: Path, rows: Sequence[ItemRow]) -> str:
    """The run's items and their split as results.md names them (``items 30-99 (70 items), validation split``),
    the data read from the run's ``run.json``; without a readable one, the item count alone.

    Args:
        run: a ``kvblend eval`` output folder.
        rows: its item rows.

    Returns:
        The caption.
    """
    try:
        data = json.loads(safeio.read_regular(run / RUN_FILE, MAX_RUN_FILE_BYTES).decode("utf-8"))["identity"]["data"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError):  # no run.json, or not a run's settings
        data = None
    if not isinstance(data, str):
        return f"{len(rows)} items"
    return items_caption(data, [r.index for r in rows])


def read_rows(run: Path) -> list[ItemRow]:
    """The items of a ``kvblend eval`` output folder (``rows.jsonl``), one row per item, in item order.

    A ``--resume`` that adds methods appends a merged row for each item it extends, so an item can have
    several lines: the last one holds every method (what the run's ``results.json`` keeps).

    Raises:
        CurveError: no rows file, or a line that is not an item row (:meth:`ItemRow.from_json`).
    """
    path = run / "rows.jsonl"
    if not path.is_file():
        raise CurveError(f"{path} not found (a kvblend eval --out folder holds it)")
    rows: dict[int, ItemRow] = {}
    try:  # bounded, as the harness reads it back; lines split at "\n" only (not at a U+2028 in a string)
        for where, value in read_jsonl(path, MAX_ROWS_BYTES):
            try:
                row = ItemRow.from_json(value)
            except RowError as e:
                raise CurveError(f"{where}: not an item row ({str(e)[:200]})") from e
            rows[row.index] = row  # a later line of the same item supersedes an earlier one
    except RowError as e:  # the file (absent meanwhile, not regular, over the cap, not UTF-8) or a line not JSON
        raise CurveError(str(e)) from None
    return [rows[i] for i in sorted(rows)]


def _pair(row: ItemRow, guarded: str, off: str, top: float) -> tuple[MethodRow, MethodRow, float]:
    """One item's guarded and unguarded rows and its first pass's gap (checked to be the same pass)."""
    ms = row.methods
    where = f"item {row.index}"
    if guarded not in ms or off not in ms:
        raise CurveError(f"{where}: the run lacks {guarded!r} or {off!r}")
    g, o = ms[guarded], ms[off]
    gap_g, gap_o = g.first_token_margin, o.first_token_margin
    if gap_g is None or gap_o is None:
        raise CurveError(f"{where}: no first_token_margin (a run from before kvblend eval recorded it)")
    if abs(gap_g - gap_o) > MARGIN_TOLERANCE:
        raise CurveError(f"{where}: the two methods' first passes differ (gaps {gap_g:.6g} and {gap_o:.6g}): "
                         "--off must be --guarded with the guard off")
    # under M the guard may still not fire (a blend that recomputed every row has nothing to guard, and its
    # guarded row is then the unguarded computation); at or over M it never does
    if g.guarded and gap_g >= top:
        raise CurveError(f"{where}: {guarded!r} fired at gap {gap_g:.6g}, over its margin: not that method")
    return g, o, float(gap_o)


def curve(rows: Sequence[ItemRow], guarded: str, off: str, margins: Sequence[float]) -> list[CurvePoint]:
    """The guard's outcome at each margin, from each item's guarded and unguarded rows.

    Args:
        rows: item rows of one ``kvblend eval`` run (:func:`read_rows`).
        guarded: a method with the guard at margin M (``guard=M@G``).
        off: the same blend with the guard off.
        margins: margins to report, each in [0, M].

    Returns:
        One point per margin, in the given order.

    Raises:
        CurveError: no items, a margin outside [0, M], an item lacking a method or its gap, first
            passes that differ, or a KL that is not finite.
    """
    top = guard_margin_of(guarded)
    if not rows:
        raise CurveError("the run has no items")
    if any(not 0.0 <= m <= top for m in margins):
        raise CurveError(f"margins must lie in [0, {top:g}] (the guarded method's own margin)")
    pairs = [_pair(r, guarded, off, top) for r in rows]
    points = []
    for m in margins:
        chosen = [g if gap < m else o for g, o, gap in pairs]
        kl = [c.kl for c in chosen]
        if any(v is None for v in kl):  # inf or NaN in the run (null in its rows): no mean or max to draw
            raise CurveError(f"a KL at margin {m:g} is not finite (null in the rows): the curve cannot be drawn")
        ttft = [c.ttft_ratio for c in chosen]
        points.append(CurvePoint(
            margin=float(m), guarded=sum(gap < m and bool(g.guarded) for g, _, gap in pairs) / len(pairs),
            kl_mean=M.mean(kl), kl_p90=M.percentile(kl, 90), kl_max=max(kl),
            top1=M.mean([c.top1 for c in chosen]),
            ttft_median=M.median(ttft), ttft_mean=M.mean(ttft), ttft_p90=M.percentile(ttft, 90)))
    return points


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table_lines(points: Sequence[CurvePoint]) -> list[str]:
    """The curve as a markdown table, a row per margin."""
    lines = ["| margin (nats) | guarded | mean KL | p90 | max | top-1 | TTFT / full prefill: median / mean / p90 |",
             "|---|---|---|---|---|---|---|"]
    for p in points:
        lines.append(f"| {p.margin:g} | {p.guarded:.3f} | {p.kl_mean:.4f} | {p.kl_p90:.4f} | {p.kl_max:.4f} | "
                     f"{p.top1:.3f} | {_fmt(p.ttft_median, '.3f')} / {_fmt(p.ttft_mean, '.3f')} / "
                     f"{_fmt(p.ttft_p90, '.3f')} |")
    return lines


def write_markdown(points: Sequence[CurvePoint], items: str, guarded: str, off: str, path: Path) -> None:
    """``guard_curve.md``: a row per margin, under a title naming ``items`` (:func:`run_caption`)."""
    lines = [f"# The near-tie guard by margin ({items})", "",
             f"Guarded `{guarded}`, unguarded `{off}`: at margin m an item is the guarded row where its first",
             "pass's top-2 gap is under m, else the unguarded row.", "", *table_lines(points)]
    safeio.atomic_write_text(path, "\n".join(lines) + "\n")


def write_plot(points: Sequence[CurvePoint], path: Path, items: str = "") -> None:
    """``guard_curve.png``: top-1 and mean KL against the mean over items of the TTFT ratio, each point labelled
    by its margin, under a title naming ``items`` (:func:`run_caption`) where given."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [p for p in points if p.ttft_mean is not None]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, field, label in ((axes[0], "top1", "top-1 agreement with full prefill"),
                             (axes[1], "kl_mean", "mean first-token KL (nats)")):
        xs, ys = [p.ttft_mean for p in pts], [getattr(p, field) for p in pts]
        ax.plot(xs, ys, "o-")
        labels: dict[tuple[float, float], list[str]] = {}  # margins that guard the same items share a point
        for p, x, y in zip(pts, xs, ys):
            labels.setdefault((x, y), []).append(f"{p.margin:g}")
        for (x, y), names in labels.items():
            ax.annotate(",".join(names), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xlabel(PLOT_X_LABEL)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    fig.suptitle("near-tie guard: points labelled by margin (nats)" + (f"\n{items}" if items else ""), fontsize=10)
    fig.tight_layout()
    safeio.save_figure(fig, path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m blend.evals.guard_curve", description=__doc__.split("\n")[0])
    ap.add_argument("--run", required=True, help="a kvblend eval --out folder")
    ap.add_argument("--guarded", required=True, help="its guarded method (guard=M@G)")
    ap.add_argument("--off", required=True, help="the same blend with guard=off")
    ap.add_argument("--margins", default=None, help="comma list (default: 0, 0.1, 0.2, 0.3, 0.5, 0.7, 1, ... up to M)")
    ap.add_argument("--out", default=None, help="folder for guard_curve.md and .png (default: --run)")
    args = ap.parse_args(argv)
    try:
        top = guard_margin_of(args.guarded)
        margins = [float(x) for x in args.margins.split(",")] if args.margins else default_margins(top)
        rows = read_rows(Path(args.run))
        points = curve(rows, args.guarded, args.off, margins)
    except (CurveError, ValueError) as e:
        print(f"guard_curve: {e}", file=sys.stderr)
        return 2
    out = Path(args.out or args.run)
    out.mkdir(parents=True, exist_ok=True)
    items = run_caption(Path(args.run), rows)
    write_markdown(points, items, args.guarded, args.off, out / "guard_curve.md")
    write_plot(points, out / "guard_curve.png", items)
    print((out / "guard_curve.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
