"""clients/python, the client distribution (specdec-client), on its own.

It is built and installed into a fresh virtual environment (`python -m venv`, then `pip install`
of a copy of clients/python, its dependencies from PyPI), which must hold neither torch,
transformers nor the server's packages, and must still generate and stream against a real
orchestrator (the tiny models of tests/conftest.py) with the same tokens as the in-tree client.
Installed size (site-packages after the install minus before it): about 22 MB (grpcio ~19 MB,
protobuf, grpcio-health-checking, typing_extensions, the client ~0.3 MB), checked < 60 MB. The
environment is built once per run (~10 s with a warm pip cache).

The server imports everything the client defines (one copy): checked here too.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLIENT_DIR = ROOT / "clients" / "python"
MAX_INSTALLED_BYTES = 60 * 1024 * 1024
SERVER_ONLY = ["torch", "transformers", "numpy", "specdec", "orchestrator", "specdec_tools", "draft_service",
               "target_service"]


def _tree_bytes(root: Path) -> int:
    return sum(p.lstat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def _site_packages(venv: Path) -> Path:
    return next((venv / "lib").glob("python3*/site-packages"))


def _env() -> dict:
    # nothing of this checkout may leak in: no PYTHONPATH, no user site (the venv runs with -I too)
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory):
    """A fresh venv with `pip install clients/python` in it: (its python, bytes the install added)."""
    root = tmp_path_factory.mktemp("client-venv")
    source = root / "src"  # a copy, so the build leaves nothing (build/, *.egg-info) in the checkout
    shutil.copytree(CLIENT_DIR, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=_env())
    python = venv / "bin" / "python"
    bare = _tree_bytes(_site_packages(venv))
    out = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", str(source)],
                         capture_output=True, text=True, env=_env(), cwd=root, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    return python, _tree_bytes(_site_packages(venv)) - bare


def run_in(python: Path, code: str, *args: str, cwd: Path) -> dict:
    """Runs code in the venv's python, isolated (-I: no cwd, no PYTHONPATH, no user site); its
    last stdout line is JSON."""
    out = subprocess.run([str(python), "-I", "-c", code, *args], capture_output=True, text=True, env=_env(),
                         cwd=cwd, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


PROBE = """
import importlib.util, json, sys
from importlib.metadata import requires, version
import specdec_client
print(json.dumps({
    "found": [m for m in sys.argv[1:] if importlib.util.find_spec(m) is not None],
    "loaded": sorted({m.split(".")[0] for m in sys.modules} & set(sys.argv[1:])),
    "version": specdec_client.__version__,
    "requires": sorted(requires("specdec-client")),
    "grpcio": version("grpcio"),
}))
"""


def test_the_venv_holds_the_client_and_none_of_the_server(client_venv, tmp_path):
    python, _ = client_venv
    probe = run_in(python, PROBE, *SERVER_ONLY, cwd=tmp_path)
    assert probe["found"] == [], f"importable in the client's venv: {probe['found']}"
    assert probe["loaded"] == []
    server = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert probe["version"] == server["version"]
    names = sorted(re.split(r"[ <>=!~;\[]", r)[0] for r in probe["requires"])
    assert names == ["grpcio", "grpcio-health-checking", "protobuf"], probe["requires"]


CALLS = """
import asyncio, json, sys
from specdec_client import AsyncClient, Client, ServiceError

address, prompt = sys.argv[1], json.loads(sys.argv[2])
ask = dict(token_ids=prompt, max_new_tokens=12, temperature=0, gamma=3)
with Client(address, timeout_s=120) as client:
    client.wait_until_ready(60)
    whole = client.generate(**ask)
    chunks = list(client.stream(**ask))
    try:
        client.generate(prompt="", max_new_tokens=2)
        refused = None
    except ServiceError as err:
        refused = err.code.name

async def main():
    async with AsyncClient(address, timeout_s=120) as ac:
        return (await ac.generate(**ask)).token_ids

