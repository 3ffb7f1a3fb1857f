"""results.json validator, results.md table, pareto.png, progress bar."""

import copy
import io

import pytest

from blend.evals.plot import series, write_pareto
from blend.progress import Progress, format_duration
from blend.evals.report import best_per_column, markdown
from blend.evals.results_schema import SchemaError, validate_results

ROW_KEYS = ("f1", "em", "rouge_l", "contains", "agreement", "kl", "top1", "tf_agreement", "tf_kl", "ttft_s", "ttft_ratio",
            "recomputed_frac", "computed_frac")


def _agg(f1, kl, ratio, agreement, kind, r=None, selector=None, n=2):
    return {
        "f1": f1, "em": f1, "rouge_l": f1, "contains": f1, "agreement": agreement, "kl": kl, "top1": agreement,
        "tf_agreement": agreement, "tf_kl": kl, "ttft_median_s": 0.1 * ratio, "ttft_p90_s": 0.12 * ratio,
        "ttft_ratio": ratio, "ttft_ratio_mean": ratio, "recomputed_frac": r or 0.0, "computed_frac": 1.0,
        "recomputed_tokens": 10.0, "prompt_tokens": 100.0, "f1_ci": [max(f1 - 0.1, 0), min(f1 + 0.1, 1)],
        "ttft_ratio_ci": [ratio * 0.9, ratio * 1.1], "n": n,
        "spec": {"kind": kind, "ratio": r, "selector": selector, "check_layers": []},
    }


def _row(name):
    r = {k: 0.5 for k in ROW_KEYS}
    r.update(prediction="x", answer_tokens=1, recomputed_tokens=1, reused_tokens=2, prompt_tokens=3,
             ttft_samples=[0.1, 0.2])
    return r


def make_results():
    methods = {
        "full": _agg(0.6, 0.0, 1.0, 1.0, "full", 1.0),
        "reuse": _agg(0.2, 0.3, 0.3, 0.4, "reuse", 0.0),
        "blend@0.1:v": _agg(0.5, 0.1, 0.4, 0.7, "blend", 0.1, "v"),
        "blend@0.3:v": _agg(0.7, 0.05, 0.55, 0.9, "blend", 0.3, "v"),
        "blend@0.3:k": _agg(0.4, 0.05, 0.5, 0.8, "blend", 0.3, "k"),
    }
    items = [
        {"index": i, "id": str(i), "question": "q", "answers": ["a"], "prompt_tokens": 3, "full_answer": "x",
         "methods": {n: _row(n) for n in methods}}
        for i in range(2)
    ]
    return {
        "schema_version": 1,
        "config": {"data": "synthetic:single", "passages": 3, "max_new_tokens": 8, "repeats": 3},
        "model": {"name": "m", "dtype": "float32", "provenance": {"dtype": "float32"}},
        "versions": {"python": "3"}, "machine": {"platform": "p", "accelerator": None},
        "reference": "full", "methods": methods, "items": items,
    }


def test_hand_built_results_validate():
    validate_results(make_results())


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda r: r.pop("items"), "results.items: missing"),
        (lambda r: r.__setitem__("schema_version", "1"), "results.schema_version"),
        (lambda r: r["methods"].pop("full"), "'full' is missing"),
        (lambda r: r["methods"]["reuse"].__setitem__("kl", "big"), "results.methods['reuse'].kl"),
        (lambda r: r["methods"]["reuse"].__setitem__("f1", 1.5), "outside [0, 1]"),
        (lambda r: r["methods"]["reuse"].__setitem__("kl", -0.1), "kl: negative"),
        (lambda r: r["methods"]["reuse"].__setitem__("f1_ci", [0.5, 0.1]), "f1_ci"),
        (lambda r: r["methods"]["reuse"].__setitem__("n", 3), "n: does not match"),
        (lambda r: r["items"][1]["methods"].pop("reuse"), "results.items[1].methods"),
        (lambda r: r["items"][0]["methods"]["full"].pop("tf_agreement"), "items[0].methods['full'].tf_agreement"),
        (lambda r: r["items"][0]["methods"]["full"].__setitem__("prompt_tokens", 1.5), "prompt_tokens"),
        (lambda r: r["model"].pop("provenance"), "results.model.provenance"),
        (lambda r: r["items"][0]["methods"]["full"].__setitem__("threads", 0), "methods['full'].threads"),
        (lambda r: r["items"][0]["methods"]["full"].__setitem__("ttft_ref_s", "1"), "ttft_ref_s"),
    ],
)
def test_validator_rejects(mutate, needle):
    r = copy.deepcopy(make_results())
    mutate(r)
    with pytest.raises(SchemaError) as e:
        validate_results(r)
    assert needle in str(e.value)


