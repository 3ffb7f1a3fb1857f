"""One predicate decides whether a timed or tabulated request ran its method's own path
(``blend.evals.paths.ran_own_path``). Four places decided it before and disagreed on a blend its near-tie guard
recomputed on the exact path: ``check_blended`` accepted it; ``bench_serve``'s "other path" column,
``bench_burst``'s warning and results.md's warning counted it as another path's."""

from __future__ import annotations

import pytest

from blend.evals.bench_serve import Sample, ran_own
from blend.evals.paths import check_blended, ran_own_path
from blend.evals.report import markdown
from blend.policy import ReuseMode
from blend.report import ReuseReport

from test_evals_report import make_results

N, E, B = ReuseMode.NONE, ReuseMode.EXACT, ReuseMode.BLEND


@pytest.mark.parametrize("asked, applied, guarded, own", [
    (B, B, False, True), (B, B, True, True),
    (B, E, True, True),  # the guard recomputed it on the exact path: the blend policy's own cost
    (B, E, False, False),  # nothing to re-position: the exact path's TTFT
    (B, E, None, False),  # a row from before the field
    (B, N, False, False), (B, N, True, False),  # refused: a full prefill
    (E, E, False, True), (E, B, False, False), (E, N, False, False),
    (N, N, False, True), (N, E, False, True),  # a full prefill runs the exact schedule in one pass
    (N, B, False, False),
])
def test_ran_own_path(asked, applied, guarded, own):
    assert ran_own_path(asked, applied, guarded) is own


def test_every_consumer_agrees_on_a_guarded_blend_that_ran_exact():
    check_blended("blend", ReuseReport(policy="blend", applied=E, asked=B, guard="gap 0.1 < 0.7"))
    with pytest.raises(RuntimeError, match="ran exact, not a blend"):
        check_blended("blend", ReuseReport(policy="blend", applied=E, asked=B))

    def sample(applied: str, guarded: bool) -> Sample:
        return Sample(0.1, 0.2, 3, 0.1, guarded, (), False, applied)

    assert ran_own("blend@0.15", sample("exact", True)) and not ran_own("blend@0.15", sample("exact", False))
    assert ran_own("exact", sample("exact", False)) and not ran_own("blend@0.15", sample("", False))

    res = make_results()
    for it in res["items"]:
        for name, r in it["methods"].items():
            r["applied"] = "exact" if name == "full" else "blend"
    res["items"][0]["methods"]["blend@0.3:v"].update(applied="exact", guarded=True)
    assert "same path" not in markdown(res)  # a guarded exact row is the blend's own
    res["items"][1]["methods"]["blend@0.3:v"].update(applied="exact", guarded=False)
    note = [ln for ln in markdown(res).splitlines() if "same path" in ln]
    assert len(note) == 1 and "`blend@0.3:v`: exact on 1, exact (guarded) on 1." in note[0]
