"""The shared runtime's layers: the records (specdec/protocol.py, the client-facing ones, below
specdec/wire.py, the worker hop's) sit below the tensor math (specdec/sampling.py), and specdec/
imports none of the packages above it."""

from __future__ import annotations

from pathlib import Path

from tests.support.imports import imported_modules

ROOT = Path(__file__).resolve().parents[2]
ABOVE = ("orchestrator", "draft_service", "target_service", "specdec_tools")


def test_the_records_do_not_import_the_sampling_math():
    for name in ("protocol.py", "wire.py"):
        assert not {m for m in imported_modules(ROOT / "specdec" / name) if m.startswith("specdec.sampling")}, name


def test_the_client_records_do_not_import_the_worker_wire():
    assert "specdec.wire" not in imported_modules(ROOT / "specdec" / "protocol.py")


def test_the_shared_runtime_imports_nothing_above_it():
    for path in (ROOT / "specdec").rglob("*.py"):
        bad = {m for m in imported_modules(path) if m.split(".")[0] in ABOVE}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"
