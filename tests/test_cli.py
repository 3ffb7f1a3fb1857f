"""The kvblend CLI: JSON contract, user errors, and cold equals warm across processes."""

import json
import os
import io
import subprocess
import sys

import pytest

from blend.cli import print_report
from blend.policy import ReusePolicy
from conftest import make_docs, unguarded_blend

ENV_KEYS = ("KVBLEND_HOME", "PATH", "HOME", "KVBLEND_TEST_REDIS", "TRITON_INTERPRET")


def kvblend(*args, home, check=True):
    env = {k: os.environ[k] for k in ENV_KEYS if k in os.environ}
    env["KVBLEND_HOME"] = str(home)
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, "-m", "blend.cli", *args], capture_output=True, text=True,
                          env=env, timeout=300)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture
def docs(tmp_path):
    paths = []
    for i, text in enumerate(make_docs(3, words=25)):
        p = tmp_path / f"doc{i}.txt"
        p.write_text(text)
        paths.append(str(p))
    return paths


def ask_args(docs, *extra):
    args = ["ask", "Which word?", "--model", "tiny-llama", "--json", "--max-new-tokens", "4"]
    for d in docs:
        args += ["--doc", d]
    return [*args, *extra]


def test_ask_json_contract(docs, tmp_path):
    out = json.loads(kvblend(*ask_args(docs, "--store", "memory"), home=tmp_path).stdout)
    for field in ("answer", "answer_token_ids", "prompt_token_ids", "ttft_s", "logits_sha256", "report"):
        assert field in out
    assert len(out["logits_sha256"]) == 64
    segs = out["report"]["segments"]
    assert [s["class"] for s in segs] == ["computed"] * 5
    assert all({"class", "tokens", "key"} <= set(s) for s in segs)
    assert sum(s["tokens"] for s in segs) == len(out["prompt_token_ids"])
    assert out["report"]["reused_tokens"] == 0 and out["report"]["recomputed_tokens"] == 0


@pytest.mark.parametrize("reuse", ["exact", "blend"])
def test_cold_equals_warm_across_processes_on_disk(docs, tmp_path, reuse):
    store = f"disk:{tmp_path / 'store'}"
    extra = ["--store", store, "--reuse", reuse, "--force-blend"]
    a = json.loads(kvblend(*ask_args(docs, *extra), home=tmp_path).stdout)
    b = json.loads(kvblend(*ask_args(docs, *extra), home=tmp_path).stdout)
    assert a["logits_sha256"] == b["logits_sha256"]
    assert a["answer_token_ids"] == b["answer_token_ids"]
    hits = [s["class"] for s in b["report"]["segments"][:-1]]
    assert hits == (["exact"] * 4 if reuse == "exact" else ["exact", "exact", "blended", "blended"])
    assert "computed" in [s["class"] for s in a["report"]["segments"][:-1]]


def test_cold_equals_warm_across_processes_in_redis(docs, tmp_path, redis_url):
    extra = ["--store", redis_url + "?prefix=clitest" + os.urandom(4).hex(), "--reuse", "exact"]
    a = json.loads(kvblend(*ask_args(docs, *extra), home=tmp_path).stdout)
    b = json.loads(kvblend(*ask_args(docs, *extra), home=tmp_path).stdout)
    assert a["logits_sha256"] == b["logits_sha256"]
    assert [s["class"] for s in b["report"]["segments"][:-1]] == ["exact"] * 4


