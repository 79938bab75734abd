"""The packages' import graph: no circle among the project's modules, and the runtime knows nothing
of its tools. Every import counts, at the top of a file, inside a function or under
TYPE_CHECKING, as parsed with ast (nothing is imported). The `specdec` command finds the tools'
commands through the entry-point group specdec.commands (pyproject.toml), never by importing them."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = ("specdec", "orchestrator", "draft_service", "target_service")
PACKAGES = (*RUNTIME, "specdec_tools", "specdec_client")
SOURCES = (ROOT, ROOT / "clients" / "python")  # where the packages' folders are


def _modules() -> dict[str, Path]:
    """Every module of the project's packages: dotted name -> file."""
    modules = {}
    for source in SOURCES:
        for package in PACKAGES:
            for path in sorted((source / package).rglob("*.py")):
                parts = path.relative_to(source).with_suffix("").parts
                modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project's modules that one module imports, each named by its deepest module (`from a
    import b` imports the module a.b where there is one, else a); relative imports resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def known(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {known(alias.name) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([node.module] if node.module else [])])
            found |= {known(f"{base}.{alias.name}") if f"{base}.{alias.name}" in modules else known(base)
                      for alias in node.names}
    return found - {None, name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def test_the_graph_sees_the_imports_it_should():
    """The parser itself: the edges these tests rely on are found (a broken parser finds no circle)."""
    graph = _graph()
    assert "orchestrator.cli" in graph["specdec_tools.cli"]  # inside a function
    assert "orchestrator.http.errors" in graph["orchestrator.http.transport"]
    assert "orchestrator.serve" in graph["orchestrator.cli"]  # from orchestrator import serve
    assert "specdec_client.v1.common_pb2" in graph["specdec.v1"]  # from a package import a module
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle_among_the_packages():
    circles = _circles(_graph())
    assert not circles, "modules that import each other, directly or around a circle: " + "; ".join(
        " <-> ".join(c) for c in circles)


def test_the_runtime_never_imports_the_tools():
    """The service image has no specdec_tools; the tools import the runtime, never the reverse."""
    for name, imported in _graph().items():
        if name.split(".")[0] in RUNTIME:
            tools = sorted(m for m in imported if m.split(".")[0] == "specdec_tools")
            assert not tools, f"{name} imports {tools}"


def test_the_tools_commands_are_entry_points_of_their_add_functions():
    """pyproject.toml declares specdec_tools.cli's COMMANDS, each the same function."""
    from importlib.metadata import EntryPoint

    from specdec_tools.cli import COMMANDS

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["specdec.commands"]
    assert sorted(declared) == sorted(COMMANDS)
    for name, value in declared.items():
        assert EntryPoint(name, value, "specdec.commands").load() is COMMANDS[name], name


def test_a_checkout_never_installed_runs_the_tools_commands():
    """`python -m specdec_tools.cli` adds its own commands, without the installed entry points."""
    text = subprocess.run([sys.executable, "-m", "specdec_tools.cli", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=True).stdout
    commands = text.split("{")[1].split("}")[0].split(",")
    from specdec_tools.cli import COMMANDS, OLD_NAMES

    assert commands == ["serve", "generate", "workers", *sorted(set(COMMANDS) - set(OLD_NAMES))]



def test_entry_points_whose_tools_are_not_installed_are_left_out(monkeypatch, tmp_path):
    """The service image installs the distribution, its entry points listed, without specdec_tools:
    those commands are left out. A tool that is there but misses a module it imports says so."""
    import importlib.metadata

    import pytest

    from orchestrator import cli

    def points(*values):
        eps = importlib.metadata.EntryPoints(
            importlib.metadata.EntryPoint(name, value, cli.COMMANDS_GROUP) for name, value in values)
        monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: eps.select(group=group))

    for name in [m for m in sys.modules if m.split(".")[0] == "specdec_tools"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "specdec_tools", None)  # as in the image
    points(("run", "specdec_tools.cli:add_run"), ("b", "json:dumps"), ("a", "json:loads"))
    assert sorted(cli._tool_commands()) == ["a", "b"]

    (tmp_path / "half_installed_tool.py").write_text("import no_such_dependency_of_the_tool\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    points(("half", "half_installed_tool:add"))
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency_of_the_tool"):
        cli._tool_commands()
