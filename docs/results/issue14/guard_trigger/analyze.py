import json, sys

from blend.evals.metrics import percentile  # linear, as every p90 of the project (until 2026-12-08: floor index)

def spearmanr(a, b):
    import torch
    ra = torch.tensor(a).argsort().argsort().double(); rb = torch.tensor(b).argsort().argsort().double()
    ra -= ra.mean(); rb -= rb.mean()
    return float((ra*rb).sum() / (ra.norm()*rb.norm()))
rows = [json.loads(l) for l in open(sys.argv[1])]
B = "blend@0.15:guard=off"
xs, ys = [], []
for r in rows:
    b = r[B]["d15"]; f = r["full"]["d15"]; p = r["probe"]["d15"]
    err = abs(b - f); delta = abs(b - p)
    xs.append(delta); ys.append(err)
    flip = r[B]["top"][0] != r["full"]["top"][0]
    print(r["item"], "gap", round(r[B]["gap"], 3), "err", round(err, 3), "delta", round(delta, 3), "ratio", round(err / max(delta, 1e-9), 3), "FLIP" if flip else "")
print("spearman err~delta", spearmanr(xs, ys))
rat = [y / max(x, 1e-9) for x, y in zip(xs, ys)]
print("err/delta quantiles", [round(percentile(rat, 100 * q), 3) for q in (0.5, 0.75, 0.9, 1.0)])
print("err quantiles", [round(percentile(ys, 100 * q), 3) for q in (0.5, 0.75, 0.9, 1.0)])
