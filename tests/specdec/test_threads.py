"""specdec.threads: every entry point bounds how long idle OpenMP threads spin unless told
otherwise, before torch loads OpenMP (spinning teams of co-located workers cut concurrent
throughput to 0.31x; not spinning at all made a target pass ~1.5x slower)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = ("import os, runpy, sys; sys.argv = [{module!r}, '--help']\n"
         "try:\n    runpy.run_module({module!r}, run_name='__main__')\nexcept SystemExit:\n    pass\n"
         "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))")


def _policy_after_help(module: str, **given: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(given)
    out = subprocess.run([sys.executable, "-c", PROBE.format(module=module)], env=env, cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return out.strip().splitlines()[-1]


@pytest.mark.parametrize("module", ["target_service", "draft_service", "orchestrator"])
def test_entry_points_default_to_a_bounded_spin(module):
    assert _policy_after_help(module) == "None 200000"


def test_an_explicit_policy_or_spin_count_wins():
    assert _policy_after_help("target_service", OMP_WAIT_POLICY="ACTIVE") == "ACTIVE None"
    assert _policy_after_help("target_service", OMP_WAIT_POLICY="PASSIVE") == "PASSIVE None"
    assert _policy_after_help("target_service", GOMP_SPINCOUNT="5") == "None 5"


@pytest.mark.parametrize("module", ["target_service", "draft_service", "orchestrator"])
def test_the_policy_is_set_before_anything_is_imported(module):
    """OpenMP reads the variable when torch loads it: the call must come before every other import."""
    body = ast.parse((ROOT / module / "__main__.py").read_text()).body
    statements = [s for s in body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    assert isinstance(statements[0], ast.ImportFrom) and statements[0].module == "specdec.threads"
    call = statements[1]
    assert isinstance(call, ast.Expr) and call.value.func.id == "bound_openmp_spinning"


def test_the_cli_and_the_image_set_it_too():
    from orchestrator import cli

    assert "bound_openmp_spinning()" in Path(cli.__file__).read_text()
    assert "GOMP_SPINCOUNT=200000" in (ROOT / "Dockerfile").read_text()


def test_benchmark_stacks_keep_no_prefix_cache_unless_asked():
    """Benchmarks send the same prompts again and again: their workers prefill each time."""
    from specdec_tools.stack import ProcessStack

    off = ProcessStack("t", "d").commands
    assert all(cmd[cmd.index("--prefix-cache-tokens") + 1] == "0" for cmd in off[:2])
    assert all("--prefix-cache-tokens" not in cmd for cmd in ProcessStack("t", "d", prefix_cache=True).commands)
