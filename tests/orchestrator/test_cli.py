"""The `specdec` command (orchestrator/cli.py): the service's commands stand alone, and the tools'
commands join them only where the tools are installed (not in the service image)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICE = ("orchestrator", "draft_service", "target_service", "specdec")

# runs the command as the service image has it: specdec_tools cannot be imported
WITHOUT_TOOLS = "import sys; sys.modules['specdec_tools'] = None; from orchestrator.cli import main; sys.exit(main())"


def _specdec(*args: str, tools: bool = True) -> subprocess.CompletedProcess:
    command = ["-m", "orchestrator.cli"] if tools else ["-c", WITHOUT_TOOLS]
    return subprocess.run([sys.executable, *command, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_without_the_tools_the_service_commands_remain_and_a_tool_command_says_how_to_get_it():
    help_text = _specdec("--help", tools=False)
    assert help_text.returncode == 0, help_text.stderr
    assert "serve" in help_text.stdout and "bench-serve" not in help_text.stdout.split("{")[1].split("}")[0]
    assert "pip install '.[bench]'" in help_text.stdout
    assert _specdec("serve", "--help", tools=False).returncode == 0
    refused = _specdec("bench-serve", "--concurrency", "1", tools=False)
    assert refused.returncode == 2
    assert "bench-serve" in refused.stderr and "pip install '.[bench]'" in refused.stderr


def test_with_the_tools_their_commands_join_the_service_ones():
    text = _specdec("--help").stdout
    commands = set(text.split("{")[1].split("}")[0].split(","))
    assert {"serve", "generate", "workers", "run", "bench", "timeline"} <= commands
    assert not commands & {"bench-serve", "loadtest"}  # the old names still run, unlisted


def test_an_old_benchmark_name_runs_its_scenario():
    old = _specdec("bench-serve", "--help")
    assert old.returncode == 0, old.stderr
    assert "usage: specdec bench serve" in old.stdout and "`specdec bench serve`" in old.stderr


def test_no_module_of_the_service_imports_the_tools():
    """The service runs without specdec_tools (the image leaves it out): the `specdec` command
    finds the tools' commands through entry points (tests/specdec/test_import_graph.py checks
    the whole import graph)."""
    from tests.support.imports import imported_modules

    for package in SERVICE:
        for path in (ROOT / package).rglob("*.py"):
            assert not any(n.split(".")[0] == "specdec_tools" for n in imported_modules(path)), path


def test_the_image_leaves_the_tools_out():
    from tests.deploy.deployfiles import instructions

    steps = instructions((ROOT / "Dockerfile").read_text())
    assert not any(word == "COPY" and "specdec_tools" in rest for word, rest in steps)
