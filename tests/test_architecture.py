"""The shape of the code: an acyclic import graph, no reach-ins, a small engine, a light CLI.

The import graph counts every import statement that runs, function-local ones
included (a lazy import may speed start-up, but it may not close a cycle);
imports under ``if TYPE_CHECKING:`` never run and are not edges.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# folder -> import package (pyproject's package-dir mapping)
PACKAGES = {"blend": "blend", "kernels": "blend.kernels", "retrieval": "blend.retrieval", "evals": "blend.evals"}


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    line: int
    names: tuple[str, ...]  # names imported from dst ("" for a plain ``import``)


def module_files() -> dict[str, Path]:
    out = {}
    for folder, pkg in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([pkg, *parts])] = path
    return out


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                lines.update(range(sub.lineno, (sub.end_lineno or sub.lineno) + 1))
    return lines


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_edges(mods: dict[str, Path]) -> list[Edge]:
    edges = []
    for mod, path in mods.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_lines(tree)
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in skip:
                continue
            targets: list[tuple[str, tuple[str, ...]]] = []
            if isinstance(node, ast.Import):
                targets = [(a.name, ("",)) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = mod if is_pkg else mod.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        anchor = anchor.rpartition(".")[0]
                    base = f"{anchor}.{base}" if base else anchor
                for a in node.names:  # `from pkg import submodule` is an edge to the submodule
                    full = f"{base}.{a.name}"
                    targets.append((full, ()) if full in mods else (base, (a.name,)))
            for name, names in targets:
                dst = _resolve(name, mods)
                if dst is not None and dst != mod:
                    edges.append(Edge(mod, dst, node.lineno, names))
                    parent = dst.rpartition(".")[0]  # importing a submodule runs its package first
                    while parent and parent in mods and parent != mod and not mod.startswith(parent + "."):
                        edges.append(Edge(mod, parent, node.lineno, ()))
                        parent = parent.rpartition(".")[0]
    return edges


def find_cycle(edges: list[Edge]) -> list[str] | None:
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.src, set()).add(e.dst)
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_import_graph_has_no_cycle_counting_function_local_imports():
    cycle = find_cycle(import_edges(module_files()))
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_sees_a_function_local_cycle(tmp_path):
    mods = {"blend.a": tmp_path / "a.py", "blend.b": tmp_path / "b.py"}
    mods["blend.a"].write_text("import blend.b\n")
    mods["blend.b"].write_text("def f():\n    from blend.a import g\n")
    assert find_cycle(import_edges(mods)) == ["blend.a", "blend.b", "blend.a"]
    mods["blend.b"].write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from blend.a import g\n")
    assert find_cycle(import_edges(mods)) is None


def test_no_module_imports_or_reads_another_modules_underscore_names():
    mods = module_files()
    bad = [f"{e.src}:{e.line} imports {e.dst}.{n}" for e in import_edges(mods)
           for n in e.names if n.startswith("_") and not n.startswith("__")]
    for mod, path in mods.items():  # module._name through an imported module alias
        tree = ast.parse(path.read_text())
        aliases = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                aliases.update(a.asname for a in node.names if a.name.startswith("blend") and a.asname)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("blend"):
                aliases.update(a.asname or a.name for a in node.names if f"{node.module}.{a.name}" in mods)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                bad.append(f"{mod}:{node.lineno} reads {node.value.id}.{node.attr}")
    assert not bad, "\n".join(bad)


def _class_methods(path: Path, cls: str) -> list[ast.FunctionDef]:
    tree = ast.parse(path.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return [f for f in node.body if isinstance(f, ast.FunctionDef)]


def test_the_engine_is_small():
    methods = _class_methods(ROOT / "blend" / "engine.py", "Engine")
    public = [f.name for f in methods if not f.name.startswith("_")
              and not any(ast.unparse(d) == "property" for d in f.decorator_list)]
    assert len(public) <= 10, public
    long = {f.name: f.end_lineno - f.lineno + 1 for f in methods if f.end_lineno - f.lineno + 1 > 45}
    assert not long, long


def test_prefill_blend_reads_in_one_screen():
    tree = ast.parse((ROOT / "blend" / "blending.py").read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "prefill_blend")
    assert fn.end_lineno - fn.lineno + 1 <= 50


def test_one_layer_loop_serves_prefill_blend_and_decode():
    """Only model.run_layers iterates over the layers' weights; everything else calls it."""
    loops = []
    for mod, path in module_files().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.For) and ".layers" in ast.unparse(node.iter) and "enumerate" in ast.unparse(node.iter):
                loops.append(f"{mod}:{node.lineno}")
    assert loops == [f"blend.model:{_line_of_run_layers()}"], loops


