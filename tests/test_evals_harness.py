"""The harness end to end: a deterministic fake engine (flow, interleaving,
resume) and the real engine on the tiny model (skipped until it imports)."""

import argparse
import copy
import hashlib
import json
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from blend.evals.cli import config_from_args, configure_parser, run_eval
from blend.evals.data import load_items
from blend.evals.harness import EvalConfig, ResumeError, run_harness
from blend.evals.methods import MethodKind, parse_methods
from blend.evals import answer_survival as S
from blend.evals.report import markdown
from blend.evals.results_schema import SchemaError, validate_results
from blend.evals.rows import ItemRow

V = 48


@dataclass(frozen=True)
class FakeProvenance:
    model_arch: str = "fake"
    dtype: str = "float32"


def _ratio(m) -> float:
    return {MethodKind.FULL: 1.0, MethodKind.PREFIX: 1.0, MethodKind.REUSE: 0.0}.get(m.kind, m.ratio)


class FakeEngine:
    """Deterministic logits from the token ids; methods below ratio 1 add seeded noise.

    Its answer text is the gold answer when its tokens equal full prefill's, so F1 is known.
    Policies are the :class:`Method` objects themselves (``policy_of=lambda m: m``).
    """

    model_name = "fake"
    provenance = FakeProvenance()

    def __init__(self, gold: dict[str, str], fail_on: str | None = None):
        self.gold, self.fail_on, self.calls = gold, fail_on, []

    def build_prompt(self, question, documents, system=None):
        if question == self.fail_on:
            raise KeyboardInterrupt("simulated interruption")
        self.calls.append(("prompt", question, None, None))
        text = (system or "") + "|" + "|".join(documents) + "|" + question
        return SimpleNamespace(token_ids=list(text.encode()), question=question)

    @staticmethod
    def _seeded(ids, salt: bytes) -> torch.Tensor:
        h = hashlib.sha256(salt + bytes(i % 256 for i in ids)).digest()
        return torch.randn(V, generator=torch.Generator().manual_seed(int.from_bytes(h[:8], "little")))

    def _logits(self, ids, m) -> torch.Tensor:
        base = 3.0 * self._seeded(ids, b"base")
        return base + (1.0 - _ratio(m)) * 2.0 * self._seeded(ids, b"noise")

    def _decode(self, prompt, m, n):
        out, ids = [], list(prompt.token_ids)
        first = self._logits(ids, m)
        logits = first
        while len(out) < n:
            tok = int(torch.argmax(logits))
            if tok == 0:
                break
            out.append(tok)
            logits = self._logits(ids + out, m)
        return out, first

    def precompute(self, prompt, policy):
        self.calls.append(("precompute", prompt.question, policy.name, None))

    def generate(self, prompt, policy, max_new_tokens=32, keep_cache=False):
        self.calls.append(("generate", prompt.question, policy.name, max_new_tokens))
        out, first = self._decode(prompt, policy, max_new_tokens)
        full_out, _ = self._decode(prompt, parse_methods("full")[0], max_new_tokens)
        text = self.gold[prompt.question] if out == full_out else "wrong " + " ".join(map(str, out))
        r, n = _ratio(policy), len(prompt.token_ids)
        reused = 0 if policy.kind is MethodKind.FULL else n - 10
        report = SimpleNamespace(recomputed_tokens=int(r * reused), reused_tokens=reused, prompt_tokens=n)
        return SimpleNamespace(text=text, token_ids=out, first_logits=first, ttft_s=0.01 * (0.3 + 0.7 * r),
                               report=report)

    def teacher_forced_logits(self, prompt, policy, continuation, answer=None):
        self.calls.append(("tf", prompt.question, policy.name, None))
        ids = list(prompt.token_ids)
        return torch.stack([self._logits(ids + list(continuation[:i]), policy) for i in range(len(continuation) + 1)])


METHODS = "full,reuse,blend@1.0,blend@0.5:v,blend@0.2:k"


def _args(tmp_path, *extra, data="synthetic:single", out="out", methods=METHODS):
    argv = ["--data", data, "--limit", "3", "--passages", "3", "--methods", methods, "--out", str(tmp_path / out),
            "--max-new-tokens", "6", "--no-progress", "--bootstrap", "200", *extra]
    return configure_parser(argparse.ArgumentParser()).parse_args(argv)


def _fake_factory(engines, fail_on=None):
    def make(config):
        items = load_items(config.data, config.limit, config.passages, config.seed)
        e = FakeEngine({it.question: it.answers[0] for it in items}, fail_on)
        engines.append(e)
        return e
    return make