print(json.dumps({
    "generate": whole.token_ids, "text": whole.text, "finish_reason": whole.finish_reason,
    "stream": [t for c in chunks for t in c.token_ids], "streamed_text": "".join(c.text_delta for c in chunks),
    "last_stats": chunks[-1].stats is not None, "refused": refused, "async": asyncio.run(main()),
}))
"""


def test_generate_and_stream_from_the_venv_match_the_in_tree_client(client_venv, stack, client, tmp_path):
    python, _ = client_venv
    prompt = [5, 17, 42, 8, 99, 3]
    ref = client.generate(token_ids=prompt, max_new_tokens=12, temperature=0, gamma=3)
    got = run_in(python, CALLS, stack["address"], json.dumps(prompt), cwd=tmp_path)
    assert got["generate"] == ref.token_ids and got["text"] == ref.text
    assert got["finish_reason"] == ref.finish_reason == "length"
    assert got["stream"] == ref.token_ids and got["streamed_text"] == ref.text and got["last_stats"]
    assert got["async"] == ref.token_ids
    assert got["refused"] == "INVALID_ARGUMENT"


def test_the_install_is_small(client_venv):
    _, added = client_venv
    print(f"specdec-client and its dependencies add {added / 1e6:.1f} MB to a bare venv")
    assert 0 < added < MAX_INSTALLED_BYTES, f"{added / 1e6:.1f} MB"


# ---- one copy: the server imports the client's definitions --------------------------------


def test_the_server_imports_the_clients_definitions():
    import specdec_client
    import specdec_client.v1 as client_v1
    from orchestrator import client as orchestrator_client
    from specdec import errors, protocol, security
    from specdec import v1 as server_v1
    from specdec_client import channel as client_channel
    from specdec_client import errors as client_errors
    from specdec_client import protocol as client_protocol

    for name in ("common_pb2", "draft_pb2", "target_pb2", "orchestrator_pb2", "orchestrator_pb2_grpc"):
        assert getattr(server_v1, name) is getattr(client_v1, name)
        assert sys.modules[f"specdec.v1.{name}"] is getattr(client_v1, name)
    for name in ("request_to_proto", "result_from_proto", "chunk_from_proto", "GenerationResult", "GenerationChunk",
                 "TokenLogprob", "message_options", "CLIENT_MAX_MESSAGE_BYTES", "SAMPLING_MODES", "FINISH_REASONS"):
        assert getattr(protocol, name) is getattr(client_protocol, name), name
    for name in ("ServiceError", "InvalidArgument", "Unavailable", "ResourceExhausted"):
        assert getattr(errors, name) is getattr(client_errors, name), name
    for name in ("ClientTls", "open_channel", "open_aio_channel"):
        assert getattr(security, name) is getattr(client_channel, name), name
    assert orchestrator_client.Client is specdec_client.Client
    assert orchestrator_client.AsyncClient is specdec_client.AsyncClient


def test_the_generated_code_lives_in_the_client_only():
    generated = re.compile(r"_pb2(_grpc)?\.pyi?$")
    outside = [str(p.relative_to(ROOT)) for d in ("specdec", "orchestrator", "draft_service", "target_service",
                                                    "specdec_tools")
               for p in (ROOT / d).rglob("*") if generated.search(p.name)]
    assert outside == []
    assert {p.name for p in (CLIENT_DIR / "specdec_client" / "v1").glob("*_pb2.py")} == {
        f"{n}_pb2.py" for n in ("common", "draft", "target", "orchestrator")}


def test_versions_agree_and_the_server_ships_the_client_instead_of_depending_on_it():
    """The server's distribution holds specdec_client (from clients/python, one copy) rather than
    requiring specdec-client, a name PyPI does not hold for us: whoever registered it would be
    installed by a plain `pip install .` (dependency confusion)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    server = project["project"]
    client = tomllib.loads((CLIENT_DIR / "pyproject.toml").read_text())["project"]
    assert client["name"] == "specdec-client" and client["version"] == server["version"]
    assert not [d for d in server["dependencies"] if re.split(r"[ <>=!~;\[]", d)[0] == "specdec-client"]
    find = project["tool"]["setuptools"]["packages"]["find"]
    assert "clients/python" in find["where"]
    assert any(Path("specdec_client").match(g) for g in find["include"])
    deps = sorted(re.split(r"[ <>=!~;\[]", d)[0] for d in client["dependencies"])
    assert deps == ["grpcio", "grpcio-health-checking", "protobuf"]


def test_make_install_and_the_docker_build_install_the_server_with_its_client():
    from tests.deploy.deployfiles import ignored, instructions

    make = (ROOT / "Makefile").read_text()
    assert "pip install --quiet -e '.[test]'" in make and "-e clients/python" not in make
    steps = instructions((ROOT / "Dockerfile").read_text())
    assert ("COPY", "clients/python ./clients/python") in steps
    runs = [rest for word, rest in steps if word == "RUN"]
    assert any(re.search(r"pip install --no-deps \.(\s|$)", r) for r in runs)
    assert not ignored("clients/python/pyproject.toml") and not ignored("clients/python/specdec_client/client.py")