@pytest.mark.parametrize("args, message", [
    (["ask", "q", "--doc", "/no/such/file", "--model", "tiny-llama"], "no such file"),
    (["ask", "  ", "--doc", "{doc}", "--model", "tiny-llama"], "question is empty"),
    (["ask", "q", "--doc", "{doc}", "--model", "no-such-model"], "unknown model"),
    (["ask", "q", "--doc", "{bad}", "--model", "tiny-llama"], "not UTF-8"),
    (["ask", "q", "--doc", "{long}", "--model", "tiny-llama"], "exceeds the model's context"),
    (["ask", "q", "--doc", "{doc}", "--model", "tiny-llama", "--reuse", "blend", "--ratio", "2"], "ratio"),
    (["ask", "q", "--doc", "{dir}", "--model", "tiny-llama"], "is a directory"),
    (["ask", "q", "--doc", "{huge}", "--model", "tiny-llama"], "over 16 MiB"),  # read whole: a 3 GB one OOMed
    (["ask", "q", "--doc", "{doc}", "--model", "tiny-llama", "--ratio", "0.3"],  # was run exact, silently
     "--ratio only applies with --reuse blend (got --reuse exact)"),
    (["ask", "q", "--doc", "{doc}", "--model", "tiny-llama", "--reuse", "none", "--guard-margin", "off"],
     "--guard-margin only applies with --reuse blend"),
    # a budget setting the blend's budget never reads: refused (--budget auto --ratio 0.3 capped at 0.5, silently)
    (["ask", "q", "--doc", "{doc}", "--model", "tiny-llama", "--reuse", "blend", "--budget", "auto", "--ratio", "0.3"],
     "set --max-ratio=0.3 instead"),
    (["ask", "q", "--doc", "{doc}", "--model", "tiny-llama", "--reuse", "blend", "--max-ratio", "0.3"],
     "--max-ratio caps an adaptive budget or a threshold"),
    # the guard's settings with the guard off, the probe's beside a selector without it: refused, not ignored
    (["ask", "q", "--doc", "{doc}", "--model", "tiny-llama", "--reuse", "blend", "--guard-margin", "off",
      "--guard-ratio", "0.5"], "--guard-ratio is a setting of the near-tie guard, which is off (--guard-margin off)"),
    (["ask", "q", "--doc", "{doc}", "--model", "tiny-llama", "--reuse", "blend", "--guard-margin", "off",
      "--guard-mode", "widen"], "--guard-mode is a setting of the near-tie guard"),
    (["ask", "q", "--doc", "{doc}", "--model", "tiny-llama", "--reuse", "blend", "--selector", "v",
      "--candidates", "off"], "--candidates is a setting of the query probe, which --selector 'v' never runs"),
    (["ask", "q", "--doc", "{doc}", "--model", "tiny-llama", "--reuse", "blend", "--selector", "v",
      "--probe-precision", "bf16"], "--probe-precision is a setting of the query probe"),
    (["ask", "q", "--doc", "{doc}", "--model", "tiny-llama", "--reuse", "blend", "--min-prompt-tokens", "-5"],
     "--min-prompt-tokens must be an integer >= 0"),  # the flag, not the policy's field (min_prompt_tokens)
    (["ask", "q", "--doc", "{doc}", "--model", "tiny-llama", "--max-new-tokens", "0"],
     "--max-new-tokens must be an integer >= 1"),  # was "max_tokens must be ..."
    (["check", "--model", "tiny-llama", "--items", "0"], "--items must be 1 to 6"),
    (["check", "--model", "tiny-llama", "--items", "-1"], "--items must be 1 to 6"),
    (["check", "--model", "tiny-llama", "--items", "7"], "--items must be 1 to 6"),
])
def test_user_errors_are_one_line_and_exit_2(tmp_path, docs, args, message):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe\x00abc")
    long = tmp_path / "long.txt"
    long.write_text("word " * 1000)
    huge = tmp_path / "huge.txt"
    with open(huge, "wb") as f:
        f.truncate(1 << 32)  # 4 GiB, sparse: refused by its size before any of it is read
    args = [a.format(doc=docs[0], bad=bad, long=long, dir=tmp_path, huge=huge) for a in args]
    proc = kvblend(*args, "--store", "memory", home=tmp_path, check=False)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_no_reuse_and_exact_reuse_agree_bit_for_bit_cold_and_warm(docs, tmp_path):
    """Turning the cache off never changes a bit: --reuse none runs the exact schedule without the store."""
    store = f"disk:{tmp_path / 'store'}"
    none = json.loads(kvblend(*ask_args(docs, "--reuse", "none", "--store", store), home=tmp_path).stdout)
    cold = json.loads(kvblend(*ask_args(docs, "--reuse", "exact", "--store", store), home=tmp_path).stdout)
    warm = json.loads(kvblend(*ask_args(docs, "--reuse", "exact", "--store", store), home=tmp_path).stdout)
    assert none["logits_sha256"] == cold["logits_sha256"] == warm["logits_sha256"]
    assert none["answer_token_ids"] == cold["answer_token_ids"] == warm["answer_token_ids"]
    assert [s["class"] for s in warm["report"]["segments"]][:-1] == ["exact"] * 4
    assert {s["class"] for s in none["report"]["segments"]} == {"computed"}


