"""The answer survival of a `kvblend eval` run beside a bf16 full prefill's (the floor of a numeric perturbation).

    .venv/bin/python docs/results/issue14/answer_survival/summarize.py RUN_DIR FLOOR.jsonl OUT_DIR

Writes OUT_DIR/summary.md (shares by answer length, first-token top-1 and KL, teacher-forced agreement and KL)
and OUT_DIR/answer_survival.png (a curve per method and the bf16 floor's, dashed).
"""

from __future__ import annotations

import json
import statistics
import sys
from types import SimpleNamespace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from blend.evals import answer_survival as S  # noqa: E402
from blend.evals.rows import ItemRow  # noqa: E402

run, floor_path, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
out.mkdir(parents=True, exist_ok=True)
rows = [ItemRow.from_json(json.loads(x)) for x in (run / "rows.jsonl").read_text().splitlines() if x.strip()]
floor = [json.loads(x) for x in floor_path.read_text().splitlines() if x.strip()]
# the floor as rows of the shape answer_survival reads (index; per method answer_tokens, same_tokens)
floor_rows = [SimpleNamespace(index=f["index"], methods={
    "full": SimpleNamespace(answer_tokens=len(f["full_tokens"]), same_tokens=None),
    "bf16 full prefill": SimpleNamespace(answer_tokens=len(f["bf16_tokens"]), same_tokens=f["same_tokens"])})
    for f in floor]
shared = sorted({r.index for r in rows} & {f["index"] for f in floor})
rows = [r for r in rows if r.index in shared]
floor_rows = [r for r in floor_rows if r.index in shared]
floor_by = {f["index"]: f for f in floor}
methods = [m for m in rows[0].methods if m != "full"]
survivals = [S.survival(rows, m) for m in methods] + [S.survival(floor_rows, "bf16 full prefill")]


def mean(xs):
    return statistics.fmean(xs)


lines = [f"# How long the answer stays full prefill's ({len(shared)} items, {shared[0]}-{shared[-1]})", "",
         f"Run `{run}`; floor `{floor_path.name}` (the bf16 engine's full prefill against the fp32 one).", "",
         *S.table_lines(survivals), "",
         "| method | first-token KL mean | top-1 | TF agreement | TF KL mean | normalised answer agreement |",
         "|---|---|---|---|---|---|"]
for m in methods:
    r = [x.methods[m] for x in rows]
    lines.append(f"| `{m}` | {mean([x.kl for x in r]):.4f} | {mean([x.top1 for x in r]):.3f} | "
                 f"{mean([x.tf_agreement for x in r]):.3f} | {mean([x.tf_kl for x in r]):.4f} | "
                 f"{mean([x.agreement for x in r]):.3f} |")
lines.append(f"| bf16 full prefill | {mean([floor_by[i]['kl'] for i in shared]):.4f} | "
             f"{mean([floor_by[i]['top1'] for i in shared]):.3f} | | | |")
(out / "summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))

longest = max(int(m.answer_tokens) for r in rows for m in r.methods.values())
fig, ax = plt.subplots(figsize=(7.5, 4.2))
for m in methods:
    c = S.curve_points(rows, m, longest)
    ax.step(range(1, len(c) + 1), c, where="post", label=m)
c = S.curve_points(floor_rows, "bf16 full prefill", longest)
ax.step(range(1, len(c) + 1), c, where="post", color="black", linestyle="--", label="bf16 full prefill (floor)")
ax.set_xlabel("answer tokens k")
ax.set_ylabel("share of answers whose first k tokens are full's")
ax.set_ylim(0, 1.02)
ax.grid(alpha=0.3)
ax.legend(fontsize=7)
ax.set_title(f"musique {shared[0]}-{shared[-1]}, SmolLM2 fp32, 5 passages: answers against full prefill's")
fig.tight_layout()
fig.savefig(out / "answer_survival.png", dpi=120)