def _strip_timings(x):
    """Without what a second run measures anew: TTFTs and the machine's load average."""
    if isinstance(x, dict):
        return {k: _strip_timings(v) for k, v in x.items() if not k.startswith("ttft") and k != "load_average"}
    if isinstance(x, list):
        return [_strip_timings(v) for v in x]
    return x


def test_fake_end_to_end_writes_outputs(tmp_path):
    engines = []
    assert run_eval(_args(tmp_path), _fake_factory(engines), policy_of=lambda m: m) == 0
    out = tmp_path / "out"
    res = json.loads((out / "results.json").read_text())
    validate_results(res)
    assert list(res["methods"]) == ["full", "reuse", "blend@1.0", "blend@0.5:v", "blend@0.2:k"]
    for name in ("full", "blend@1.0"):  # identical logits: perfect against full and gold
        m = res["methods"][name]
        assert (m["agreement"], m["top1"], m["tf_agreement"], m["kl"], m["f1"], m["em"], m["n"]) == (
            1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 3)
    reuse = res["methods"]["reuse"]
    assert reuse["kl"] > 0.01 and reuse["tf_kl"] > 0.01
    assert reuse["ttft_ratio"] == pytest.approx(0.3) and res["methods"]["blend@0.5:v"]["ttft_ratio"] == pytest.approx(0.65)
    import torch

    assert reuse["threads"] == [torch.get_num_threads()]
    for row in res["items"]:  # each ratio's denominator is recorded beside it
        for r in row["methods"].values():
            assert r["ttft_ref_s"] == row["methods"]["full"]["ttft_s"]
            assert r["ttft_ratio"] == pytest.approx(r["ttft_s"] / r["ttft_ref_s"])
    # F1 of a method is 1 exactly on the items where its answer agrees with full's (the fake's oracle)
    for row in res["items"]:
        for r in row["methods"].values():
            assert r["f1"] == r["agreement"] == r["contains"]
    assert res["model"]["provenance"] == {"model_arch": "fake", "dtype": "float32"}
    assert len((out / "rows.jsonl").read_text().splitlines()) == 3
    md = (out / "results.md").read_text()
    assert "| `reuse` |" in md and "**" in md
    assert (out / "pareto.png").read_bytes()[:4] == b"\x89PNG"


def test_precompute_warmup_and_rotation(tmp_path):
    engines = []
    assert run_eval(_args(tmp_path), _fake_factory(engines), policy_of=lambda m: m) == 0
    calls = engines[0].calls
    questions = list(dict.fromkeys(c[1] for c in calls))
    assert len(questions) == 3
    names = ["full", "reuse", "blend@1.0", "blend@0.5:v", "blend@0.2:k"]
    for i, q in enumerate(questions):
        mine = [c for c in calls if c[1] == q]
        gens = [(pos, c) for pos, c in enumerate(mine) if c[0] == "generate"]
        first_quality = next(pos for pos, c in gens if c[3] == 6)
        # precompute of every non-full method happens before anything is generated
        assert sorted(c[2] for c in mine[:gens[0][0]] if c[0] == "precompute") == sorted(names[1:])
        warm = [c for pos, c in gens if pos < first_quality]
        assert all(c[3] == 1 for c in warm)
        assert len(warm) == (5 if i == 0 else 0)  # warm-up only before the first timed item
        quality = [c[2] for _, c in gens if c[3] == 6]
        assert quality == names[i:] + names[:i]  # order rotates per item
        last_quality = max(pos for pos, c in gens if c[3] == 6)
        timing = [c for pos, c in gens if pos > last_quality]
        assert all(c[3] == 1 for c in timing) and len(timing) == 2 * 5  # repeats=3: two one-token rounds
        assert [c[2] for c in timing[:5]] == names[i + 1:] + names[:i + 1]  # rounds rotate too
        assert sum(c[0] == "tf" for c in mine) == 5


def test_full_always_run(tmp_path):
    engines = []
    assert run_eval(_args(tmp_path, methods="reuse"), _fake_factory(engines), policy_of=lambda m: m) == 0
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert list(res["methods"]) == ["full", "reuse"]


