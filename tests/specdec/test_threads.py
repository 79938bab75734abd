"""specdec.threads: every entry point makes idle OpenMP threads sleep unless told otherwise, before
torch loads OpenMP (spinning teams of co-located workers cut concurrent throughput to 0.31x)."""

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
         "print(os.environ.get('OMP_WAIT_POLICY'))")


def _policy_after_help(module: str, env_policy: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if env_policy:
        env["OMP_WAIT_POLICY"] = env_policy
    out = subprocess.run([sys.executable, "-c", PROBE.format(module=module)], env=env, cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return out.strip().splitlines()[-1]


@pytest.mark.parametrize("module", ["target_service", "draft_service", "orchestrator"])
def test_entry_points_default_to_passive(module):
    assert _policy_after_help(module, None) == "PASSIVE"


def test_an_explicit_policy_wins():
    assert _policy_after_help("target_service", "ACTIVE") == "ACTIVE"


@pytest.mark.parametrize("module", ["target_service", "draft_service", "orchestrator"])
def test_the_policy_is_set_before_anything_is_imported(module):
    """OpenMP reads the variable when torch loads it: the call must come before every other import."""
    body = ast.parse((ROOT / module / "__main__.py").read_text()).body
    statements = [s for s in body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    assert isinstance(statements[0], ast.ImportFrom) and statements[0].module == "specdec.threads"
    call = statements[1]
    assert isinstance(call, ast.Expr) and call.value.func.id == "prefer_passive_openmp"


def test_the_cli_and_the_image_set_it_too():
    from specdec_tools import cli

    assert "prefer_passive_openmp()" in Path(cli.__file__).read_text()
    assert "OMP_WAIT_POLICY=PASSIVE" in (ROOT / "Dockerfile").read_text()