def test_the_printed_report_says_the_blend_ratio_its_gap_and_the_guard(tiny_engine):
    prompt = tiny_engine.build_prompt("Which word?", make_docs(3))
    plain, guarded, exact = io.StringIO(), io.StringIO(), io.StringIO()
    print_report(tiny_engine.generate(prompt, unguarded_blend(0.15), max_new_tokens=1), plain)
    reordered = tiny_engine.build_prompt("Which word?", make_docs(3)[::-1])  # blended, not an exact order
    ans = tiny_engine.generate(reordered, ReusePolicy.blend(0.15, guard_margin=1e9), max_new_tokens=1)
    print_report(ans, guarded)
    print_report(tiny_engine.generate(prompt, ReusePolicy.exact(), max_new_tokens=1), exact)
    assert "blend: recompute ratio 0.15   first-token gap: " in plain.getvalue()
    assert "near-tie guard" not in plain.getvalue() and "spent" not in plain.getvalue()
    text = guarded.getvalue()
    assert f"blend: recompute ratio 0.3 (spent {ans.report.spent:.3g} over both passes)" in text
    assert f"near-tie guard: {ans.report.guard}" in text and ans.report.guard
    assert "blend:" not in exact.getvalue() and "near-tie guard" not in exact.getvalue()


@pytest.mark.parametrize("extra, message", [
    (["--reuse", "blend", "--semantic"], "semantic reuse is experimental"),
    (["--reuse", "blend", "--check-layers", "99"], "--check-layers (99,) outside the model's"),
    (["--reuse", "exact", "--semantic"], "only applies with --reuse blend"),  # not dropped without a word
    (["--reuse", "none", "--semantic"], "only applies with --reuse blend"),
])
def test_a_request_refused_at_generation_prints_no_half_answer(docs, tmp_path, extra, message):
    """An error raised when generation starts is the only output: stdout holds no dangling 'answer: '."""
    proc = kvblend("ask", "q", "--doc", docs[0], "--model", "tiny-llama", "--store", "memory", *extra,
                   home=tmp_path, check=False)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_serve_with_a_port_out_of_range_is_a_usage_error(tmp_path):
    proc = kvblend("serve", "--model", "tiny-llama", "--store", "memory", "--port", "99999",
                   home=tmp_path, check=False)
    assert proc.returncode == 2 and "--port" in proc.stderr and "Traceback" not in proc.stderr


def test_store_prune_names_an_unreachable_disk_tier_and_exits_3(tmp_path):
    """prune, like ls/stats/clear, never reports a disk tier it could not read as pruned."""
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    proc = kvblend("store", "prune", "--max-bytes", "1G", "--store", f"disk:{not_a_dir}", home=tmp_path,
                   check=False)
    assert proc.returncode == 3 and "unreachable" in proc.stderr and "Traceback" not in proc.stderr
    ok = kvblend("store", "prune", "--max-bytes", "1G", "--store", f"disk:{tmp_path / 'kv'}", home=tmp_path)
    assert ok.returncode == 0


def test_check_shows_its_verdict_when_it_cannot_record_it(tmp_path):
    """The gate runs for minutes on a real model: a home it cannot write to lost the verdict (an error)."""
    blocked = tmp_path / "file"
    blocked.write_text("x")
    proc = kvblend("check", "--model", "tiny-llama", "--items", "1", home=blocked / "home", check=False)
    assert "could not record" in proc.stderr and "blend gate for tiny-llama" in proc.stdout
    assert proc.returncode in (0, 1) and "Traceback" not in proc.stderr


def test_a_reader_that_leaves_is_not_an_error(monkeypatch, capsys):
    """`kvblend store ls | head -1` printed "kvblend: error: [Errno 32] Broken pipe" and exited 2."""
    import argparse

    import blend.cli as C

    def leaves(args):
        raise BrokenPipeError(32, "Broken pipe")

    class Parser:
        def parse_args(self, argv):
            return argparse.Namespace(func=leaves)

    monkeypatch.setattr(C, "build_parser", lambda command: Parser())
    assert C.main(["store", "ls"]) == C.EXIT_BROKEN_PIPE == 141
    assert capsys.readouterr().err == ""


