"""``kvblend chat`` and Ctrl-C: a first Ctrl-C during an answer stops that answer and the prompt comes back
with the conversation intact; Ctrl-C at the prompt ends the chat with status 0.

Ctrl-C is a real SIGINT sent to this process from inside the token stream (``TokenStream.step``), so the
chat's own handler sees it exactly where a user's would land. Before the fix a Ctrl-C raised
KeyboardInterrupt out of the chat: ``_no_interrupt`` turns that into a test failure instead of letting it
stop pytest.
"""

from __future__ import annotations

import io
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest

import blend.chat_cli
import blend.generation
from _chat_util import QUESTIONS, Terminal, answers_of, reference_answer
from blend.chat_cli import run_chat
from blend.cli import build_parser
from blend.options import engine_from_args
from blend.prompt import Role, Turn
from conftest import write_docs


@pytest.fixture
def chat_args(tmp_path):
    docs = [a for path in write_docs(tmp_path, 2, words=25, seed=3) for a in ("--doc", path)]
    return build_parser("chat").parse_args(["chat", *docs, "--model", "tiny-llama", "--store", "memory",
                                            "--max-new-tokens", "24"])


@pytest.fixture
def ctrl_c_at(monkeypatch):
    """``ctrl_c_at(answer, step, times)``: send SIGINT ``times`` times when the ``answer``-th answer (from 1)
    samples its ``step``-th token (from 1; 1 is the token the prefill's logits choose)."""
    answers, steps = [0], [0]
    real_init, real_step = blend.generation.Generation.__init__, blend.generation.TokenStream.step

    def arm(answer: int, step: int, times: int = 1) -> None:
        def init(self, *a, **kw):
            answers[0] += 1
            steps[0] = 0
            real_init(self, *a, **kw)

        def stepped(self, logits):
            steps[0] += 1
            if answers[0] == answer and steps[0] == step:
                for _ in range(times):
                    os.kill(os.getpid(), signal.SIGINT)
            return real_step(self, logits)

        monkeypatch.setattr(blend.generation.Generation, "__init__", init)
        monkeypatch.setattr(blend.generation.TokenStream, "step", stepped)

    return arm


@contextmanager
def _no_interrupt():
    try:
        yield
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C ended the chat (KeyboardInterrupt out of run_chat)")


def test_ctrl_c_stops_one_answer_and_the_conversation_keeps_what_was_printed(chat_args, ctrl_c_at):
    """Ctrl-C during an answer ended the whole chat (exit 130, the answer's line left open)."""
    whole = io.StringIO()
    assert run_chat(chat_args, Terminal(QUESTIONS[0] + "\n"), whole) == 0
    full_first = answers_of(whole.getvalue())[0]

    ctrl_c_at(answer=1, step=8)
    out = io.StringIO()
    with _no_interrupt():
        rc = run_chat(chat_args, Terminal("".join(q + "\n" for q in QUESTIONS)), out, io.StringIO())
    text = out.getvalue()
    assert rc == 0 and text.endswith("> \n")  # the two follow-ups answered, then end of input at the prompt
    first, second, third = answers_of(text)
    assert first and full_first.startswith(first) and len(first) < len(full_first)  # cut where it was
    assert "(interrupted: the answer so far stays in the conversation)" in text
    summaries = [ln for ln in text.splitlines() if ln.startswith("[ttft ")]
    assert [s.split(" | ")[2] for s in summaries] == ["earlier turns loaded 0 of 1", "earlier turns loaded 2 of 2"]
    # the history holds the printed text as the answer, and the follow-ups' prompts and KV are exactly that
    # history's: a fresh engine given it answers them the same (no KV of the stopped decode survives)
    kept = [Turn(Role.USER, QUESTIONS[0]), Turn(Role.ASSISTANT, first.strip())]
    assert second.strip() == reference_answer(chat_args, QUESTIONS[1], kept)
    kept += [Turn(Role.USER, QUESTIONS[1]), Turn(Role.ASSISTANT, second.strip())]
    assert third.strip() == reference_answer(chat_args, QUESTIONS[2], kept)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Python's own handler is back


def test_ctrl_c_before_any_text_drops_the_question(chat_args, ctrl_c_at):
    ctrl_c_at(answer=1, step=1)  # during the prefill, before the first piece of text
    out = io.StringIO()
    with _no_interrupt():
        assert run_chat(chat_args, Terminal(QUESTIONS[0] + "\n" + QUESTIONS[1] + "\n"), out, io.StringIO()) == 0
    text = out.getvalue()
    assert text.startswith("> (interrupted before the answer began: the question is not kept)\n> answer: ")
    assert len(answers_of(text)) == 1 and "earlier turns loaded 0 of 0" in text  # as if never asked
    assert answers_of(text)[0].strip() == reference_answer(chat_args, QUESTIONS[1], [])