def test_resume_after_interruption_matches_fresh_run(tmp_path, capsys):
    items = load_items("synthetic:single", 3, 3)
    engines = []
    assert run_eval(_args(tmp_path, out="r"), _fake_factory(engines, fail_on=items[2].question),
                    policy_of=lambda m: m) == 130
    assert "--resume goes on from there" in capsys.readouterr().err
    assert len((tmp_path / "r" / "rows.jsonl").read_text().splitlines()) == 2
    # a line cut short by the interruption is dropped and redone
    with (tmp_path / "r" / "rows.jsonl").open("a") as f:
        f.write('{"index": 2, "id": "sing')
    engines = []
    assert run_eval(_args(tmp_path, "--resume", out="r"), _fake_factory(engines), policy_of=lambda m: m) == 0
    assert {c[1] for c in engines[0].calls} == {items[2].question}  # only the missing item ran
    assert run_eval(_args(tmp_path, out="fresh"), _fake_factory([]), policy_of=lambda m: m) == 0
    resumed = json.loads((tmp_path / "r" / "results.json").read_text())
    fresh = json.loads((tmp_path / "fresh" / "results.json").read_text())
    assert _strip_timings(resumed) == _strip_timings(fresh)


def test_resume_with_other_settings_is_refused(tmp_path, capsys):
    assert run_eval(_args(tmp_path, out="r"), _fake_factory([]), policy_of=lambda m: m) == 0
    assert run_eval(_args(tmp_path, "--resume", out="r", methods="full,reuse"), _fake_factory([]),
                    policy_of=lambda m: m) == 2
    assert "may add methods, not drop them" in capsys.readouterr().err
    assert run_eval(_args(tmp_path, "--resume", "--max-new-tokens", "3", out="r"), _fake_factory([]),
                    policy_of=lambda m: m) == 2
    assert "different settings (max_new_tokens)" in capsys.readouterr().err
    items = load_items("synthetic:single", 3, 3)
    cfg = EvalConfig(data="synthetic:single", limit=3, passages=3, methods=("full",), model="m", dtype="float32")
    run_harness(FakeEngine({i.question: "x" for i in items}), items, parse_methods("full"), cfg, tmp_path / "d",
                policy_of=lambda m: m)
    other = load_items("synthetic:single", 3, 3, seed=5)
    with pytest.raises(ResumeError, match="item 0"):
        run_harness(FakeEngine({}), other, parse_methods("full"), cfg, tmp_path / "d", resume=True,
                    policy_of=lambda m: m)


def test_resume_over_other_passages_or_a_narrower_range_is_refused_and_keeps_every_row(tmp_path, capsys):
    data = tmp_path / "mine.jsonl"

    def write(tag):
        recs = [{"id": f"q{i}", "question": f"Who keeps lighthouse {i}?", "answers": [f"Ada {i}"],
                 "documents": [f"{tag}: lighthouse {i} is kept by Ada {i}.", f"{tag}: filler {i}."]} for i in range(4)]
        data.write_text("\n".join(json.dumps(r) for r in recs) + "\n")

    def run(limit, *extra):
        args = _args(tmp_path, "--limit", str(limit), *extra, data=str(data), methods="full,reuse")
        return run_eval(args, _fake_factory([]), policy_of=lambda m: m)

    write("first retriever")
    assert run(4) == 0
    rows = (tmp_path / "out" / "rows.jsonl").read_text()
    # a narrower range: the rows outside it would be dropped by the rewrite, so the run is refused
    assert run(2, "--resume") == 2
    assert "outside this run's range (2-3)" in capsys.readouterr().err
    assert (tmp_path / "out" / "rows.jsonl").read_text() == rows
    # the same questions over other passages: rows computed on the old ones are not merged in
    write("another retriever")
    assert run(4, "--resume") == 2
    err = capsys.readouterr().err
    assert "item 0" in err and "other passages" in err
    assert (tmp_path / "out" / "rows.jsonl").read_text() == rows
    write("first retriever")
    assert run(4, "--resume") == 0  # the data it was computed on: nothing to redo


def test_resume_of_rows_without_their_run_file_is_refused_not_emptied(tmp_path, capsys):
    assert run_eval(_args(tmp_path, out="r"), _fake_factory([]), policy_of=lambda m: m) == 0
    (tmp_path / "r" / "run.json").unlink()
    rows = (tmp_path / "r" / "rows.jsonl").read_text()
    assert run_eval(_args(tmp_path, "--resume", out="r"), _fake_factory([]), policy_of=lambda m: m) == 2
    assert "no run.json" in capsys.readouterr().err and (tmp_path / "r" / "rows.jsonl").read_text() == rows