def test_markdown_sorted_and_best_marked():
    md = markdown(make_results())
    rows = [ln for ln in md.splitlines() if ln.startswith("| `")]
    names = [ln.split("`")[1] for ln in rows]
    # full first, then KL ascending, ties by TTFT ratio (k 0.5 before v 0.55)
    assert names == ["full", "blend@0.3:k", "blend@0.3:v", "blend@0.1:v", "reuse"]
    best = best_per_column(make_results()["methods"])
    assert best["f1"] == {"blend@0.3:v"}  # 0.7 beats full's 0.6
    assert best["kl"] == {"blend@0.3:v", "blend@0.3:k"}  # full excluded, ties both marked
    assert best["agreement"] == {"blend@0.3:v"}
    assert best["ttft_ratio"] == {"reuse"}
    full_row = rows[0]
    cells = full_row.split("|")
    assert cells[7].strip() == "0"  # full's KL (0) is not marked best
    assert "1.000" in cells[6] and "**" not in cells[6]  # nor its agreement with itself
    assert "**0.700" in rows[2] and "**0.300" in rows[4]


def test_markdown_warns_when_methods_were_timed_with_other_thread_counts():
    res = make_results()
    assert "thread counts" not in markdown(res)  # nothing recorded anywhere: one group
    for name in res["methods"]:
        res["methods"][name]["threads"] = [1]
    assert "thread counts" not in markdown(res)
    res["methods"]["blend@0.3:k"]["threads"] = [2]  # added by a resumed run with two threads
    res["methods"]["reuse"]["threads"] = []
    note = [ln for ln in markdown(res).splitlines() if "thread counts" in ln]
    assert len(note) == 1
    assert "1: `full`, `blend@0.3:v`, `blend@0.1:v`; 2: `blend@0.3:k`; unrecorded: `reuse`" in note[0]


def test_markdown_header_gives_the_ttft_samples_the_rows_hold():
    res = make_results()
    res["config"]["repeats"] = 3
    assert "TTFT median of 3 per item" in markdown({**res, "items": []})  # no rows, no samples: the config's
    for it in res["items"]:
        for r in it["methods"].values():
            r["ttft_samples"] = [0.1] * 3
    assert "TTFT median of 3 per item" in markdown(res)
    res["items"][0]["methods"]["full"]["ttft_samples"] = [0.1] * 5  # measured before a resume with --repeats 3
    assert "TTFT median of 3-5 (a resumed run changed --repeats) per item" in markdown(res)


