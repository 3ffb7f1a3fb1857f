"""README.md against the code: what a new user copies from it must exist.

Every mechanical claim README makes is checked here: each ``--flag`` shown with a command is one that
command's parser takes (and a literal value shown with it is one the flag accepts), every other flag it
names is taken by some kvblend parser, the server's ``kvblend`` request options and its endpoints are the
ones the server has, each test it cites exists, and each ``KVBLEND_*`` variable it names is read somewhere.
A renamed flag or a removed field then fails here instead of misleading a reader.
"""

from __future__ import annotations

import argparse
import importlib
import re
from pathlib import Path
from typing import Callable, Iterator
from unittest import mock

import pytest

from blend import cli
from blend.policy import ReuseMode
from blend.serve import cli as serve_cli
from blend.serve.schemas import KvblendOptions
from blend.tiny import make_docs

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
# vLLM's own flags, shown in README's vLLM section: no kvblend parser takes them
VLLM_FLAGS = frozenset({"--kv-transfer-config", "--enforce-eager", "--middleware", "--distributed-executor-backend"})
# the eval and benchmark modules README runs with ``python -m blend.evals.NAME``
EVAL_MODULES = ("compare", "guard_curve", "bench_phases", "bench_prefill", "bench_serve", "sweep")
FLAG = re.compile(r"--[a-z][a-z0-9-]*")
METAVAR = re.compile(r"[A-Z][A-Z0-9_-]*(\.\.\.)?")  # FILE, SPEC, N, RUN_DIR...: a placeholder, not a value


class _Parsed(Exception):
    """Raised in place of parsing, carrying the parser a module's ``main`` built."""


def _parser_of(main: Callable) -> argparse.ArgumentParser:
    """The parser a module's ``main(argv)`` builds (caught at its ``parse_args``, before any work)."""

    def caught(self, *args, **kwargs):
        raise _Parsed(self)

    try:
        with mock.patch.object(argparse.ArgumentParser, "parse_args", caught):
            main([])
    except _Parsed as e:
        return e.args[0]
    raise AssertionError(f"{main.__module__}.main never parsed its arguments")


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next((a.choices for a in p._actions if isinstance(a, argparse._SubParsersAction)), {})


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """Every parser README shows, by the words that start its command line (``ask``, ``store verify``,
    ``blend.evals.compare``)."""
    out = {name: p for name, p in _subparsers(cli.build_parser()).items() if name != "serve"}
    out["serve"] = serve_cli.build_parser()  # `kvblend serve` hands its arguments to a parser of its own
    out.update({f"store {name}": p for name, p in _subparsers(out["store"]).items()})
    for module in EVAL_MODULES:
        out[f"blend.evals.{module}"] = _parser_of(importlib.import_module(f"blend.evals.{module}").main)
    return out


PARSERS = _parsers()


