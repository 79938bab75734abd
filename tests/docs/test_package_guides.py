"""Each package's docstring is a newcomer's map of where a request goes: every file it names must
exist (a map naming a file that was renamed or folded away sends the reader searching)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["orchestrator", "draft_service", "target_service", "specdec", "specdec/worker", "specdec_tools"]


@pytest.mark.parametrize("package", PACKAGES)
def test_the_files_a_package_docstring_names_exist(package):
    init = ROOT / package / "__init__.py"
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    named = set(re.findall(r"[\w/]+\.py\b", doc)) | {m + "/" for m in re.findall(r"\b(\w+)/(?=[\s,;:)])", doc)}
    missing = [name for name in sorted(named)
               if not (ROOT / package / name).exists() and not (ROOT / name).exists()]
    assert not missing, f"{package}/__init__.py names files that do not exist: {missing}"