def _line_of_run_layers() -> int:
    for f in _class_methods(ROOT / "blend" / "model.py", "ModelRunner"):
        if f.name == "run_layers":
            return next(n.lineno for n in ast.walk(f) if isinstance(n, ast.For))
    raise AssertionError("ModelRunner.run_layers is gone")


@pytest.mark.parametrize("command", ["ask", "check"])
def test_building_the_cli_for_a_core_command_imports_neither_faiss_nor_the_eval_harness(command):
    code = (f"import sys\nfrom blend.cli import build_parser\nbuild_parser({command!r})\n"
            "print(sorted(m for m in ('faiss', 'blend.evals.harness', 'blend.retrieval.index', 'blend.engine', "
            "'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_every_area_command_is_registered_and_none_vanishes():
    from blend.cli import AREA_COMMANDS, build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")  # argparse's own API for its subparsers
    assert {"ask", "check", *AREA_COMMANDS} <= set(sub.choices)
    for name in AREA_COMMANDS:  # asking for one area builds that area's parser
        assert name in next(a for a in build_parser(name)._actions if a.dest == "command").choices


def test_the_defaults_are_written_once():
    """The default ratio and model name appear as literals only in blend/defaults.py."""
    defaults = {0.15: "DEFAULT_RATIO", "smollm2-135m": "DEFAULT_MODEL"}
    found = []
    for mod, path in module_files().items():
        if mod == "blend.defaults":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and not isinstance(node.value, bool) and node.value in defaults:
                found.append(f"{mod}:{node.lineno} writes {node.value!r} (use blend.defaults.{defaults[node.value]})")
    assert not found, "\n".join(found)


# DESIGN.md: "Args/Returns docstrings on public functions". Held to it: every public (no leading underscore)
# module-level function of the library's folders (evals/ is the harness, not the library). No entry point is
# exempt: an argparse ``main(argv)`` documents ``argv`` and its exit status like any other function.
DOCUMENTED_FOLDERS = ("blend", "retrieval", "kernels")


def _own_nodes(fn: ast.FunctionDef | ast.AsyncFunctionDef):
    """The nodes of ``fn``'s body, not those of functions, lambdas or classes defined inside it."""
    stack = list(fn.body)
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(node))


def docstring_gaps(path: Path, name: str) -> list[str]:
    """``name:line function lacks Args:`` (or ``Returns:``, ``Yields:``) for each public module-level function
    of the file that takes parameters without an ``Args:`` section, or gives a value (a ``return <value>``, a
    return annotation other than None) without a ``Returns:`` one (a generator: ``Yields:``)."""
    gaps = []
    for fn in ast.parse(path.read_text()).body:
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or fn.name.startswith("_"):
            continue
        doc = ast.get_docstring(fn) or ""
        has = {h for h in ("Args", "Returns", "Yields") if re.search(rf"^\s*{h}:\s*$", doc, re.M)}
        a = fn.args
        need = {"Args"} if a.posonlyargs or a.args or a.vararg or a.kwonlyargs or a.kwarg else set()
        body = list(_own_nodes(fn))
        if any(isinstance(n, (ast.Yield, ast.YieldFrom)) for n in body):
            need.add("Yields")
        elif (any(isinstance(n, ast.Return) and n.value is not None
                  and not (isinstance(n.value, ast.Constant) and n.value.value is None) for n in body)
              or (fn.returns is not None and ast.unparse(fn.returns) not in ("None", "NoReturn"))):
            need.add("Returns")
        gaps += [f"{name}:{fn.lineno} {fn.name} lacks {h}:" for h in sorted(need - has)]
    return gaps


