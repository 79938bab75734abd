"""docs/configuration.md is generated from the flag tables (scripts/gen_config_docs.py): it must be
what the script generates now, so a flag added, removed or changed without regenerating the page
fails here, and it must name every flag of every table with its environment variable."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from orchestrator.config import FLAGS as ORCHESTRATOR_FLAGS
from specdec.worker.config import FLAGS as WORKER_FLAGS

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "configuration.md"
REGENERATE = "run .venv/bin/python scripts/gen_config_docs.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("specdec_scripts_gen_config_docs",
                                                  ROOT / "scripts" / "gen_config_docs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


gen = _load_script()


def _section(text: str, title: str) -> str:
    """The text of one '## title' section, up to the next '## ' heading."""
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else len(text)]


def _rows(text: str) -> dict[str, str]:
    """Table rows by their first cell's flag name."""
    rows = {}
    for line in text.splitlines():
        match = re.match(r"\| `(--[a-z0-9-]+)[`,]", line)
        if match:
            rows[match.group(1)] = line
    return rows


def test_the_page_is_what_the_script_generates_now():
    assert DOC.exists(), f"docs/configuration.md is missing: {REGENERATE}"
    assert DOC.read_text() == gen.render(), f"docs/configuration.md is stale: {REGENERATE}"
    assert gen.check() == []


@pytest.mark.parametrize("title,table,roles", [
    ("Orchestrator", ORCHESTRATOR_FLAGS, ("orchestrator",)),
    ("Workers", WORKER_FLAGS, ("target", "draft")),
])
def test_every_flag_of_every_table_is_on_the_page(title, table, roles):
    section = _section(DOC.read_text(), title)
    for role in roles:
        for flag in table.for_role(role):
            rows = _rows(section)
            assert flag.name in rows, f"{flag.name} ({role}) is not in its section of docs/configuration.md"
            assert f"`{table.env_name(flag, role)}`" in rows[flag.name], f"{flag.name}: no {role} variable"
            if flag.default is not None and not flag.required:
                assert f"`{flag.default}`" in rows[flag.name], f"{flag.name}: its default is not shown"
    # and nothing else: a flag the table lost must leave the page
    names = {f.name for r in roles for f in table.for_role(r)}
    assert set(_rows(section)) == names


@pytest.mark.parametrize("title,table", [("Orchestrator", ORCHESTRATOR_FLAGS), ("Workers", WORKER_FLAGS)])
def test_the_flags_stand_in_their_groups_as_help_shows_them(title, table):
    section = _section(DOC.read_text(), title)
    assert table.groups, f"the {title} table groups its flags"
    for name, flags in table.groups:
        start = section.index(f"\n### {title}: {name}\n")
        end = section.find("\n### ", start + 1)
        assert set(_rows(section[start:end])) == set(flags), f"{title}: the group {name!r} is not what the table says"


def test_serve_flags_and_worker_switches_are_documented():
    import argparse

    from orchestrator import serve

    parser = argparse.ArgumentParser(add_help=False)
    serve.add_arguments(parser)
    rows = _rows(_section(DOC.read_text(), "`specdec serve`"))
    assert {o for a in parser._actions for o in a.option_strings} == set(rows)
    switches = _section(DOC.read_text(), "Environment switches of the workers")
    for name in ("SPECDEC_NATIVE_KERNELS", "SPECDEC_NATIVE_ISA", "SPECDEC_HUGE_PAGES", "SPECDEC_LEAN_FORWARD",
                 "SPECDEC_NATIVE_FORWARD", "SPECDEC_Q6K", "SPECDEC_CACHE"):
        assert f"| `{name}` |" in switches
        # each switch is one the runtime really reads
        assert any(name in p.read_text() for p in (ROOT / "specdec").rglob("*.py")), name


def test_a_flag_change_makes_the_page_stale(monkeypatch):
    from specdec.flags import Flag

    flags = ORCHESTRATOR_FLAGS.flags
    monkeypatch.setattr(ORCHESTRATOR_FLAGS, "flags", flags + (Flag("--brand-new", int, 3, "a flag added"),))
    assert "--brand-new" in gen.render() and gen.check() != []
