"""The Dockerfile, read offline (no Docker engine here): what it copies exists and survives
.dockerignore, every package pip needs is copied, torch is installed pinned before the project,
and the runtime stage is what compose and Kubernetes expect."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from tests.deploy.deployfiles import DOCKERFILE, METRICS_PORT, ROOT, ignored, instructions, pyproject

CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"


@pytest.fixture(scope="module")
def dockerfile() -> list[tuple[str, str]]:
    return instructions(DOCKERFILE.read_text())


def _args(dockerfile) -> dict[str, str]:
    """ARG defaults (all stages; the names are unique in this file)."""
    out = {}
    for word, rest in dockerfile:
        if word == "ARG" and "=" in rest:
            name, value = rest.split("=", 1)
            out[name] = value
    return out


def _expand(value: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), m.group(0)), value)


def _stages(dockerfile) -> list[list[tuple[str, str]]]:
    stages: list[list[tuple[str, str]]] = []
    for word, rest in dockerfile:
        if word == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((word, rest))
    return stages


# ----------------------------------------------------------------------------- .dockerignore --

def test_dockerignore_rules():
    for kept in ("pyproject.toml", "specdec/config.py", "orchestrator/server.py"):
        assert not ignored(kept), kept
    for dropped in (".venv/bin/python", "tests/conftest.py", "bench_results/x.csv", "docs",
                    "specdec/__pycache__/config.cpython-311.pyc", ".git/HEAD"):
        assert ignored(dropped), dropped


# ------------------------------------------------------------------------------------ copies --

def _copy_sources(dockerfile) -> list[str]:
    sources = []
    for word, rest in dockerfile:
        if word not in ("COPY", "ADD"):
            continue
        assert word == "COPY", "ADD fetches URLs and unpacks archives: use COPY"
        parts = json.loads(rest) if rest.startswith("[") else shlex.split(rest)
        if any(p.startswith("--from") for p in parts):
            continue  # from another stage, not from the build context
        parts = [p for p in parts if not p.startswith("--")]
        sources += parts[:-1]
    return sources


def test_copy_sources_exist_and_are_not_ignored(dockerfile):
    sources = _copy_sources(dockerfile)
    assert sources
    for src in sources:
        assert (ROOT / src).exists(), f"COPY {src}: no such file in the repo"
        assert not ignored(src), f"COPY {src}: excluded by .dockerignore"


def test_copies_what_pip_install_needs(dockerfile):
    """pyproject.toml, its readme, and every package setuptools would find but the tools
    (specdec_tools: the benchmarks, not the service)."""
    sources = {s.rstrip("/") for s in _copy_sources(dockerfile)}
    project = pyproject()
    assert "pyproject.toml" in sources and project["project"]["readme"] in sources
    include = project["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.name for p in ROOT.iterdir()
                if (p / "__init__.py").is_file() and any(Path(p.name).match(g) for g in include)}
    assert packages >= {"specdec", "draft_service", "target_service", "orchestrator"}
    assert packages - {"specdec_tools"} <= sources, f"packages not copied: {packages - sources}"
    assert "tests" not in sources


# ------------------------------------------------------------------------------------- torch --

def test_torch_pinned_before_the_project(dockerfile):
    args = _args(dockerfile)
    pin = next(d for d in pyproject()["project"]["dependencies"] if re.match(r"torch\s*==", d))
    assert args["TORCH_VERSION"] == pin.split("==")[1].strip(), "ARG TORCH_VERSION must equal pyproject's torch pin"
    assert args["TORCH_INDEX_URL"] == CPU_TORCH_INDEX, "the default build is the CPU one"

    runs = [rest for word, rest in dockerfile if word == "RUN"]
    torch_runs = [i for i, r in enumerate(runs) if "torch==" in r]
    assert len(torch_runs) == 1
    torch_run = runs[torch_runs[0]]
    assert '"torch==${TORCH_VERSION}"' in torch_run or "torch==${TORCH_VERSION}" in torch_run
    assert "--index-url" in torch_run and "${TORCH_INDEX_URL}" in torch_run
    installs = [i for i, r in enumerate(runs) if re.search(r"pip install\b", r)]
    assert installs[0] == torch_runs[0], "torch must be the first thing pip installs"
    project_installs = [i for i, r in enumerate(runs) if re.search(r"pip install .*(-r |\s\.(\s|$))", r)]
    assert project_installs and min(project_installs) > torch_runs[0]


# ----------------------------------------------------------------------------------- runtime --

def test_runtime_stage(dockerfile):
    args = _args(dockerfile)
    stages = _stages(dockerfile)
    for stage in stages:
        base = _expand(stage[0][1].split()[0], args)
        assert base == "python:3.11-slim", base
    runtime = stages[-1]
    words = [w for w, _ in runtime]
    assert "ENTRYPOINT" not in words, "the command given by compose/Kubernetes must pick the role"
    user = _expand([r for w, r in runtime if w == "USER"][-1], args).split(":")[0]
    assert user not in ("root", "0"), "run as a non-root user"
    env = " ".join(r for w, r in runtime if w == "ENV")
    assert re.search(r"\bSPECDEC_CACHE=/models\b", env)
    assert [r for w, r in runtime if w == "VOLUME"] == ["/models"]
    exposed = {int(p) for w, r in runtime if w == "EXPOSE" for p in r.split()}
    assert exposed == {50050, 50051, 50052, 8000, METRICS_PORT}  # 8000: the OpenAI-compatible API
