"""`kvblend ask`: sampling options, and the answer printed as it is decoded."""

import io
import json

import pytest

from _serve_util import one_torch_thread  # noqa: F401 - module fixture
from blend.cli import main
from blend.generation_cli import stream_answer
from blend.policy import ReusePolicy
from blend.sampling import GenerationConfig
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
