"""Operator comforts of every entry point: --version, and --help naming each flag's variable."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from specdec import __version__

MODULES = ["orchestrator", "target_service", "draft_service", "orchestrator.cli"]


@pytest.mark.parametrize("module", MODULES)
def test_version(module):
    out = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip().endswith(__version__) and __version__ != "0+unknown"


@pytest.mark.parametrize("module", MODULES[:3])
def test_help_names_the_variable_of_every_flag(module):
    text = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, check=True,
                          env={"COLUMNS": "400", "PATH": ""}).stdout
    blocks = re.split(r"\n(?=  -)", text.split("options:", 1)[1])  # one block per flag, help included
    blocks = [b for b in blocks if b.strip().startswith("--") and not b.strip().startswith(("--help", "--version"))]
    assert len(blocks) > 5, text
    for block in blocks:
        assert re.search(r"\(env SPECDEC_[A-Z_]+", block), block
