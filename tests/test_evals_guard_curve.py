"""The guard's margin curve from one eval run (evals/guard_curve.py): each margin's outcome picks, item by
item, the guarded row under it and the unguarded row otherwise."""

from __future__ import annotations

import json

import pytest

from _eval_rows import item_json, item_row
from blend.evals import guard_curve as G
from blend.evals.rows import ItemRow

GUARDED, OFF = "blend@0.15:probe:guard=2@0.3", "blend@0.15:probe:guard=off"


def item(index: int, gap: float, fired_kl: float, off_kl: float, fired_top1: float = 1.0, off_top1: float = 1.0,
         fired_ttft: float = 0.6, off_ttft: float = 0.2) -> dict:
    """An item row's JSON (as rows.jsonl holds it)."""
    fired = gap < 2.0
    return item_json(index, {
        GUARDED: {"first_token_margin": gap, "guarded": fired, "kl": fired_kl if fired else off_kl,
                  "top1": fired_top1 if fired else off_top1, "ttft_ratio": fired_ttft if fired else off_ttft},
        OFF: {"first_token_margin": gap, "guarded": False, "kl": off_kl, "top1": off_top1, "ttft_ratio": off_ttft},
    })


def typed(rows: list[dict]) -> list[ItemRow]:
    return [ItemRow.from_json(r) for r in rows]


ROWS_JSON = [item(0, 0.1, 0.01, 0.30, 1.0, 0.0), item(1, 0.5, 0.02, 0.04), item(2, 1.5, 0.03, 0.05),
             item(3, 3.0, 0.0, 0.07)]
ROWS = typed(ROWS_JSON)


def test_each_margin_takes_the_guarded_row_under_it_and_the_unguarded_row_over_it():
    p0, p1, p2 = G.curve(ROWS, GUARDED, OFF, [0.0, 1.0, 2.0])
    assert p0.guarded == 0.0 and p0.kl_mean == pytest.approx((0.30 + 0.04 + 0.05 + 0.07) / 4) and p0.top1 == 0.75
    assert p0.ttft_mean == pytest.approx(0.2) and p0.kl_max == pytest.approx(0.30)
    assert p1.guarded == 0.5 and p1.kl_mean == pytest.approx((0.01 + 0.02 + 0.05 + 0.07) / 4) and p1.top1 == 1.0
    assert p1.ttft_mean == pytest.approx((0.6 + 0.6 + 0.2 + 0.2) / 4) and p1.ttft_median == pytest.approx(0.4)
    assert p2.guarded == 0.75 and p2.kl_max == pytest.approx(0.07)  # item 3's gap is over the guard's own 2.0
    assert p2.kl_mean == pytest.approx(G.curve(ROWS, GUARDED, GUARDED, [2.0])[0].kl_mean)  # = the guarded run


def test_runs_that_cannot_give_the_curve_say_why():
    with pytest.raises(G.CurveError, match=r"\[0, 2\]"):
        G.curve(ROWS, GUARDED, OFF, [2.5])
    with pytest.raises(G.CurveError, match="no guard margin"):
        G.curve(ROWS, OFF, GUARDED, [0.5])
    other = [item(0, 0.1, 0.01, 0.3)]
    other[0]["methods"][OFF]["first_token_margin"] = 0.9
    with pytest.raises(G.CurveError, match="first passes differ"):
        G.curve(typed(other), GUARDED, OFF, [0.5])
    old = [item(0, 0.1, 0.01, 0.3)]
    del old[0]["methods"][GUARDED]["first_token_margin"]
    with pytest.raises(G.CurveError, match="no first_token_margin"):
        G.curve(typed(old), GUARDED, OFF, [0.5])
    with pytest.raises(G.CurveError, match="lacks"):
        G.curve([item_row(0, {})], GUARDED, OFF, [0.5])
    with pytest.raises(G.CurveError, match="no items"):
        G.curve([], GUARDED, OFF, [0.5])
    wrong = [item(0, 2.5, 0.01, 0.3)]
    wrong[0]["methods"][GUARDED]["guarded"] = True
    with pytest.raises(G.CurveError, match="over its margin"):
        G.curve(typed(wrong), GUARDED, OFF, [0.5])


