"""Plot ``bench_serve`` runs side by side: output tokens/s (as a multiple of one client) and TTFT p50
against the number of clients, one line per run and mode.

    python -m blend.evals.serve_plot --run "shares on=DIR_A" --run "shares off=DIR_B" --out serve.png

Each DIR holds a ``bench_serve.json`` (``python -m blend.evals.bench_serve --out DIR``).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from blend import safeio

TARGET_SPEEDUP = 4.0  # issue 16: output tok/s at 16 clients >= 4x one client


@dataclass(frozen=True)
class Series:
    """One run's rows of one mode, by client count."""

    label: str
    mode: str
    clients: list[int]
    tok_per_s: list[float]
    ttft_p50_ms: list[float]

    @property
    def speedup(self) -> list[float]:
        """Output tok/s over the run's own single-client figure (empty without a 1-client row)."""
        if 1 not in self.clients:
            return []
        base = self.tok_per_s[self.clients.index(1)]
        return [t / base for t in self.tok_per_s]


def load_series(label: str, run_dir: Path) -> list[Series]:
    """Every mode of one bench_serve run.

    Args:
        label: the run's name in the legend.
        run_dir: the run's ``--out`` folder.

    Returns:
        one :class:`Series` per mode, clients ascending.
    """
    rows = json.loads((run_dir / "bench_serve.json").read_text())["rows"]
    out = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["clients"])
        out.append(Series(label, mode, [r["clients"] for r in mine], [r["out_tok_per_s"] for r in mine],
                          [r["ttft_p50_ms"] for r in mine]))
    return out


def plot(series: list[Series], out: Path) -> Path:
    """Two panels (tok/s speed-up, TTFT p50) against clients; returns the PNG's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6))
    for s in series:
        style = "-" if s.mode == "exact" else "--"
        name = f"{s.label}, {s.mode}"
        if s.speedup:
            a.plot(s.clients, s.speedup, style, marker="o", label=name)
        b.plot(s.clients, s.ttft_p50_ms, style, marker="o", label=name)
    a.axhline(TARGET_SPEEDUP, color="red", lw=0.8, ls=":", label=f"target {TARGET_SPEEDUP:g}x at 16")
    a.set_xlabel("concurrent clients")
    a.set_ylabel("output tok/s / one client's")
    b.set_xlabel("concurrent clients")
    b.set_ylabel("TTFT p50 (ms)")
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({c for s in series for c in s.clients}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    a.legend(fontsize=7)
    fig.suptitle("kvblend serve, demo corpus", fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    safeio.save_figure(fig, out, dpi=120)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m blend.evals.serve_plot", description=__doc__.splitlines()[0])
    ap.add_argument("--run", action="append", required=True, help="LABEL=DIR of a bench_serve run (repeatable)")
    ap.add_argument("--out", required=True, help="the PNG to write")
    args = ap.parse_args(argv)
    series = []
    for spec in args.run:
        label, sep, path = spec.partition("=")
        if not sep:
            ap.error(f"--run wants LABEL=DIR, got {spec!r}")
        series += load_series(label, Path(path))
    print(plot(series, Path(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