def test_resume_over_a_damaged_middle_row_or_run_file_is_refused_and_keeps_every_row(tmp_path, capsys):
    """Only a torn last line is dropped: a bad line before other rows dropped every row after it, and the
    rewrite then lost them. A damaged run.json raised JSONDecodeError (a traceback), not ResumeError."""
    assert run_eval(_args(tmp_path, out="r"), _fake_factory([]), policy_of=lambda m: m) == 0
    rows_path = tmp_path / "r" / "rows.jsonl"
    lines = rows_path.read_text().splitlines()
    damaged = "\n".join([lines[0], '{"index": 1, "id"', *lines[1:]]) + "\n"
    rows_path.write_text(damaged)
    assert run_eval(_args(tmp_path, "--resume", out="r"), _fake_factory([]), policy_of=lambda m: m) == 2
    assert "line 2" in capsys.readouterr().err and rows_path.read_text() == damaged
    rows_path.write_text("\n".join(lines) + "\n")
    (tmp_path / "r" / "run.json").write_text('{"identity": {"data"')
    assert run_eval(_args(tmp_path, "--resume", out="r"), _fake_factory([]), policy_of=lambda m: m) == 2
    assert "damaged run.json" in capsys.readouterr().err


def test_bad_inputs_fail_with_named_item(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"ctxs": [{"title": "", "text": "t"}], "question": "q", "answers": ["a"]},
                               {"documents": ["t"], "question": "q", "answers": "a"}]))
    assert run_eval(_args(tmp_path, data=str(bad)), _fake_factory([]), policy_of=lambda m: m) == 2
    assert "item 1: field 'answers' must be a list of strings" in capsys.readouterr().err
    assert run_eval(_args(tmp_path, methods="full,blend@2"), _fake_factory([]), policy_of=lambda m: m) == 2
    assert "ratio must be in [0, 1]" in capsys.readouterr().err
    assert not (tmp_path / "out" / "results.json").exists()


# ---- the real engine on the tiny model -----------------------------------------------------

TINY_DATA = [
    {"ctxs": [{"title": "Mara Quill", "text": "Mara Quill works at the Tessel Observatory. She walks each morning."},
              {"title": "", "text": "The Tessel Observatory is located in Varnholm, by the river."},
              {"title": "Oren Marsh", "text": "Oren Marsh lives in Quenby and keeps bees in the garden."}],
     "question": "In which city does Mara Quill work?", "answers": ["Varnholm"]},
    {"ctxs": [{"title": "The red locker", "text": "The access code for the red locker is 4412."},
              {"title": "", "text": "The blue safe has code 9981 and stands by the door."},
              {"title": "Weather", "text": "Rain fell for most of the week over the hills."}],
     "question": "What is the access code for the red locker?", "answers": ["4412"]},
    {"ctxs": [{"title": "Elsa Harrow", "text": "Elsa Harrow lives in Belmark."},
              {"title": "Tobin Ferro", "text": "Tobin Ferro lives in Caldria and plays chess."},
              {"title": "", "text": "Buses run every twenty minutes during the day."}],
     "question": "Where does Tobin Ferro live?", "answers": ["Caldria"]},
]


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    pytest.importorskip("blend.engine", reason="blend.engine not importable yet")
    pytest.importorskip("blend.policy", reason="blend.policy not importable yet")
    base = tmp_path_factory.mktemp("tiny")
    data = base / "data.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in TINY_DATA) + "\n")
    outs = []
    for name in ("a", "b"):
        argv = ["--data", str(data), "--limit", "3", "--passages", "3", "--model", "tiny-llama",
                "--methods", "full,prefix,reuse,blend@1.0,blend@0.3:v", "--out", str(base / name),
                "--max-new-tokens", "4", "--repeats", "1", "--no-progress", "--bootstrap", "100"]
        assert run_eval(configure_parser(argparse.ArgumentParser()).parse_args(argv)) == 0
        outs.append(base / name)
    return outs