def test_public_functions_document_their_arguments_and_results():
    gaps = []
    for folder in DOCUMENTED_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            gaps += docstring_gaps(path, path.relative_to(ROOT).as_posix())
    assert not gaps, "\n".join(gaps)


def test_the_docstring_check_sees_each_missing_section(tmp_path):
    src = tmp_path / "m.py"
    src.write_text('''
def takes(x):
    """No sections."""

def gives() -> int:
    """No sections."""
    return 1

def gives_late(x):
    """Args: in prose is not a section."""
    def inner():
        return 2
    if inner():
        return inner()

def streams():
    """Returns:
        not what a generator needs.
    """
    yield 1

def fine(x, *, y=None) -> "int | None":
    """Fine.

    Args:
        x: an x.
        y: a y.

    Returns:
        Something.
    """
    return None if y is None else x

def _private(x):
    return x

def nothing() -> None:
    """No parameters, no value."""
    def inner():
        return 1
    return
''')
    assert docstring_gaps(src, "m") == [
        "m:2 takes lacks Args:", "m:5 gives lacks Returns:", "m:9 gives_late lacks Args:",
        "m:9 gives_late lacks Returns:",
        "m:16 streams lacks Yields:"]


def test_the_kernels_folder_never_shadows_a_top_level_kernels_package(tmp_path):
    """From the repository root the folder kernels/ is importable as a bare ``kernels``; transformers
    (>= 5.25) imports a PyPI package of that name. The folder hands the name over: to the installed
    package when there is one, else to an empty module (no file, no version: "absent" to transformers'
    probe), and ``blend.kernels`` stays itself either way."""
    fake = tmp_path / "site" / "kernels"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("MARK = 'installed'\n")
    code = ("import sys; sys.path[:0] = [{root!r}, {site!r}]\n"
            "import kernels, blend.kernels\n"
            "f = getattr(kernels, '__file__', None)\n"
            "print(getattr(kernels, 'MARK', None), f != {ours!r}, "
            "blend.kernels.rope_mix.__module__)\n")
    for site, mark in [(str(tmp_path / "site"), "installed"), (str(tmp_path / "nothing"), None)]:
        ours = str(ROOT / "kernels" / "__init__.py")  # (an installed package may live under ROOT/.venv)
        out = subprocess.run([sys.executable, "-c", code.format(root=str(ROOT), site=site, ours=ours)], cwd=str(ROOT),
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        got_mark, not_ours, module = out.stdout.split()
        assert not_ours == "True" and module == "blend.kernels.dispatch"
        if mark:
            assert got_mark == mark  # the installed package, found behind the repository root
    broken = tmp_path / "broken" / "kernels"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("import kvblend_missing_dependency_xyz\n")
    out = subprocess.run([sys.executable, "-c", code.format(root=str(ROOT), site=str(tmp_path / "broken"),
                                                            ours=str(ROOT / "kernels" / "__init__.py"))],
                         cwd=str(ROOT), capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "kvblend_missing_dependency_xyz" in out.stderr  # a broken install is not hidden


def test_importing_blend_asks_torch_for_huge_pages_unless_the_environment_says_otherwise():
    import os
    import subprocess
    import sys

    code = "import blend, os; print(os.environ.get('THP_MEM_ALLOC_ENABLE'))"
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"
    out = subprocess.run([sys.executable, "-c", code], env={**env, "THP_MEM_ALLOC_ENABLE": "0"},
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0"