def test_setting_errors_name_the_flag_a_user_typed(capsys):
    """Settings check themselves in their own classes, whose messages name Python fields (max_tokens,
    target_tokens, share_decode_min_batch); the command line says the flag instead."""
    from blend.cli import build_parser
    from blend.cli_messages import flag_names, in_flag_words
    from blend.serve.cli import build_parser as serve_parser

    names = flag_names(build_parser(None))
    assert in_flag_words("top_p must be in [0, 1], got 2.0", names) == "--top-p must be in [0, 1], got 2.0"
    assert in_flag_words("overlap_tokens must be in [0, target_tokens)", names) == "--overlap must be in [0, --chunk-tokens)"
    assert in_flag_words("no index here; a store_command or plain words stay", names) == \
        "no index here; a store_command or plain words stay"  # only names a flag sets are rewritten
    for untouched in ("document /data/top_k.txt: no such file", "/tmp/max_tokens: no index here",
                      "unrecognized arguments: --max_tokens 5"):  # paths and what a user typed
        assert in_flag_words(untouched, names) == untouched
    assert in_flag_words("got top_p.", names) == "got --top-p."  # a sentence's full stop is not a file name
    serve = flag_names(serve_parser())
    assert in_flag_words("share_decode_min_batch must be >= 2", serve) == "--share-decode-min-batch must be >= 2"
    assert serve["max_tokens"] == "--max-tokens-limit"  # the server's flag for that field, not ask's
    with pytest.raises(SystemExit):
        from blend.serve.cli import main as serve_main

        serve_main(["--max-concurrency", "0"])
    assert "error: --max-concurrency and --prefill-workers must be >= 1" in capsys.readouterr().err


def test_usage_errors_are_one_line_and_settings_are_checked_before_any_work(capsys):
    """argparse printed its whole usage block (20-25 lines) before a bad flag's error; `demo --top-k 0`
    ingested the corpus and loaded the model before refusing; `serve --torch-threads 0` was read as the
    default."""
    from blend.cli import main
    from blend.serve.cli import main as serve_main

    for argv in (["ask", "q", "--doc", "x", "--guard-margin", "abc"], ["nosuch"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and "--help" in err
    assert main(["demo", "--top-k", "0"]) == 2
    assert capsys.readouterr().err.strip() == "kvblend: error: --top-k must be >= 1, got 0"
    with pytest.raises(SystemExit):
        serve_main(["--torch-threads", "0"])
    assert "--torch-threads and --idle-decode-threads must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["ask", "chat"])
def test_semantic_without_the_engine_flag_is_refused_before_the_model_loads(docs, monkeypatch, capsys, command):
    """`--reuse blend --semantic` without `--experimental-semantic` loaded the model (seconds; `chat` then
    refused every question it read) and printed the engine's words with the field rewritten into a flag:
    "enable it in the engine (EngineConfig(--experimental-semantic=True) or --experimental-semantic)"."""
    import blend.chat_cli as CC
    import blend.cli as C

    def no_load(args):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(C, "engine_from_args", no_load)
    monkeypatch.setattr(CC, "engine_from_args", no_load)
    argv = [command, *(["q"] if command == "ask" else []), "--doc", docs[0], "--model", "tiny-llama",
            "--store", "memory", "--reuse", "blend", "--semantic"]
    assert C.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--semantic needs --experimental-semantic" in err and "EngineConfig" not in err


@pytest.mark.parametrize("mode", ["exact", "none"])
def test_every_blend_option_the_cli_takes_is_refused_outside_a_blend(mode):
    """The CLI refuses blend settings under exact/none with the policy's own list (blend.policy_rules.BLEND_OPTIONS),
    as the server does: an option added to the policy cannot be silently dropped by the CLI; at their defaults,
    nothing is refused."""
    from blend.cli import build_parser
    from blend.errors import InvalidPolicyError
    from blend.options import policy_from_args
    from blend.policy_rules import BLEND_OPTIONS

    args = build_parser("ask").parse_args(["ask", "q", "--reuse", mode])
    assert policy_from_args(args).mode.value == mode  # every blend option at its CLI default: accepted
    taken = [name for name in BLEND_OPTIONS if name not in ("semantic", "seed") and hasattr(args, name)]  # --seed: sampling
    assert {"ratio", "selector", "guard_margin", "take_exact", "attention_precision"} <= set(taken)
    for name in taken:
        changed = build_parser("ask").parse_args(["ask", "q", "--reuse", mode])
        setattr(changed, name, object())  # a value equal to no default
        with pytest.raises(InvalidPolicyError, match=f"--{name.replace('_', '-')} only applies with --reuse blend"):
            policy_from_args(changed)


def _without_unbuffered_output() -> dict:
    """The environment of a ``kvblend`` process whose stdout is block-buffered, as a shell's is (this
    harness may set PYTHONUNBUFFERED, under which every print flushes at once)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env["OMP_NUM_THREADS"] = "1"
    return env


def test_a_reader_gone_before_the_last_flush_is_exit_141_without_a_traceback(tmp_path):
    """`kvblend ask --help | head -1` (or any command whose last lines are still buffered when its reader
    leaves): the flush at interpreter exit failed, Python printed "Exception ignored in: <_io.TextIOWrapper
    name='<stdout>'> BrokenPipeError" and the process exited 120."""
    read, write = os.pipe()
    os.close(read)  # the reader left before anything was written
    try:
        proc = subprocess.run([sys.executable, "-m", "blend.cli", "ask", "--help"], stdout=write,
                              stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=_without_unbuffered_output(),
                              timeout=120)
    finally:
        os.close(write)
    assert proc.returncode == 141 and proc.stderr == b""


def test_a_last_buffered_write_to_a_reader_that_left_is_exit_141(monkeypatch, capsys):
    """The same in process: a command that returned with its output still buffered reported 0, and the
    broken pipe surfaced only at exit."""
    import blend.cli as C

    class Gone(io.RawIOBase):
        left = True

        def writable(self) -> bool:
            return True

        def write(self, b) -> int:
            if self.left:
                raise BrokenPipeError(32, "Broken pipe")
            return len(b)

    raw = Gone()
    stdout = io.TextIOWrapper(io.BufferedWriter(raw), encoding="utf-8")
    monkeypatch.setattr(sys, "stdout", stdout)
    try:
        assert C.main(["store", "stats", "--store", "memory"]) == C.EXIT_BROKEN_PIPE
    finally:
        raw.left = False  # what is still buffered goes nowhere at garbage collection
        stdout.close()
    assert capsys.readouterr().err == ""


def test_an_answer_a_terminal_cannot_encode_is_printed_escaped(tmp_path, monkeypatch):
    """An answer (or a name) holding a character the output's encoding lacks (a Latin-1 terminal,
    PYTHONIOENCODING=ascii) ended `kvblend ask` half printed: "kvblend: error: 'ascii' codec can't encode
    characters", exit 2; `kvblend chat` lost its whole conversation the same way."""
    from blend.cli import main

    paths = []
    for i, text in enumerate(make_docs(2, words=20, seed=3)):
        (tmp_path / f"g{i}.txt").write_text(text)
        paths += ["--doc", str(tmp_path / f"g{i}.txt")]
    raw = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw, encoding="ascii", errors="strict"))
    rc = main(["ask", "Which word?", *paths, "--model", "tiny-llama", "--store", "memory", "--max-new-tokens", "12"])
    sys.stdout.flush()
    text = raw.getvalue().decode("ascii")
    assert rc == 0 and "\\ufffd" in text.splitlines()[0]  # this answer holds U+FFFD
    assert text.splitlines()[1].startswith("ttft: ")  # the report follows it


