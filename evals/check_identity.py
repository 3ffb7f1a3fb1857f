"""Behaviour-unchanged check for refactors: first-token logits of full / reuse / blend, hashed.

    python -m blend.evals.check_identity --out before.json        # in the old tree's environment
    python -m blend.evals.check_identity --out after.json         # in the new tree's
    python -m blend.evals.check_identity --compare before.json after.json

Per item it records each method's KL(full || method) and the sha256 of the
fp32 logits; ``--compare`` reports the largest KL difference and whether every
hash matches (bit-identical logits imply identical KL figures). Uses only the
public API both sides of a refactor share (``Engine.load``, ``build_prompt``,
``generate``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import torch

from blend.defaults import DEFAULT_EVAL_DATA, DEFAULT_MODEL, DEFAULT_RATIO
from blend.engine import Engine
from blend.evals.data import load_items
from blend.evals.metrics import kl_divergence
from blend.policy import ReusePolicy
from blend import safeio

METHODS = {
    "full": ReusePolicy.none(),
    "reuse": ReusePolicy.blend(ratio=0.0),
    f"blend@{DEFAULT_RATIO}:combo": ReusePolicy.blend(ratio=DEFAULT_RATIO, selector="combo"),
}


def dump(data: str, limit: int, passages: int, model: str) -> list[dict]:
    """Rows of {item, method: {kl, sha}} for the first ``limit`` items."""
    torch.set_num_threads(1)
    engine = Engine.load(model, quality_gate=False)
    rows = []
    for i, item in enumerate(load_items(data, limit, passages)):
        prompt = engine.build_prompt(item.question, item.document_texts())
        logits = {name: engine.generate(prompt, pol, max_new_tokens=1).first_logits for name, pol in METHODS.items()}
        row: dict = {"item": i}
        for name, lg in logits.items():
            row[name] = {"kl": kl_divergence(logits["full"], lg),
                         "sha": hashlib.sha256(lg.float().contiguous().numpy().tobytes()).hexdigest()}
        rows.append(row)
        print(i, {k: round(v["kl"], 6) for k, v in row.items() if k != "item"}, file=sys.stderr, flush=True)
    return rows


def compare(a: list[dict], b: list[dict]) -> tuple[float, int, int]:
    """(largest |KL difference|, hashes equal, hashes compared) over the items both dumps hold."""
    worst, same, n = 0.0, 0, 0
    for ra, rb in zip(a, b):
        for name in ra:
            if name == "item":
                continue
            worst = max(worst, abs(ra[name]["kl"] - rb[name]["kl"]))
            same += ra[name]["sha"] == rb[name]["sha"]
            n += 1
    return worst, same, n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=DEFAULT_EVAL_DATA)
    ap.add_argument("--limit", type=int, default=30)
    ap.add_argument("--passages", type=int, default=5)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"))
    args = ap.parse_args(argv)
    if args.compare:
        worst, same, n = compare(*(json.loads(p.read_text()) for p in args.compare))
        print(f"max |KL difference| {worst:.3g}; bit-identical logits {same}/{n}")
        return 0 if same == n else 1
    if args.out is None:
        ap.error("give --out FILE or --compare A B")
    safeio.atomic_write_text(args.out, json.dumps(dump(args.data, args.limit, args.passages, args.model), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