def test_the_command_writes_a_table_and_a_plot(tmp_path, capsys):
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS_JSON) + "\n")
    assert G.main(["--run", str(tmp_path), "--guarded", GUARDED, "--off", OFF, "--margins", "0,1,2"]) == 0
    md = (tmp_path / "guard_curve.md").read_text()
    assert "| 1 | 0.500 | 0.0375 |" in md and (tmp_path / "guard_curve.png").stat().st_size > 0
    assert "4 items" in capsys.readouterr().out
    (tmp_path / "rows.jsonl").write_text("{not json\n")
    assert G.main(["--run", str(tmp_path), "--guarded", GUARDED, "--off", OFF]) == 2
    assert "not JSON" in capsys.readouterr().err
    assert G.main(["--run", str(tmp_path / "missing"), "--guarded", GUARDED, "--off", OFF]) == 2


def test_a_resumed_runs_later_line_of_an_item_supersedes_the_earlier_one(tmp_path):
    # a --resume that adds a method appends a merged row per item: the curve counts each item once, from it
    first = [{**r, "methods": {OFF: r["methods"][OFF]}} for r in ROWS_JSON]
    lines = first + ROWS_JSON[::-1]  # every item twice, the merged rows last (in another order)
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    rows = G.read_rows(tmp_path)
    assert [r.index for r in rows] == [0, 1, 2, 3] and rows == ROWS
    assert G.curve(rows, GUARDED, OFF, [1.0]) == G.curve(ROWS, GUARDED, OFF, [1.0])
    (tmp_path / "rows.jsonl").write_text(json.dumps({"methods": {}}) + "\n")  # no index: not an item row
    with pytest.raises(G.CurveError, match="not an item row"):
        G.read_rows(tmp_path)
    bad = {**ROWS_JSON[0], "methods": {OFF: {**ROWS_JSON[0]["methods"][OFF], "kl": "0.1"}}}
    (tmp_path / "rows.jsonl").write_text(json.dumps(bad) + "\n")  # a field of the wrong type, named
    with pytest.raises(G.CurveError, match=r"rows.jsonl:1: not an item row .*\.kl: not a finite number"):
        G.read_rows(tmp_path)


def test_a_rows_file_past_the_readers_cap_is_refused_unread(tmp_path, monkeypatch):
    """read_rows read rows.jsonl whole whatever its size (the harness reading the same file back caps it)."""
    text = "\n".join(json.dumps(r) for r in ROWS_JSON) + "\n"
    (tmp_path / "rows.jsonl").write_text(text)
    monkeypatch.setattr(G, "MAX_ROWS_BYTES", len(text) - 1)
    with pytest.raises(G.CurveError, match=f"rows.jsonl: {len(text)} bytes, over the cap"):
        G.read_rows(tmp_path)
    monkeypatch.setattr(G, "MAX_ROWS_BYTES", len(text))
    assert G.read_rows(tmp_path) == ROWS


def test_an_eval_row_records_the_first_passs_gap_and_whether_the_guard_fired(tiny_engine):
    from blend.evals.harness import EvalConfig, evaluate_item
    from blend.evals.items import Document, Item
    from blend.evals.methods import parse_methods

    methods = parse_methods(f"full,{GUARDED},{OFF}")
    policies = {m.name: m.policy() for m in methods}
    docs = tuple(Document("", f"Document {i} says the code word is w{i}.") for i in range(4))
    row = evaluate_item(tiny_engine, Item("x", "Which word?", docs, ("w1",)), 0, methods, policies,
                        EvalConfig("x", 1, 4, tuple(m.name for m in methods), "tiny", "float32", max_new_tokens=2, repeats=1,
                                   warmup=0), False)
    g, o = row.methods[GUARDED], row.methods[OFF]
    assert g.first_token_margin == o.first_token_margin is not None
    assert g.guarded == (g.first_token_margin < 2.0) and o.guarded is False
    assert row.methods["full"].first_token_margin is None and row.methods["full"].guarded is False
    assert ItemRow.from_json(json.loads(json.dumps(row.to_json()))) == row  # what rows.jsonl reads back


