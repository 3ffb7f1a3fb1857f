"""The serving benchmarks' workload over the demo corpus (blend/data/demo)."""

from __future__ import annotations

import json
from pathlib import Path

DEMO = Path(__file__).resolve().parents[1] / "blend" / "data" / "demo"


def demo_requests() -> list[tuple[str, list[str]]]:
    """(question, documents) pairs over the demo corpus; document order rotates."""
    names = sorted(p.name for p in DEMO.iterdir() if p.suffix in (".txt", ".md"))
    text = {n: (DEMO / n).read_text(encoding="utf-8") for n in names}
    qs = json.loads((DEMO / "questions.json").read_text(encoding="utf-8"))["questions"]
    out = []
    for j in range(len(qs) * 3):
        q = qs[j % len(qs)]
        others = [n for n in names if n != q["source"]]
        picked = [q["source"], others[j % len(others)], others[(j + 3) % len(others)]]
        k = j // len(qs)
        out.append((q["question"], [text[n] for n in picked[k:] + picked[:k]]))
    return out
