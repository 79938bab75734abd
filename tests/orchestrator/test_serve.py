"""orchestrator/serve.py, `specdec serve`: the three services as supervised children of one command.

Real processes on tiny models: the command prints a ready line once all three serve, answers on
its OpenAI port, restarts a child that dies, stops every child on SIGTERM, and leaves none behind
when it is killed with SIGKILL itself. Flags that serve does not own go to the services whose
flag tables hold them.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from orchestrator.serve import free_port, route_flags, split_flags

ROOT = Path(__file__).resolve().parents[2]


def test_each_flag_goes_to_the_services_that_take_it():
    routed = route_flags(["--max-new-tokens", "64", "--max-sessions=8", "--draft-vocab", "100",
                          "--log-level", "debug", "--gamma-policy", "fixed"])
    assert routed["orchestrator"] == ["--max-new-tokens", "64", "--log-level", "debug", "--gamma-policy", "fixed"]
    assert routed["target"] == ["--max-sessions=8", "--log-level", "debug"]
    assert routed["draft"] == ["--max-sessions=8", "--draft-vocab", "100", "--log-level", "debug"]


@pytest.mark.parametrize("argv,message", [
    (["--no-such-flag", "1"], "no service takes this flag"),
    (["--port", "1"], "specdec serve's own flag"),
    (["--max-sessions"], "needs a value"),
    (["stray"], "unexpected argument"),
])
def test_flags_no_service_takes_are_refused(argv, message):
    with pytest.raises(ValueError, match=message):
        route_flags(argv)


def test_flags_split_into_name_value_pairs():
    assert split_flags(["--a", "1", "--b=2", "--c", "x y"]) == [["--a", "1"], ["--b=2"], ["--c", "x y"]]


def _children(pid: int) -> list[int]:
    """Processes whose parent is pid (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class Served:
    """`specdec serve` as a process, its [specdec] lines readable as they come; everything it and
    its children print is kept for the failure message."""

    def __init__(self, *args: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "serve", *args], cwd=ROOT,
                                     stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        self.lines: queue.Queue = queue.Queue()
        self.printed: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.printed.append(line.rstrip())
            if line.startswith("[specdec]"):
                self.lines.put(line.strip())

    def wait_for(self, text: str, timeout_s: float = 180.0) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                tail = "\n".join(self.printed[-80:])
                raise AssertionError(f"no line with {text!r} within {timeout_s} s; the last lines printed:\n{tail}") \
                    from None
            if text in line:
                return line


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_serve_answers_restarts_a_dead_child_and_leaves_no_orphan_when_killed(model_dirs):
    port, http_port = free_port(), free_port()
    served = Served("--target", str(model_dirs["target"]), "--draft", str(model_dirs["draft"]), "--port", str(port),
                    "--http-port", str(http_port), "--dtype", "float32", "--max-new-tokens", "64")
    try:
        ready = served.wait_for("ready after")
        assert f"gRPC on port {port}" in ready and f"http://127.0.0.1:{http_port}/v1" in ready
        children = _children(served.proc.pid)
        assert len(children) == 3
        reply = httpx.post(f"http://127.0.0.1:{http_port}/v1/completions", timeout=60,
                           json={"model": "tiny-target", "prompt": "def f(x):", "max_tokens": 5, "temperature": 0})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 5
        draft = next(pid for pid in children if "draft_service" in Path(f"/proc/{pid}/cmdline").read_text())
        os.kill(draft, signal.SIGKILL)
        served.wait_for("draft exited with code -9")
        served.wait_for("draft SERVING")
        assert len(_children(served.proc.pid)) == 3
        children = _children(served.proc.pid)
        served.proc.kill()  # SIGKILL: no handler runs, the kernel tells the children (PR_SET_PDEATHSIG)
        served.proc.wait(10)
        deadline = time.monotonic() + 60
        while any(map(_alive, children)) and time.monotonic() < deadline:
            time.sleep(0.2)
        alive = [Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")[:120]
                 for pid in children if _alive(pid)]
        tail = "\n".join(served.printed[-60:])
        assert not alive, f"children outlived a killed serve: {alive}; the last lines printed:\n{tail}"
    finally:
        if served.proc.poll() is None:
            served.proc.kill()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_stops_every_child_and_serve_exits_cleanly(model_dirs):
    served = Served("--target", str(model_dirs["target"]), "--draft", "none", "--port", str(free_port()),
                    "--http-port", "off", "--dtype", "float32")
    try:
        ready = served.wait_for("ready after")
        assert "OpenAI" not in ready
        children = _children(served.proc.pid)
        assert len(children) == 2  # no draft: target and orchestrator
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(90) == 0
        assert not any(map(_alive, children))
    finally:
        if served.proc.poll() is None:
            served.proc.kill()


def test_the_commands_leave_sharing_to_the_services_and_name_the_model_as_the_user_did(tmp_path):
    """Whether the workers share cores is theirs to find out (specdec/hardware.py), as when the
    services are started by hand: no pass lock, no prefill order given; a model asked for by a
    short name is served under that name (a directory: its own)."""
    import argparse

    from orchestrator.serve import build_children

    a = argparse.Namespace(target="qwen2.5-coder-1.5b-instruct", host="127.0.0.1", port=5, http_port="8000",
                           target_args="--max-sessions 4", draft_args="")
    target, draft, orchestrator = build_children(a, str(tmp_path / "t"), str(tmp_path / "d"), ["--max-new-tokens", "9"])
    assert "--pass-lock" not in target.argv + draft.argv and "--prefill" not in orchestrator.argv
    assert "--max-sessions" in target.argv and "--max-sessions" not in draft.argv
    assert draft.argv[draft.argv.index("--draft-vocab") + 1] == "32768"
    flags = orchestrator.argv
    assert flags[flags.index("--served-model-name") + 1] == "qwen2.5-coder-1.5b-instruct"
    assert flags[flags.index("--http-port") + 1] == "8000"
    assert flags[flags.index("--target") + 1] == f"127.0.0.1:{target.port}" and flags[-2:] == ["--max-new-tokens", "9"]
    a.target = str(tmp_path)  # a directory: served under its own name, which the orchestrator picks
    gpu = build_children(a, str(tmp_path / "t"), str(tmp_path / "d"), ["--device", "cuda"])
    assert "--served-model-name" not in gpu[-1].argv and "--device" in gpu[1].argv
    assert "--pass-lock" not in gpu[0].argv + gpu[1].argv and "--prefill" not in gpu[-1].argv
    assert len(build_children(a, str(tmp_path / "t"), None, [])) == 2  # --draft none: target and orchestrator
    from specdec_tools.testing.tiny_models import build_head_dir

    head = build_head_dir(tmp_path / "head", target_hidden=64, target_vocab=300, seed=0)
    _, draft, _ = build_children(a, str(tmp_path / "t"), str(head), [])  # a feature head drafts for the target
    assert draft.argv[draft.argv.index("--target-model") + 1] == str(tmp_path / "t") and "--draft-vocab" not in draft.argv