def test_a_run_pairs_each_guarded_blend_with_the_same_blend_unguarded():
    names = ["full", "blend@0.15:probe", GUARDED, "blend@0.15:probe:guard=0.5@0.3:gmode=widen", OFF,
             "blend@0.3:probe", "blend@0.15:v:guard=1@0.3", "reuse"]
    assert G.guard_pairs(names) == [("blend@0.15:probe", OFF), (GUARDED, OFF),
                                    ("blend@0.15:probe:guard=0.5@0.3:gmode=widen", OFF)]
    assert G.guard_margin_of("blend@0.15:probe") == 0.7  # the engine's default guard
    assert G.default_margins(0.7) == [0.0, 0.1, 0.2, 0.3, 0.5, 0.7] and G.default_margins(0.25)[-1] == 0.25


def test_results_md_shows_the_guard_by_margin_where_a_run_allows_it():
    from blend.evals.report import _guard_lines

    names = ["full", GUARDED, OFF]
    md = "\n".join(_guard_lines(names, ROWS))
    assert f"## The near-tie guard by margin: `{GUARDED}` against `{OFF}`" in md and "| 1 | 0.500 | 0.0375 |" in md
    old = typed([{**r, "methods": {k: {f: v for f, v in m.items() if f != "first_token_margin"}
                                   for k, m in r["methods"].items()}} for r in ROWS_JSON])
    md = "\n".join(_guard_lines(names, old))
    assert "No guard margin table" in md and "no first_token_margin" in md
    assert _guard_lines(["full", OFF], ROWS) == []


def test_the_guarded_share_counts_items_the_guard_re_ran_not_gaps_under_the_margin():
    """The guard does not fire where the blend kept no re-positioned row (one passage, every document exact):
    the column said 1.000 on a run where it fired on none."""
    never = [item(i, 0.1 * (i + 1), 0.02, 0.02) for i in range(4)]
    for r in never:
        r["methods"][GUARDED]["guarded"] = False
    (p,) = G.curve(typed(never), GUARDED, OFF, [1.0])
    assert p.guarded == 0.0
    assert G.curve(ROWS, GUARDED, OFF, [1.0])[0].guarded == 0.5  # where it fired, as before


def test_the_table_and_plot_name_the_runs_items_and_split(tmp_path, monkeypatch):
    """guard_curve.md and .png said "4 items", not which: margins read off tuning items looked like
    validation's (README: "Those margins come from validation")."""
    from blend import safeio

    rows = [dict(r, index=30 + i) for i, r in enumerate(ROWS_JSON)]
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "run.json").write_text(json.dumps({"identity": {"data": "../shared/data/musique_dev.json"}}))
    figures = []
    monkeypatch.setattr(safeio, "save_figure", lambda fig, path, **kw: figures.append(fig))
    assert G.main(["--run", str(tmp_path), "--guarded", GUARDED, "--off", OFF, "--margins", "0,1,2"]) == 0
    caption = "items 30-33 (4 items), validation split"
    assert (tmp_path / "guard_curve.md").read_text().startswith(f"# The near-tie guard by margin ({caption})")
    assert caption in figures[0].get_suptitle()
    (tmp_path / "run.json").write_text("[not a run")  # unreadable settings: the count alone, no guessed split
    assert G.main(["--run", str(tmp_path), "--guarded", GUARDED, "--off", OFF, "--margins", "0,1,2"]) == 0
    assert (tmp_path / "guard_curve.md").read_text().startswith("# The near-tie guard by margin (4 items)")


def test_the_plot_says_its_ttft_axis_is_a_mean_of_per_item_ratios(tmp_path, monkeypatch):
    """The x axis read "mean TTFT / full prefill" (a ratio of means); it is the mean of each item's ratio."""
    from blend import safeio

    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS_JSON) + "\n")
    figures = []
    monkeypatch.setattr(safeio, "save_figure", lambda fig, path, **kw: figures.append(fig))
    assert G.main(["--run", str(tmp_path), "--guarded", GUARDED, "--off", OFF, "--margins", "0,1,2"]) == 0
    assert {ax.get_xlabel() for ax in figures[0].axes} == {"TTFT / full prefill (same item), mean over items"}


def test_the_table_says_its_ttft_columns_are_ratios_to_full_prefill():
    """The header read "TTFT median / mean / p90" over values like 0.279: ratios to full prefill, not seconds."""
    points = G.curve(typed(ROWS_JSON), GUARDED, OFF, [0.0, 1.0])
    assert G.table_lines(points)[0].endswith("| TTFT / full prefill: median / mean / p90 |")
