"""`kvblend ask`: sampling options, and the answer printed as it is decoded."""

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _sampling_surfaces import surfaces
from _serve_util import one_torch_thread  # noqa: F401 - module fixture
from blend.cli import main
from blend.defaults import (
    DEFAULT_MAX_NEW_TOKENS, DEFAULT_PENALTY, DEFAULT_SAMPLING_TOP_K, DEFAULT_SERVE_TEMPERATURE, DEFAULT_TEMPERATURE,
    DEFAULT_TOP_P,
)
from blend.generation_cli import stream_answer
from blend.policy import ReusePolicy
from blend.sampling import GenerationConfig
from blend.serve.schemas import ChatCompletionRequest, CompletionRequest
from conftest import make_docs, write_docs

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Recorder(io.StringIO):
    """Remembers every write (a stream shows up as many writes before the end)."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, s: str) -> int:
        self.writes.append(s)
        return super().write(s)


@pytest.fixture
def doc_files(tmp_path):
    return write_docs(tmp_path, 2, words=20, seed=3)


def ask_json(capsys, doc_files, *extra) -> dict:
    args = ["ask", "Which word?", "--model", "tiny-llama", "--store", "memory", "--json", "--max-new-tokens", "12"]
    for d in doc_files:
        args += ["--doc", d]
    assert main([*args, *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_ask_json_defaults_are_the_engines_greedy_single_line_answer(capsys, doc_files, tiny_engine):
    out = ask_json(capsys, doc_files)
    docs = [open(p).read() for p in doc_files]
    ref = tiny_engine.generate(tiny_engine.build_prompt("Which word?", docs), max_new_tokens=12)
    assert out["answer_token_ids"] == ref.token_ids and out["answer"] == ref.text
    assert out["logits_sha256"] == ref.logits_sha256()


def test_ask_sampling_options(capsys, doc_files):
    greedy = ask_json(capsys, doc_files, "--multiline")
    a = ask_json(capsys, doc_files, "--multiline", "--temperature", "1.0", "--seed", "5")
    b = ask_json(capsys, doc_files, "--multiline", "--temperature", "1.0", "--seed", "5")
    c = ask_json(capsys, doc_files, "--multiline", "--temperature", "1.0", "--seed", "6")
    assert a["answer_token_ids"] == b["answer_token_ids"] != c["answer_token_ids"]
    assert a["logits_sha256"] == greedy["logits_sha256"]  # sampling does not touch the prompt's logits
    assert main(["ask", "q", "--doc", doc_files[0], "--model", "tiny-llama", "--store", "memory",
                 "--temperature", "3"]) == 2
    assert "temperature" in capsys.readouterr().err


def test_the_answer_is_printed_as_it_is_decoded(tiny_engine):
    prompt = tiny_engine.build_prompt("Which word?", make_docs(2))
    out = Recorder()
    done = stream_answer(tiny_engine, prompt, ReusePolicy.exact(),
                         GenerationConfig(max_tokens=16, temperature=0.9, seed=2), out)
    assert out.getvalue() == f"answer: {done.text.lstrip()}\n"
    assert len([w for w in out.writes if w]) >= 4  # piece by piece, not once at the end


# the sampling settings every surface fills in where nothing is asked (max_tokens and stop_at_newline differ by
# design: the server's own budget, and the command line's single-line answers)
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "stop", "ignore_eos", "logprobs", "presence_penalty",
                   "frequency_penalty", "logit_bias")


def test_the_sampling_defaults_of_the_cli_the_server_and_the_python_api_agree(tiny_engine):
    """Greedy, no top-p or top-k cut, no penalties, no seed, no stop string on every surface; the server's
    temperature alone is OpenAI's 1.0 where a request names none (blend.defaults says why)."""
    got = surfaces(tiny_engine)
    api = got["api"]
    assert (api.temperature, api.top_p, api.top_k, api.presence_penalty, api.frequency_penalty) == (
        DEFAULT_TEMPERATURE, DEFAULT_TOP_P, DEFAULT_SAMPLING_TOP_K, DEFAULT_PENALTY, DEFAULT_PENALTY)
    for name in SAMPLING_FIELDS:
        want = getattr(api, name)
        assert getattr(got["ask"], name) == getattr(got["chat"], name) == want, name
        assert getattr(got["server"], name) == (DEFAULT_SERVE_TEMPERATURE if name == "temperature" else want), name
    assert got["ask"].max_tokens == got["chat"].max_tokens == api.max_tokens == DEFAULT_MAX_NEW_TOKENS
    for schema in (ChatCompletionRequest, CompletionRequest):  # the server's schema: null, i.e. the defaults above
        for name in ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty"):
            assert schema.model_fields[name].default is None, (schema.__name__, name)


def test_every_surface_reads_its_sampling_defaults_from_blend_defaults(tmp_path):
    """Change the defaults in blend.defaults (before anything reads them) and every surface follows: the CLI's
    --temperature 0.0 and --top-p 1.0 were literals of their own, free to drift from the API's and the server's."""
    code = (
        "import blend.defaults as D\n"
        "D.DEFAULT_TEMPERATURE, D.DEFAULT_SERVE_TEMPERATURE, D.DEFAULT_TOP_P = 0.5, 0.75, 0.9\n"
        "D.DEFAULT_SAMPLING_TOP_K, D.DEFAULT_PENALTY = 7, 0.25\n"
        "from blend.engine import Engine\n"
        "from _sampling_surfaces import surfaces\n"
        "for name, c in surfaces(Engine.load('tiny-llama', quality_gate=False)).items():\n"
        "    print(name, c.temperature, c.top_p, c.top_k, c.presence_penalty, c.frequency_penalty)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = dict(line.split(" ", 1) for line in out.stdout.strip().splitlines())
    assert rows == {"api": "0.5 0.9 7 0.25 0.25", "ask": "0.5 0.9 7 0.25 0.25", "chat": "0.5 0.9 7 0.25 0.25",
                    "server": "0.75 0.9 7 0.25 0.25"}


def test_an_interrupted_answer_ends_its_line_before_the_interrupt_is_reported():
    """Ctrl-C during `kvblend ask` left the answer's line open: 'answer: some textkvblend: interrupted'."""
    from blend.generation_cli import print_stream

    def pieces():
        yield " some"
        yield " text"
        raise KeyboardInterrupt

    out = io.StringIO()
    with pytest.raises(KeyboardInterrupt):
        print_stream(pieces(), out)
    assert out.getvalue() == "answer: some text\n"


def test_a_stop_request_ends_the_printed_answer_where_it_is_and_says_what_was_shown():
    from blend.generation_cli import print_stream

    asked = iter([False, False, False, True])
    out = io.StringIO()
    assert print_stream(iter([" a", "b", "c", "d"]), out, stop=lambda: next(asked)) == "ab"
    assert out.getvalue() == "answer: ab\n"
    assert print_stream(iter(["x"]), io.StringIO(), stop=lambda: True) == ""  # stopped before any text: nothing