def test_a_second_ctrl_c_before_the_answer_stopped_ends_the_chat_and_leaves_the_store_sound(
        tmp_path, chat_args, ctrl_c_at, capsys, monkeypatch):
    """The way out of a long prefill. Whatever the second Ctrl-C interrupts, every stored entry is whole."""
    from blend.cli import main

    store = f"disk:{tmp_path / 'kv'}"
    chat_args.store = store
    ctrl_c_at(answer=1, step=4, times=2)
    out = io.StringIO()
    engines = []
    monkeypatch.setattr(blend.chat_cli, "engine_from_args", lambda a: engines.append(engine_from_args(a)) or engines[-1])
    with pytest.raises(KeyboardInterrupt):  # main prints "kvblend: interrupted" and exits 130
        run_chat(chat_args, Terminal(QUESTIONS[0] + "\n"), out, io.StringIO())
    assert out.getvalue().startswith("> answer: ") and out.getvalue().endswith("\n")  # its line ended
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    engines[0].segments.store.close()  # as at exit: the queued writes finish
    capsys.readouterr()
    assert main(["store", "verify", "--store", store]) == 0
    assert "checked 3 entries, found 0 corrupt" in capsys.readouterr().out  # preamble and both documents


def test_ctrl_c_at_the_prompt_ends_the_chat_with_status_0(chat_args):
    class CtrlCAtSecondPrompt(Terminal):
        reads = 0

        def readline(self, *a):
            self.reads += 1
            if self.reads == 2:
                raise KeyboardInterrupt
            return super().readline(*a)

    out = io.StringIO()
    with _no_interrupt():
        assert run_chat(chat_args, CtrlCAtSecondPrompt(QUESTIONS[0] + "\nnever read\n"), out, io.StringIO()) == 0
    assert out.getvalue().endswith("]\n> \n") and len(answers_of(out.getvalue())) == 1


def test_a_piped_chat_is_ended_by_ctrl_c_with_its_answer_line_ended(chat_args, ctrl_c_at):
    """Piped questions: Ctrl-C ends the chat as it ends any command (else `chat < questions` could only be
    stopped one answer at a time). Its answer's line was left open: 'kvblend: interrupted' followed the text."""
    ctrl_c_at(answer=1, step=8)
    out = io.StringIO()
    with pytest.raises(KeyboardInterrupt):
        run_chat(chat_args, io.StringIO("".join(q + "\n" for q in QUESTIONS)), out, io.StringIO())
    assert out.getvalue().startswith("answer: ") and out.getvalue().endswith("\n")
    assert len(answers_of(out.getvalue())) == 1


class _Reader:
    """A child's stdout, read as it comes."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.data = proc, b""

    def until(self, pattern: bytes, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.data, re.DOTALL):
            left = deadline - time.monotonic()
            assert left > 0, f"no {pattern!r} in {self.data[-400:]!r}"
            ready, _, _ = select.select([self.proc.stdout], [], [], min(left, 0.5))
            chunk = os.read(self.proc.stdout.fileno(), 65536) if ready else b""
            assert chunk or self.proc.poll() is None, f"exited {self.proc.returncode} before {pattern!r}"
            self.data += chunk


def test_kvblend_chat_at_a_terminal_ctrl_c_stops_one_answer_then_the_chat_goes_on(tmp_path):
    """End to end: questions typed on a terminal (a pty), SIGINT while the first answer is printed, a second
    question, then Ctrl-D. Before the fix the SIGINT ended the chat: 'kvblend: interrupted', exit 130."""
    doc = write_docs(tmp_path, 1, words=25, seed=3)[0]
    env = dict(os.environ, KVBLEND_HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1")
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "blend.cli", "chat", "--doc", doc, "--model", "tiny-llama",
                             "--store", "memory", "--max-new-tokens", "400", "--multiline"],
                            stdin=slave, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    os.close(slave)
    try:
        out = _Reader(proc)
        os.write(master, QUESTIONS[0].encode() + b"\n")
        out.until(rb"answer: .{8}")  # the answer is being printed (400 tokens take over a second)
        proc.send_signal(signal.SIGINT)
        out.until(rb"\(interrupted[^\n]*\n> $")
        os.write(master, QUESTIONS[1].encode() + b"\n")
        out.until(rb"\[ttft [^\n]*\]\n> $")
        os.write(master, b"\x04")  # Ctrl-D at the prompt
        rest, err = proc.communicate(timeout=60)
        out.data += rest
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = out.data.decode()
    assert proc.returncode == 0, err.decode()[-2000:]
    assert "Traceback" not in err.decode() and "kvblend:" not in err.decode()
    m = re.fullmatch(r"> answer: (.+)\n\(interrupted: the answer so far stays in the conversation\)\n"
                     r"> answer: (.*)\n\[ttft [^\n]* \| earlier turns loaded 0 of 1 \| exact\]\n> \n", text, re.DOTALL)
    assert m, text[-600:]
