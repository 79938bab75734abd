"""The shared runtime's layers: the records (specdec/protocol.py, the client-facing ones, below
specdec/wire.py, the worker hop's) sit below the tensor math (specdec/sampling.py), and specdec/
imports none of the packages above it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ABOVE = ("orchestrator", "draft_service", "target_service", "specdec_tools")


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_the_records_do_not_import_the_sampling_math():
    for name in ("protocol.py", "wire.py"):
        assert not {m for m in _imports(ROOT / "specdec" / name) if m.startswith("specdec.sampling")}, name


def test_the_client_records_do_not_import_the_worker_wire():
    assert "specdec.wire" not in _imports(ROOT / "specdec" / "protocol.py")


def test_the_shared_runtime_imports_nothing_above_it():
    for path in (ROOT / "specdec").rglob("*.py"):
        bad = {m for m in _imports(path) if m.split(".")[0] in ABOVE}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"
