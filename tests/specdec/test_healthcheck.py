"""specdec.healthcheck against real servers: SERVING exits 0; NOT_SERVING, unknown services and
closed ports exit 1 (the codes Docker's HEALTHCHECK reads)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from specdec import healthcheck
from specdec.grpc_server import build_server
from target_service.role import TARGET
TARGET_SERVICE = TARGET.service_name


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def not_serving():
    """A real server that never leaves NOT_SERVING, like a worker still loading its model."""
    parts = build_server("127.0.0.1:0", lambda server: None, [], max_workers=8)
    yield f"127.0.0.1:{parts.port}"
    parts.stop(None)


@pytest.mark.parametrize("role", ["target", "draft", "orchestrator"])
def test_serving_servers_exit_0(stack, role, capsys):
    port = stack["ports"][["target", "draft", "orchestrator"].index(role)]
    assert healthcheck.main([f"127.0.0.1:{port}"]) == 0
    assert "SERVING" in capsys.readouterr().out


def test_named_service(stack, capsys):
    address = f"127.0.0.1:{stack['ports'][0]}"
    assert healthcheck.main([address, "--service", TARGET_SERVICE]) == 0
    # the health service answers NOT_FOUND for a name it does not know
    assert healthcheck.main([address, "--service", "no.such.Service", "--timeout", "5"]) == 1
    assert "NOT_FOUND" in capsys.readouterr().out


def test_not_serving_exits_1(not_serving, capsys):
    assert healthcheck.main([not_serving]) == 1
    assert "NOT_SERVING" in capsys.readouterr().out


def test_closed_port_exits_1(capsys):
    assert healthcheck.main([f"127.0.0.1:{_closed_port()}", "--timeout", "2"]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().out


def test_bad_arguments_exit_1_not_2():
    # Docker reserves exit code 2; argparse would use it
    with pytest.raises(SystemExit) as exc:
        healthcheck.main([])
    assert exc.value.code == 1
    with pytest.raises(SystemExit) as exc:
        healthcheck.main(["localhost:1", "--timeout", "soon"])
    assert exc.value.code == 1


def test_module_entry_point(stack):
    """The exact command the compose healthchecks run, in a fresh interpreter."""
    ok = subprocess.run([sys.executable, "-m", "specdec.healthcheck", f"127.0.0.1:{stack['ports'][2]}"],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    down = subprocess.run([sys.executable, "-m", "specdec.healthcheck", f"127.0.0.1:{_closed_port()}",
                           "--timeout", "2"], capture_output=True, text=True, timeout=60)
    assert down.returncode == 1, down.stdout + down.stderr