def _options(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {o: a for a in p._actions for o in a.option_strings}


def _strip_code_blocks(text: str) -> tuple[str, list[str]]:
    """README's prose (fenced blocks blanked out) and the lines of its fenced blocks that are not Python."""
    prose, code, lang = [], [], None
    for line in text.splitlines():
        fence = re.match(r"\s*```(\w*)", line)
        if fence:
            lang = None if lang is not None else fence.group(1)
            prose.append("")
            continue
        if lang is None:
            prose.append(line)
        else:
            prose.append("")
            if lang != "python":
                code.append(line)
    return "\n".join(prose), code


PROSE, CODE = _strip_code_blocks(README)


def _spans(text: str) -> list[str]:
    """Inline code spans (a span may run over a line break, as markdown allows)."""
    return [s.replace("\n", " ") for s in re.findall(r"`([^`]+)`", text)]


def _command(words: list[str]) -> tuple[list[str], int] | None:
    """The parsers a command line's first words name, and how many words they took (None: not kvblend's)."""
    i = 0
    if words[:3] == ["bash", "scripts/kvb", "run"]:
        i = 3
    elif words[:2] == ["bash", "scripts/kvb"] and words[2:3] == ["demo"]:
        return ["demo"], 3
    if words[i:i + 2] == ["python", "-m"] and i + 2 < len(words):
        name = words[i + 2]
        return ([name], i + 3) if name in PARSERS else None
    if words[i:i + 1] == ["kvblend"]:
        i += 1
    if i >= len(words):
        return None
    if f"blend.evals.{words[i]}" in PARSERS:  # `bench_prefill --cases rag-hit`
        return [f"blend.evals.{words[i]}"], i + 1
    if f"store {words[i]}" in PARSERS:  # `verify --delete`
        return [f"store {words[i]}"], i + 1
    if words[i] == "store" and i + 1 < len(words) and not words[i + 1].startswith("-"):
        return [f"store {s}" for s in words[i + 1].split("|")], i + 2
    if words[i] in PARSERS:
        return [words[i]], i + 1
    return None


def _flag_uses(text: str) -> Iterator[tuple[str, str | None]]:
    """(flag, the literal value written after it, or None) for each ``--flag`` in ``text``."""
    for m in re.finditer(r"(?<![\w-])(--[a-z][a-z0-9-]*)(?:[ =]([^\s\[\]`'\"]+))?", text):
        value = m.group(2)
        if value is not None:
            value = value.rstrip(",;:)")
            if value.startswith("-") or not value:
                value = None
        yield m.group(1), value


def _literal_values(value: str) -> list[str]:
    """The literal alternatives in a shown value: ``exact|blend|none`` -> three; metavars and ``...`` dropped."""
    return [v for v in value.split("|") if v and v != "..." and not METAVAR.fullmatch(v)]


def _accepts(action: argparse.Action, value: str) -> bool:
    """Whether ``action`` takes the literal ``value`` (one of its choices, or one its type reads)."""
    if action.choices is not None:
        return value in action.choices
    if action.nargs == 0 or not callable(action.type):  # a switch (the word after it is not its value), a string
        return True
    try:
        action.type(value)
    except (argparse.ArgumentTypeError, TypeError, ValueError):
        return False
    return True


def _shown_commands() -> Iterator[tuple[str, list[str], str]]:
    """(where, parser names, text after the command words) for every kvblend command line README shows:
    lines of its code blocks (an indented line continues the one above; a ``#`` comment is not part of the
    command) and inline spans that start with a command."""
    names: list[str] | None = None
    for line in CODE:
        code = line.split(" #", 1)[0] if not line.lstrip().startswith("#") else ""
        if line[:1].isspace():  # a continuation of the command above
            if names and code.strip():
                yield line.strip(), names, code
            continue
        found = _command(code.split())
        names = found[0] if found else None
        if found:
            yield line.strip(), names, " ".join(code.split()[found[1]:])
    comments = [line.split("#", 1)[1] for line in CODE if "#" in line]
    for span in _spans(PROSE) + _spans("\n".join(comments)):
        found = _command(span.split())
        if found:
            yield span, found[0], " ".join(span.split()[found[1]:])


SHOWN = list(_shown_commands())


def test_readme_shows_every_command_and_its_parsers_are_found():
    """The harness itself: it finds the commands README's synopsis lists (so the next test checks them)."""
    seen = {name for _, names, _ in SHOWN for name in names}
    assert {"ask", "chat", "serve", "ingest", "check", "eval", "demo", "store stats", "store prune",
            "store verify", "blend.evals.compare", "blend.evals.guard_curve"} <= seen


@pytest.mark.parametrize("where,names,rest", SHOWN, ids=[w[:60] for w, _, _ in SHOWN])
def test_every_flag_shown_with_a_command_is_one_that_command_takes(where, names, rest):
    """``kvblend ask ... --ratio R``: ``ask`` takes ``--ratio``; ``--reuse exact|blend|none``: each value
    is one of its choices (or its type reads it: ``--guard-margin off``, ``--candidates 1.5``)."""
    for name in names:
        assert name in PARSERS, f"README shows a command kvblend does not have: {where!r}"
        options = _options(PARSERS[name])
        for flag, value in _flag_uses(rest):
            assert flag in options, f"README shows {flag} for `{name}`, which does not take it: {where!r}"
            for v in _literal_values(value or ""):
                assert _accepts(options[flag], v), f"README shows {flag} {v} for `{name}`, which refuses it: {where!r}"


def test_every_other_flag_readme_names_is_taken_by_some_kvblend_parser():
    """A flag named without its command (``--gemm torch`` keeps the old path) still exists somewhere, and a
    value shown with it is one a parser that takes it accepts."""
    actions: dict[str, list[argparse.Action]] = {}
    for p in PARSERS.values():
        for option, action in _options(p).items():
            actions.setdefault(option, []).append(action)
    named = set(FLAG.findall(PROSE)) | {f for line in CODE for f in FLAG.findall(line)}
    assert named - set(actions) - VLLM_FLAGS == set()
    for span in _spans(PROSE):
        for flag, value in _flag_uses(span):
            for v in _literal_values(value or "") if flag not in VLLM_FLAGS else ():
                assert any(_accepts(a, v) for a in actions[flag]), f"README: `{span}`: no parser takes {flag} {v}"


def test_the_server_options_readme_lists_are_the_servers():
    """The ``kvblend: {...}`` bullet lists every option a request's ``kvblend`` object takes, and no other."""
    (listed,) = re.findall(r"`kvblend: \{([^}]*)\}`", README)
    names = {re.split(r"[:\s]", part.strip())[0] for part in listed.replace("\n", " ").split(",")}
    assert names == set(KvblendOptions.model_fields)
    (modes,) = re.findall(r"reuse: ([a-z|]+)", listed)
    assert set(modes.split("|")) == {m.value for m in ReuseMode}


def test_the_endpoints_readme_names_are_served(tiny_engine):
    from blend.serve.app import create_app
    from blend.serve.config import ServeConfig

    routes = {(m, re.sub(r"\{[^}]*\}", "{}", r.path)) for r in create_app(tiny_engine, ServeConfig()).routes
              for m in getattr(r, "methods", ()) or ()}
    named = {(m, re.sub(r"\{[^}]*\}", "{}", p)) for m, p in re.findall(r"`(GET|POST) (/[^`\s]*)`", README)}
    assert len(named) >= 7 and named <= routes, named - routes


def test_the_tests_readme_cites_exist():
    sources = {p.relative_to(ROOT).as_posix(): p.read_text(encoding="utf-8") for p in (ROOT / "tests").rglob("*.py")}
    defined = lambda name, text: re.search(rf"^\s*def {name}\(", text, re.M) is not None  # noqa: E731
    for path, name in re.findall(r"(tests/[\w/]+\.py)(?:::(\w+))?", README):
        assert path in sources, f"README cites {path}, which does not exist"
        assert not name or defined(name, sources[path]), f"README cites {path}::{name}, which is not defined there"
    for name in set(re.findall(r"`(?:::)?(test_\w+?)(?:\.py)?`", README)):
        assert any(defined(name, text) or path.endswith(f"/{name}.py") for path, text in sources.items()), name


def test_every_environment_variable_readme_names_is_read_by_the_code():
    code = "\n".join(p.read_text(encoding="utf-8") for folder in ("blend", "kernels", "retrieval", "evals", "tests")
                     for p in (ROOT / folder).rglob("*.py"))
    for var in set(re.findall(r"\bKVBLEND_[A-Z_]+\b", README)):
        assert re.search(rf"[\"']{var}[\"']", code), f"README names ${var}, which no code reads"


def test_the_fields_ask_json_prints_are_the_ones_readme_lists(tiny_engine):
    listed = re.search(r"`ask --json` prints (.*?) and `report`", PROSE, re.S).group(1)
    prompt = tiny_engine.build_prompt("Who?", make_docs(2))
    printed = cli.answer_json(tiny_engine, tiny_engine.generate(prompt, max_new_tokens=1))
    assert set(printed) == {*re.findall(r"`(\w+)`", listed), "report"}


def test_the_set_up_is_two_commands_and_ci_runs_the_test_one():
    """README's set-up block holds exactly its two commands, the main job and the tests; scripts/kvb takes
    both, and .ci/run runs the test one as written (and the vLLM tests README's vLLM section names)."""
    section = README.split("## Set-up on a fresh machine", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    commands = [line.split("#", 1)[0].strip() for line in block.splitlines() if line.split("#", 1)[0].strip()]
    assert commands == ["bash scripts/kvb demo", "bash scripts/kvb test"]
    kvb = (ROOT / "scripts" / "kvb").read_text(encoding="utf-8")
    assert re.search(r"^\s*demo\)[^\n]*kvblend\" demo", kvb, re.M) and re.search(r"^\s*test\)", kvb, re.M)
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()]
    assert "bash scripts/kvb test" in ci
    runs = [c for c in ci if c.startswith("bash scripts/kvb")]
    assert runs == ["bash scripts/kvb test", "bash scripts/kvb test-vllm"]
    assert "`bash scripts/kvb test-vllm`" in README