def test_a_command_started_with_standard_output_closed_discards_its_output(docs, monkeypatch, capsys):
    """`kvblend ask ... >&-` (Python's sys.stdout is None) died with AttributeError: 'NoneType' object has no
    attribute 'write' (a traceback) once the answer streamed; what is printed now goes nowhere, as print's
    output does, and the command's status is its own."""
    from blend.cli import main

    monkeypatch.setattr(sys, "stdout", None)
    assert main(["ask", "Which word?", "--doc", docs[0], "--model", "tiny-llama", "--store", "memory",
                 "--max-new-tokens", "2"]) == 0
    assert main(["store", "stats", "--store", "memory"]) == 0
    assert capsys.readouterr().err == ""


def test_ask_help_explains_its_own_arguments(capsys):
    """`kvblend ask --help` listed QUESTION, --top-k and --max-new-tokens with no word on what they do (a
    user could not tell --top-k, the retrieval depth, from top-k sampling)."""
    from blend.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser("ask").parse_args(["ask", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "question the question" in text
    assert "--top-k K with --index: how many chunks to retrieve" in text
    assert "--max-new-tokens N the longest answer, in tokens" in text


def test_ctrl_c_during_ask_over_an_index_says_interrupted_not_resume(tmp_path, monkeypatch, capsys):
    """`kvblend ask --index` shared ingest's guard, so its Ctrl-C said 'finished files are saved; re-run to
    resume': an ask saves nothing and has nothing to resume."""
    import blend.retrieval.pipeline
    from blend.cli import main

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(blend.retrieval.pipeline.RAG, "open", interrupted)
    assert main(["ask", "q", "--index", str(tmp_path), "--model", "tiny-llama"]) == 130
    assert capsys.readouterr().err == "kvblend: interrupted\n"