def test_pareto_series_and_png(tmp_path):
    res = make_results()
    assert series(res["methods"]) == {"k": [(0.3, "blend@0.3:k")], "v": [(0.1, "blend@0.1:v"), (0.3, "blend@0.3:v")]}
    path = tmp_path / "pareto.png"
    write_pareto(res, path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def _drawn(monkeypatch, draw, res, tmp_path):
    """The matplotlib figure ``draw(res, path)`` saves (kept open for reading its text)."""
    from blend import safeio

    figures = []
    monkeypatch.setattr(safeio, "save_figure", lambda fig, path, **kw: figures.append(fig))
    draw(res, tmp_path / "figure.png")
    (fig,) = figures
    return fig


def test_the_run_figures_name_the_items_and_split_and_what_each_axis_aggregates(monkeypatch, tmp_path):
    """pareto.png and answer_survival.png named neither the item range nor its split (results.md did), so a
    figure of tuning items read as validation's; pareto's axes did not say median TTFT ratio, mean KL."""
    from blend.evals.answer_survival import write_plot

    res = make_results()
    res["config"]["data"] = "../shared/data/musique_dev.json"
    res["items"] = [dict(res["items"][0], index=i, id=str(i)) for i in (30, 31, 32)]
    for it in res["items"]:
        for r in it["methods"].values():
            r.update(same_tokens=1, answer_tokens=1)
    pareto = _drawn(monkeypatch, write_pareto, res, tmp_path)
    caption = "m on ../shared/data/musique_dev.json, items 30-32 (3 items), validation split"
    assert pareto.get_suptitle() == caption
    titles = [ax.get_title() for ax in pareto.axes]
    assert titles == ["mean F1 vs gold", "share of answers equal to full's", "mean KL(full || method), first token (nats)"]
    assert {ax.get_xlabel() for ax in pareto.axes} == {"TTFT / full prefill TTFT (median over items)"}
    survival = _drawn(monkeypatch, write_plot, res, tmp_path)
    assert survival.axes[0].get_title() == caption
    res["items"] = [dict(res["items"][0], index=i, id=str(i)) for i in (0, 1)]
    assert "items 0-1 (2 items), tuning split" in _drawn(monkeypatch, write_pareto, res, tmp_path).get_suptitle()


def test_progress_eta_with_fake_clock():
    t = [100.0]
    buf = io.StringIO()
    p = Progress(total=4, stream=buf, clock=lambda: t[0])
    assert p.eta_s() is None
    t[0] += 10
    p.update()
    assert p.eta_s() == pytest.approx(30.0)  # 10 s per item, 3 left
    assert "1/4 items" in buf.getvalue() and "left 0:30" in buf.getvalue()
    assert "0:10/item" in buf.getvalue()  # slow units (< 1/s): time per unit
    r = Progress(total=10, stream=None, clock=lambda: t[0])
    r.skip(6)  # resumed items do not count towards the rate
    t[0] += 5
    r.update()
    assert r.eta_s() == pytest.approx(15.0)  # 5 s per item, 3 left
    assert format_duration(3725) == "1:02:05" and format_duration(None) == "?"


def test_best_selector_per_budget():
    from blend.evals.report import best_by_budget

    methods = make_results()["methods"]
    rows = best_by_budget(methods)
    assert len(rows) == 1  # 0.1 has one selector only: nothing to compare
    r = rows[0]
    assert (r.ratio, r.candidates) == (0.3, 2)
    assert r.by_kl == "blend@0.3:k"  # KL tie (0.05): first name wins
    assert r.by_f1 == "blend@0.3:v" and r.f1 == 0.7
    md = markdown(make_results())
    assert "## Best selector per budget" in md and "| 0.3 | default | 2 | `blend@0.3:k` |" in md


def _header(res):
    return markdown(res).splitlines()[2]


def test_results_md_names_the_item_range_and_its_split():
    from blend.evals.report import range_split

    res = make_results()  # synthetic:single, items 0-1
    assert "items 0-1 (2 items), synthetic split" in _header(res)
    res["config"]["data"] = "../shared/data/musique_dev.json"

    def with_items(indices):
        r = copy.deepcopy(res)
        r["items"] = [dict(r["items"][0], index=i, id=str(i)) for i in indices]
        return _header(r)

    tuning = with_items(range(30))  # what kvblend eval's default --limit 30 runs
    assert "items 0-29 (30 items), tuning split" in tuning and "--items 30-99" in tuning
    assert "items 30-99 (70 items), validation split," in with_items(range(30, 100))
    assert "items 25-34 (10 items), mixed split" in with_items(range(25, 35))
    assert "items 30-40 (2 items, 9 missing), validation split" in with_items([30, 40])
    assert "items 100-101 (2 items), other split" in with_items([100, 101])
    res["config"]["data"] = "/data/hotpot.jsonl"  # another file: musique_dev's indices mean nothing
    assert "items 0-29 (30 items), other split" in with_items(range(30))
    assert range_split(0, 29) == "tuning" and range_split(30, 99) == "validation"
    assert range_split(0, 99) == "mixed" and range_split(90, 120) == "mixed" and range_split(100, 200) == "other"
    assert range_split(0, 29, "synthetic:two-hop") == "synthetic"


def test_pareto_series_keep_methods_apart_that_differ_beyond_selector_and_ratio():
    """``blend@0.15:probe`` and ``blend@0.15:probe:guard=off`` are two methods: two lines, not one line joining
    two points at the same budget (the labels are the methods' own series labels)."""
    from blend.evals.methods import parse_method

    names = ["blend@0.15:probe", "blend@0.3:probe", "blend@0.15:probe:guard=off", "blend@0.3:probe:auto",
             "blend@0.15:v:check=1,2", "blend@0.15:probe:temp=1.05:cand=2"]
    methods = {n: {"spec": parse_method(n).to_dict()} for n in names}
    got = series(methods)
    assert got == {parse_method(n).series(): [(parse_method(n).ratio, n)] for n in names[2:]} | {
        "probe": [(0.15, "blend@0.15:probe"), (0.3, "blend@0.3:probe")]}
    assert "v check=1,2" in got


def test_variants_of_one_selector_are_not_ranked_as_rival_selectors():
    """A guarded and an unguarded probe blend spend different budgets: "best selector" compared them."""
    from blend.evals.report import best_by_budget

    def agg(kl, **spec):
        base = {"kind": "blend", "ratio": 0.15, "selector": "probe", "check_layers": [1], "auto": False,
                "guard": None, "temperature": 1.05}
        return {"kl": kl, "tf_agreement": 0.9, "f1": 0.1, "spec": {**base, **spec}}

    methods = {"blend@0.15:probe:guard=2@0.3": agg(0.026, guard=[2.0, 0.3]), "blend@0.15:probe:guard=off": agg(0.033)}
    assert best_by_budget(methods) == []
    methods["blend@0.15:v:guard=off"] = agg(0.05, selector="v")
    rows = best_by_budget(methods)
    assert len(rows) == 1 and rows[0].candidates == 2 and rows[0].by_kl == "blend@0.15:probe:guard=off"


def test_markdown_names_a_method_that_did_not_run_the_same_path_on_every_item():
    """A blend refused on some items (or with nothing to blend there) ran exact or none on them: results.md says
    so, from the rows' ``applied``, since that method's figures mix a blend's rows with others'."""
    res = make_results()
    assert "same path" not in markdown(res)  # rows from before the field: nothing to say
    for it in res["items"]:
        for name, r in it["methods"].items():
            r["applied"] = "none" if name == "full" else "blend"
    assert "same path" not in markdown(res)
    res["items"][1]["methods"]["blend@0.3:v"]["applied"] = "exact"
    note = [ln for ln in markdown(res).splitlines() if "same path" in ln]
    assert len(note) == 1 and "`blend@0.3:v`: blend on 1, exact on 1." in note[0]


def test_markdown_names_a_blend_that_ran_another_path_on_every_item():
    """The warning only fired on mixed paths: a blend refused on every item (the quality gate failing, a
    prompt under min_prompt_tokens) ran ``none``, a full prefill, everywhere, and its row was reported as the
    blend without a word. A method's rows are now also held to its own path (from its spec)."""
    res = make_results()
    for it in res["items"]:
        for name, r in it["methods"].items():
            r["applied"] = "exact" if name == "full" else "blend"
        it["methods"]["blend@0.3:k"]["applied"] = "none"
    note = [ln for ln in markdown(res).splitlines() if "same path" in ln]
    assert len(note) == 1 and "`blend@0.3:k`: none on 2." in note[0] and "`full`" not in note[0]
    for it in res["items"]:
        it["methods"]["blend@0.3:k"]["applied"] = "blend"
        it["methods"]["full"]["applied"] = "blend"  # a full prefill that blended is not one
    assert "`full`: blend on 2." in markdown(res)


def test_results_md_says_which_ttft_ratio_its_column_is():
    """The column is the median over items of per-item ratios; a reader could take it for a ratio of means."""
    md = markdown(make_results())
    assert "TTFT ratio: the median over items of each item's ratio" in md and "not a ratio of mean TTFTs" in md


def test_the_worst_items_say_which_methods_rank_them_and_how_ties_go():
    from blend.evals.report import worst_items
    from blend.evals.rows import ItemRow

    res = make_results()
    for i, it in enumerate(res["items"]):  # two items whose blends tie at the same mean KL
        for n, m in it["methods"].items():
            m["kl"] = 0.0 if n == "full" else 0.2
    assert "over the blend methods" in markdown(res) and "Ties: the lower item index first" in markdown(res)
    rows = [ItemRow.from_json(r) for r in reversed(res["items"])]
    assert [r.index for r in worst_items(res["methods"], rows)] == [0, 1]
    for name in ("blend@0.1:v", "blend@0.3:v", "blend@0.3:k"):  # a run without a blend: reuse ranks them
        res["methods"].pop(name)
        for it in res["items"]:
            it["methods"].pop(name)
    md = markdown(res)
    assert "over every method but full (the run has no blend)" in md and "over the blend methods" not in md