def test_tiny_engine_end_to_end(tiny_runs):
    out = tiny_runs[0]
    for f in ("results.json", "results.md", "pareto.png", "answer_survival.png"):
        assert (out / f).stat().st_size > 0
    res = json.loads((out / "results.json").read_text())
    validate_results(res)
    assert res["model"]["name"] == "tiny-llama" and res["model"]["provenance"]["dtype"] == "float32"
    full = res["methods"]["full"]
    assert (full["agreement"], full["top1"], full["tf_agreement"], full["n"]) == (1.0, 1.0, 1.0, 3)
    assert full["kl"] == 0.0 and full["computed_frac"] == 1.0
    b1 = res["methods"]["blend@1.0"]
    assert (b1["agreement"], b1["top1"], b1["tf_agreement"]) == (1.0, 1.0, 1.0)
    assert b1["kl"] < 1e-4
    assert res["methods"]["reuse"]["recomputed_frac"] == 0.0
    # each row records the path its request ran (the report's applied): full is the one-pass exact mode, reuse and blends blend
    applied = {name: {it["methods"][name]["applied"] for it in res["items"]} for name in res["methods"]}
    assert applied["full"] == {"exact"} and applied["reuse"] == {"blend"}
    for it in res["items"]:  # a guard ratio at or below the blend's own recomputes exactly (the tiny model's ties)
        row = it["methods"]["blend@0.3:v"]
        assert row["applied"] == ("exact" if row["guarded"] else "blend")


def test_a_users_own_questions_without_gold_answers_are_measured_against_full_prefill(tmp_path):
    data = tmp_path / "mine.jsonl"
    data.write_text("\n".join(json.dumps({"question": r["question"], "documents": [c["text"] for c in r["ctxs"]]})
                              for r in TINY_DATA) + "\n")
    argv = ["--data", str(data), "--limit", "3", "--passages", "3", "--model", "tiny-llama", "--methods",
            "full,blend@0.3:v", "--out", str(tmp_path / "o"), "--max-new-tokens", "3", "--repeats", "1",
            "--no-progress", "--bootstrap", "50"]
    assert run_eval(configure_parser(argparse.ArgumentParser()).parse_args(argv)) == 0
    res = json.loads((tmp_path / "o" / "results.json").read_text())
    validate_results(res)
    blend = res["methods"]["blend@0.3:v"]
    assert blend["f1"] is None and blend["em"] is None and blend["contains"] is None  # no gold answers
    assert blend["kl"] is not None and blend["kl"] >= 0 and blend["top1"] is not None and blend["n"] == 3
    assert "blend@0.3:v" in (tmp_path / "o" / "results.md").read_text()


def test_tiny_engine_reproducible_except_timings(tiny_runs):
    a, b = (json.loads((o / "results.json").read_text()) for o in tiny_runs)
    a["config"].pop("out", None), b["config"].pop("out", None)
    assert _strip_timings(a) == _strip_timings(b)


def test_add_eval_command_defaults():
    from blend.evals.cli import add_eval_command

    parser = argparse.ArgumentParser(prog="kvblend")
    add_eval_command(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["eval", "--data", "synthetic:two-hop", "--out", "o"])
    assert args.func is run_eval
    assert (args.limit, args.passages, args.max_new_tokens, args.resume) == (30, 5, 32, False)
    assert [m.name for m in parse_methods(args.methods)] == [
        "full", "prefix", "reuse", "blend@0.05:probe", "blend@0.15:probe", "blend@0.3:probe", "blend@0.15:combo",
        "blend@0.15:v"]
    with pytest.raises(SystemExit):
        parser.parse_args(["eval", "--data", "x", "--out", "o", "--limit", "0"])


def test_resume_adds_methods_to_items_already_done(tmp_path):
    first = "full,reuse,blend@0.5:v"
    assert run_eval(_args(tmp_path, out="r", methods=first), _fake_factory([]), policy_of=lambda m: m) == 0
    engines = []
    assert run_eval(_args(tmp_path, "--resume", out="r"), _fake_factory(engines), policy_of=lambda m: m) == 0
    generated = {c[2] for c in engines[0].calls if c[0] == "generate"}
    assert generated == {"full", "blend@1.0", "blend@0.2:k"}  # the new methods, beside a timed full
    assert run_eval(_args(tmp_path, out="fresh"), _fake_factory([]), policy_of=lambda m: m) == 0
    extended = json.loads((tmp_path / "r" / "results.json").read_text())
    fresh = json.loads((tmp_path / "fresh" / "results.json").read_text())
    assert set(extended["methods"]) == set(fresh["methods"])
    strip = lambda r: {k: v for k, v in _strip_timings(r).items() if k != "config"}  # noqa: E731
    assert strip(extended)["methods"] == strip(fresh)["methods"]
    assert strip(extended)["items"] == strip(fresh)["items"]
    # nothing left to add: a further resume runs nothing
    engines = []
    assert run_eval(_args(tmp_path, "--resume", out="r"), _fake_factory(engines), policy_of=lambda m: m) == 0
    assert not [c for c in engines[0].calls if c[0] == "generate"]
    # the progress bar of an extending run counts each item once
    from blend.progress import Progress

    bar = Progress(total=3, stream=None)
    cfg = config_from_args(_args(tmp_path, out="r", methods=METHODS + ",blend@0.7:v"))
    run_harness(_fake_factory([])(cfg), load_items("synthetic:single", 3, 3), parse_methods(",".join(cfg.methods)),
                cfg, tmp_path / "r", resume=True, progress=bar, policy_of=lambda m: m)
    assert (bar.done, bar.total) == (3, 3)  # items extended count once, not on top of the done ones


