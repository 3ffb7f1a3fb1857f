"""Per-method aggregation of per-item rows (means, TTFT percentiles, bootstrap CIs)."""

from __future__ import annotations

from typing import Any, Sequence

import math

import numpy as np

from blend.evals import metrics as M
from blend.evals.methods import Method
from blend.evals.rows import ItemRow

# Quality fields averaged over items (mean of per-item values).
MEAN_FIELDS = ("f1", "em", "rouge_l", "contains", "agreement", "kl", "top1", "tf_agreement", "tf_kl", "recomputed_frac",
               "computed_frac")


def aggregate_method(
    name: str, rows: Sequence[ItemRow], method: Method | None, n_boot: int, seed: int
) -> dict[str, Any]:
    """Aggregate one method over items.

    Args:
        name: method name (key of ``row.methods``).
        rows: per-item rows (those with ``methods[name]`` count).
        method: the parsed method (its spec is recorded), or None.
        n_boot: bootstrap resamples.
        seed: bootstrap seed.

    Returns:
        The ``methods.<name>`` object of results.json (see :mod:`blend.evals.report`).
    """
    per = [r.methods[name] for r in rows if name in r.methods]
    out: dict[str, Any] = {f: M.mean([getattr(p, f) for p in per]) for f in MEAN_FIELDS}
    ttft = [p.ttft_s for p in per]
    ratios = [p.ttft_ratio for p in per]
    f1 = [p.f1 for p in per]
    kl = [p.kl for p in per]
    # a KL that was inf or NaN is null in the rows (JSON): dropping it would make the method look better,
    # so then the KL summary is null (shown as such) and the count of such items says why
    nonfinite = sum(1 for p in per if p.kl is None or not math.isfinite(p.kl))
    out.update(
        # the tail of KL to full prefill: errors are heavy-tailed, so the mean alone hides the worst prompts
        kl_median=M.median(kl),
        kl_p90=M.percentile(kl, 90.0),
        kl_max=max(M.finite(kl)) if M.finite(kl) else None,
        kl_ci=_ci(kl, np.mean, n_boot, seed),
        kl_median_ci=_ci(kl, np.median, n_boot, seed),
        top1_ci=_ci([p.top1 for p in per], np.mean, n_boot, seed),
        tf_agreement_ci=_ci([p.tf_agreement for p in per], np.mean, n_boot, seed),
    )
    out.update(
        ttft_median_s=M.median(ttft),
        ttft_p90_s=M.percentile(ttft, 90.0),
        ttft_ratio=M.median(ratios),
        ttft_ratio_mean=M.mean(ratios),
        f1_ci=_ci(f1, np.mean, n_boot, seed),
        ttft_ratio_ci=_ci(ratios, np.median, n_boot, seed),
        recomputed_tokens=M.mean([p.recomputed_tokens for p in per]),
        prompt_tokens=M.mean([p.prompt_tokens for p in per]),
        n=len(per),
        threads=sorted({p.threads for p in per if p.threads is not None}),
        spec=method.to_dict() if method is not None else None,
        kl_nonfinite=nonfinite,
    )
    if nonfinite:
        for f in ("kl", "kl_median", "kl_p90", "kl_max", "kl_ci", "kl_median_ci"):
            out[f] = None
    # the teacher-forced KL likewise: a mean over the finite items only would flatter the method
    tf_nonfinite = sum(1 for p in per if p.tf_kl is None or not math.isfinite(p.tf_kl))
    if tf_nonfinite:
        out["tf_kl"] = None
    out["tf_kl_nonfinite"] = tf_nonfinite
    return out


def _ci(values: Sequence[float | None], stat: Any, n_boot: int, seed: int) -> list[float] | None:
    ci = M.bootstrap_ci(values, stat=stat, n=n_boot, seed=seed)
    return list(ci) if ci is not None else None


def aggregate(
    rows: Sequence[ItemRow], methods: Sequence[Method], n_boot: int = 1000, seed: int = 0
) -> dict[str, dict[str, Any]]:
    """Aggregate every method, in method order.

    Args:
        rows: per-item rows.
        methods: parsed methods (``full`` first).
        n_boot: bootstrap resamples.
        seed: bootstrap seed.

    Returns:
        ``{name: aggregate}``.
    """
    return {m.name: aggregate_method(m.name, rows, m, n_boot, seed) for m in methods}
