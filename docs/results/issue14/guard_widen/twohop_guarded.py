"""Two-hop sweeps in this folder: the requests whose guard fired, restart against widen (time and quality).

    .venv/bin/python docs/results/issue14/guard_widen/twohop_guarded.py
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

HERE = Path(__file__).parent
RESTART, WIDEN = "blend@0.15:probe:gmode=restart", "blend@0.15:probe:gmode=widen"
OFF, V = "blend@0.15:probe:guard=off", "blend@0.15:v:guard=off"

for folder in sorted(p for p in HERE.glob("twohop_*") if p.is_dir()):
    rows = [json.loads(x) for x in (folder / "rows.jsonl").read_text().splitlines() if x.strip()]
    by = {(r["item"], r["method"]): r for r in rows}
    # complete items only (a run stopped early leaves its last item part-done)
    items = sorted(i for i in {r["item"] for r in rows} if all((i, m) in by for m in (RESTART, WIDEN, OFF)))
    fired = [i for i in items if by[(i, RESTART)]["guarded"]]
    print(f"{folder.name}: {len(items)} items, the guard fired on {len(fired)} (restart) / "
          f"{sum(by[(i, WIDEN)]['guarded'] for i in items)} (widen)")
    for m in (RESTART, WIDEN, OFF, V):
        if not all((i, m) in by for i in items):
            continue
        every = [by[(i, m)]["kl"] for i in items]
        print(f"  {m}, every item: mean KL {statistics.mean(every):.4f}, max {max(every):.4f}, "
              f"top-1 {statistics.mean(by[(i, m)]['top1'] for i in items):.3f}")
    for m in (RESTART, WIDEN):
        ms = [by[(i, m)]["ms"] for i in fired]
        kl = [by[(i, m)]["kl"] for i in fired]
        print(f"  {m}: guarded median {statistics.median(ms):.0f} ms, mean {statistics.mean(ms):.0f} ms; "
              f"mean KL {statistics.mean(kl):.4f}, top-1 {statistics.mean(by[(i, m)]['top1'] for i in fired):.3f}; "
              f"every item median {statistics.median(by[(i, m)]['ms'] for i in items):.0f} ms")