# How long each answer stays full prefill's (evals/answer_survival.py), on the tiny model's run

def test_a_tiny_model_run_shows_the_table_and_draws_the_curve(tiny_runs):
    out = tiny_runs[0]
    res = json.loads((out / "results.json").read_text())
    for r in res["items"]:  # a ratio-1.0 blend answers full's answer to its end
        b, f = r["methods"]["blend@1.0"], r["methods"]["full"]
        assert b["same_tokens"] == b["answer_tokens"] == f["answer_tokens"] == f["same_tokens"]
        assert 0 <= r["methods"]["reuse"]["same_tokens"] <= r["methods"]["reuse"]["answer_tokens"]
    assert S.survival([ItemRow.from_json(r) for r in res["items"]], "blend@1.0").whole == 1.0
    md = markdown(res)
    assert "## How long the answer stays full prefill's" in md and "| `blend@1.0` | 3 | 1.000" in md
    assert (out / "answer_survival.png").read_bytes()[:4] == b"\x89PNG"


def test_the_validator_checks_same_tokens_where_present(tiny_runs):
    res = json.loads((tiny_runs[0] / "results.json").read_text())
    validate_results(res)
    for bad in (-1, 1.5, True, "3"):
        broken = copy.deepcopy(res)
        broken["items"][0]["methods"]["reuse"]["same_tokens"] = bad
        with pytest.raises(SchemaError, match="same_tokens"):
            validate_results(broken)
    old = copy.deepcopy(res)
    for r in old["items"]:
        for m in r["methods"].values():
            del m["same_tokens"]
    validate_results(old)  # runs from before the field stay valid, and results.md leaves the section out
    assert "How long the answer stays" not in markdown(old)


def test_links_planted_in_out_are_replaced_never_written_through_and_a_fifo_is_refused(tmp_path):
    """rows.jsonl, results.md and the plots were written through symbolic links in --out (truncating and
    filling the files they pointed at), and --resume read a FIFO at rows.jsonl, blocking for ever."""
    import os
    import threading

    out = tmp_path / "out"
    out.mkdir()
    victims = {name: tmp_path / f"victim-{name}" for name in ("rows.jsonl", "results.md", "pareto.png")}
    for name, victim in victims.items():
        victim.write_text("precious\n")
        (out / name).symlink_to(victim)
    assert run_eval(_args(tmp_path), _fake_factory([]), policy_of=lambda m: m) == 0
    for name, victim in victims.items():
        assert victim.read_text() == "precious\n", name  # untouched
        assert not (out / name).is_symlink() and (out / name).stat().st_size > 0  # replaced by the real output

    fifo_out = tmp_path / "fifo"
    fifo_out.mkdir()
    (fifo_out / "run.json").write_text((out / "run.json").read_text())
    os.mkfifo(fifo_out / "rows.jsonl")
    result: list = []
    t = threading.Thread(target=lambda: result.append(
        run_eval(_args(tmp_path, "--resume", out="fifo"), _fake_factory([]), policy_of=lambda m: m)), daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive() and result and result[0] != 0  # refused at once


def test_a_second_run_into_a_folder_with_rows_is_refused_unless_it_resumes(tmp_path, capsys):
    """A rerun without --resume (after an interrupt, say) emptied rows.jsonl silently and recomputed everything."""
    assert run_eval(_args(tmp_path), _fake_factory([]), policy_of=lambda m: m) == 0
    rows = (tmp_path / "out" / "rows.jsonl").read_text()
    assert rows
    assert run_eval(_args(tmp_path), _fake_factory([]), policy_of=lambda m: m) == 2
    assert "--resume continues it" in capsys.readouterr().err
    assert (tmp_path / "out" / "rows.jsonl").read_text() == rows  # untouched
    assert run_eval(_args(tmp_path, "--resume"), _fake_factory([]), policy_of=lambda m: m) == 0
