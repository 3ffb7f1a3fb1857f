"""How long a method's answer stays full prefill's (evals/answer_survival.py): the shares by answer length,
from the leading tokens each row shares with full's answer."""

from __future__ import annotations

import pytest

from _eval_rows import item_row, method_row
from blend.evals import answer_survival as S
from blend.evals import metrics as M
from blend.evals.rows import ItemRow

B = "blend@0.15"


def row(index: int, ref_len: int, same: int | None, length: int) -> ItemRow:
    """An item whose blend row shares ``same`` leading tokens with full's (None: a row from before the field)."""
    return item_row(index, {"full": method_row(answer_tokens=ref_len, same_tokens=ref_len),
                            B: method_row(answer_tokens=length, same_tokens=same)})


def test_common_prefix_counts_the_leading_tokens_two_answers_share():
    assert M.common_prefix([1, 2, 3], [1, 2, 3]) == 3
    assert M.common_prefix([1, 2, 3], [1, 2]) == 2
    assert M.common_prefix([1, 2, 3], [1, 5, 3]) == 1
    assert M.common_prefix([], [4]) == 0 and M.common_prefix([], []) == 0


def test_an_answer_the_same_to_its_end_counts_past_its_length_and_one_that_goes_on_does_not():
    assert S.same_through(5, 5, 5, 32)  # identical: the same at every k
    assert S.same_through(5, 8, 5, 5) and not S.same_through(5, 8, 5, 6)  # full stopped, the method went on
    assert S.same_through(3, 3, 5, 3) and not S.same_through(3, 3, 5, 4)  # the method stopped early
    assert S.same_through(0, 0, 0, 1)  # both answered nothing
    assert not S.same_through(0, 4, 4, 1)


def test_shares_by_answer_length_whole_answers_and_the_median():
    rows = [row(0, 10, 10, 10), row(1, 10, 0, 10), row(2, 10, 3, 12), row(3, 6, 6, 9)]
    s = S.survival(rows, B, ks=(1, 2, 4, 8, 16))
    assert s.n == 4 and s.ks == (1, 2, 4, 8, 16)
    assert s.shares == (0.75, 0.75, 0.5, 0.25, 0.25)  # only item 0 is full's through 8 and 16
    assert s.whole == 0.25 and s.median_same == pytest.approx(4.5)
    assert 0.0 <= s.whole_ci[0] <= 0.25 <= s.whole_ci[1] <= 1.0
    full = S.survival(rows, "full")
    assert full.whole == 1.0 and set(full.shares) == {1.0}
    assert S.curve_points(rows, B, 4) == [0.75, 0.75, 0.75, 0.5]


def test_rows_written_before_the_field_are_left_out_and_none_at_all_gives_nothing():
    rows = [row(0, 10, 10, 10), row(1, 10, None, 10)]
    assert S.survival(rows, B).n == 1
    assert S.survival([row(1, 10, None, 10)], B) is None
    assert S.survival(rows, "absent") is None
    assert S.table_lines([]) == []


def test_table_lines_give_a_column_per_length_and_the_whole_answer():
    lines = S.table_lines([S.survival([row(0, 4, 2, 4)], B, ks=(1, 4))])
    assert lines[0] == "| method | n | first 1 | first 4 | whole answer [95% CI] | median tokens in common |"
    assert lines[2] == f"| `{B}` | 1 | 1.000 | 0.000 | 0.000 [0.000, 0.000] | 2 |"


def test_the_whole_answer_ci_uses_the_runs_own_bootstrap_resamples_and_seed():
    """results.md's survival CI is a CI of the run: ``--bootstrap`` and ``--seed`` as for every other CI (it
    was always 1000 resamples, seed 0)."""
    rows = [row(i, 10, 10 if i % 3 else 2, 10) for i in range(12)]
    whole = [0.0 if i % 3 == 0 else 1.0 for i in range(12)]
    s = S.survival(rows, B, n_boot=7, seed=3)
    assert s.whole_ci == M.bootstrap_ci(whole, n=7, seed=3) != M.bootstrap_ci(whole)
    ci = M.bootstrap_ci(whole, n=7, seed=3)
    lines = S.markdown_lines(rows, ["full", B], 8, n_boot=7, seed=3)
    assert f"[{ci[0]:.3f}, {ci[1]:.3f}]" in "\n".join(lines)


def test_results_md_gives_the_survival_ci_of_the_runs_bootstrap(tmp_path):
    from blend.evals.report import markdown
    from test_evals_report import make_results

    res = make_results()
    res["config"].update(bootstrap=5, seed=11)
    rows = [row(i, 10, 10 if i % 3 else 2, 10) for i in range(12)]
    res["items"] = [r.to_json() for r in rows]
    res["methods"] = {"full": res["methods"]["full"], B: {**res["methods"]["blend@0.1:v"], "n": 12}}
    res["methods"]["full"]["n"] = 12
    whole = [0.0 if i % 3 == 0 else 1.0 for i in range(12)]
    ci = M.bootstrap_ci(whole, n=5, seed=11)
    assert ci != M.bootstrap_ci(whole)
    assert f"0.667 [{ci[0]:.3f}, {ci[1]:.3f}]" in markdown(res)
