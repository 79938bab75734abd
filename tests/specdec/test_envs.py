"""specdec/envs.py is the one place an environment variable that is no flag's is declared: the code
reads no other SPECDEC_ variable, and each declared one reaches docs/configuration.md."""

from __future__ import annotations

import re
from pathlib import Path

from specdec import envs

ROOT = Path(__file__).resolve().parents[2]
SERVICE = ["specdec", "orchestrator", "draft_service", "target_service"]
NOT_SETTINGS = {"SPECDEC_SUPERVISOR_PID"}  # handed by `specdec serve` to its children (specdec/lifetime.py)
FLAG_PREFIXES = ("SPECDEC_ORCHESTRATOR", "SPECDEC_TARGET", "SPECDEC_DRAFT")  # the flag tables' own (specdec/flags.py)


def test_the_service_reads_only_declared_variables():
    undeclared = {}
    for package in SERVICE:
        for path in (ROOT / package).rglob("*.py"):
            if path.name == "envs.py" or "/v1/" in str(path):
                continue
            for name in re.findall(r"[\"'](SPECDEC_[A-Z0-9_]+)[\"']", path.read_text()):
                if name not in envs.BY_NAME and name not in NOT_SETTINGS and not name.startswith(FLAG_PREFIXES):
                    undeclared.setdefault(name, str(path.relative_to(ROOT)))
            assert "os.environ.get(\"SPECDEC_" not in path.read_text(), f"{path}: read it with specdec.envs.get"
    assert not undeclared, f"read but not declared in specdec/envs.py: {undeclared}"


def test_every_declared_variable_is_documented_and_switches_default_on(monkeypatch):
    page = (ROOT / "docs" / "configuration.md").read_text()
    for v in envs.VARIABLES:
        assert f"| `{v.name}` |" in page, f"{v.name} is not on docs/configuration.md"
    monkeypatch.delenv("SPECDEC_HUGE_PAGES", raising=False)
    assert envs.on("SPECDEC_HUGE_PAGES")
    monkeypatch.setenv("SPECDEC_HUGE_PAGES", "0")
    assert not envs.on("SPECDEC_HUGE_PAGES")
    monkeypatch.setenv("SPECDEC_CACHE", "")
    assert envs.get("SPECDEC_CACHE") == "", "empty means unset"
