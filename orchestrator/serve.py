"""`specdec serve`: target, draft and orchestrator as supervised child processes, up until stopped.

  specdec serve [--target MODEL] [--draft MODEL|none] [--host ADDR] [--port GRPC] [--http-port HTTP|off]
                [--target-args "..."] [--draft-args "..."] [any flag of the three services]

The one command a user runs (as `vllm serve` or `llama-server`). It resolves both models first
(download and conversion happen once, here, not in two racing workers), starts the two workers on
free loopback ports and the orchestrator on --host:--port with the OpenAI-compatible door on
--http-port (8000, as vLLM), and prints a ready line as each part reports SERVING on its gRPC
health service. A child that exits is logged and restarted after a backoff (1 s, doubling to 30 s;
back to 1 s once it has run a minute); its address stays the same, so the orchestrator finds a
restarted worker again. SIGINT or SIGTERM stops the orchestrator first (it drains), then the
workers. The children run in sessions of their own (a terminal's Ctrl-C reaches only this
process, which stops them in order) and, on Linux, die with it even when it is killed with
SIGKILL (PR_SET_PDEATHSIG).

Other flags go where their service's flag table has them: orchestrator flags to the orchestrator,
worker flags to both workers (a draft-only flag to the draft), --log-level to all three;
--target-args / --draft-args give one worker flags of its own. Nothing here says whether the
workers share cores: they find out themselves (specdec/hardware.py), as when the three services
are started by hand.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.lifetime import SUPERVISOR_ENV

DEFAULT_PORT = 50050  # the orchestrator's gRPC port (python -m orchestrator's default)
DEFAULT_HTTP_PORT = 8000  # the OpenAI door, where vLLM serves it
DEFAULT_DRAFT_VOCAB = 32768  # the default pair's draft scores the 32k most common ids
BACKOFF_S = (1.0, 30.0)  # a crashed child's first and longest wait before its restart
STABLE_S = 60.0  # a child up this long has its backoff reset
WAIT_NOTE_S = 30.0  # a child not serving yet is reported this often (loading a large model takes minutes)
STOP_GRACE_S = 30.0  # after SIGTERM, seconds a child gets before SIGKILL (the orchestrator drains 20 s)
SERVE_OWNS = ("--host", "--port", "--model", "--target", "--draft", "--http-port")


def say(message: str) -> None:
    """One line on stderr, written whole: the children's watchers say theirs from threads of their own."""
    sys.stderr.write(f"[specdec] {message}\n")
    sys.stderr.flush()


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """n distinct loopback ports free now (each socket held until all are chosen)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@dataclass
class Child:
    """One supervised service: its command, its gRPC port, its process and restart state."""

    name: str  # "target", "draft", "orchestrator"
    argv: list[str]
    port: int
    proc: subprocess.Popen | None = None
    started: float = 0.0
    restarts: int = 0
    backoff_s: float = BACKOFF_S[0]
    restart_at: float | None = None  # when a crashed child is started again
    ready: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        self.ready.clear()
        # no preexec_fn: this process has threads, and a child must not run Python code before exec
        # (the child arms PR_SET_PDEATHSIG itself: specdec/lifetime.py)
        self.proc = subprocess.Popen(self.argv, start_new_session=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", SUPERVISOR_ENV: str(os.getpid())})
        self.started, self.restart_at = time.monotonic(), None


def split_flags(args: list[str]) -> list[list[str]]:
    """['--a', '1', '--b=2'] -> [['--a', '1'], ['--b=2']]: every service flag takes a value."""
    groups: list[list[str]] = []
    for arg in args:
        if arg.startswith("--"):
            groups.append([arg])
        elif groups and len(groups[-1]) == 1 and "=" not in groups[-1][0]:
            groups[-1].append(arg)
        else:
            raise ValueError(f"unexpected argument {arg!r}: service flags are --name VALUE")
    for g in groups:
        if len(g) == 1 and "=" not in g[0]:
            raise ValueError(f"{g[0]} needs a value")
    return groups


def route_flags(extra: list[str]) -> dict[str, list[str]]:
    """Each extra flag to the services whose flag tables hold it (see the module docstring)."""
    from orchestrator.config import FLAGS as ORCHESTRATOR_FLAGS
    from specdec.worker.config import FLAGS as WORKER_FLAGS

    names = {"orchestrator": {f.name for f in ORCHESTRATOR_FLAGS.flags},
             "target": {f.name for f in WORKER_FLAGS.for_role("target")},
             "draft": {f.name for f in WORKER_FLAGS.for_role("draft")}}
    routed: dict[str, list[str]] = {"orchestrator": [], "target": [], "draft": []}
    for group in split_flags(extra):
        name = group[0].split("=", 1)[0]
        if name in SERVE_OWNS:
            raise ValueError(f"{name} is specdec serve's own flag; give it once, before the service flags")
        if name == "--log-level":
            roles = list(routed)
        elif name in names["orchestrator"]:
            roles = ["orchestrator"]
        else:
            roles = [r for r in ("target", "draft") if name in names[r]]
        if not roles:
            raise ValueError(f"{name}: no service takes this flag (see python -m orchestrator --help, "
                             "python -m target_service --help)")
        for role in roles:
            routed[role] += group
    return routed


def _has(flags: list[str], name: str) -> bool:
    return any(f == name or f.startswith(name + "=") for f in flags)


def build_children(a: argparse.Namespace, target_dir: str, draft_dir: str | None, extra: list[str]) -> list[Child]:
    """The three commands (two without a draft), with their ports."""
    routed = route_flags(extra)
    target_flags = routed["target"] + shlex.split(a.target_args)
    draft_flags = routed["draft"] + shlex.split(a.draft_args)
    shared = ["--host", "127.0.0.1"]
    py = [sys.executable, "-m"]
    taken = {a.port} | ({int(a.http_port)} if a.http_port.isdigit() else set())
    target_port, draft_port = [p for p in free_ports(4) if p not in taken][:2]
    target = Child("target", [*py, "target_service", "--model", target_dir, *shared, *target_flags], target_port)
    target.argv += ["--port", str(target.port)]
    children = [target]
    orchestrator_flags = ["--target", f"127.0.0.1:{target.port}"]
    if draft_dir is not None:
        from specdec.eagle3 import is_head_dir

        if is_head_dir(draft_dir):  # a feature head drafts for the target, from its hidden states
            if not _has(draft_flags, "--target-model"):
                draft_flags = ["--target-model", target_dir, *draft_flags]
        elif not _has(draft_flags, "--draft-vocab"):
            draft_flags = ["--draft-vocab", str(DEFAULT_DRAFT_VOCAB), *draft_flags]
        draft = Child("draft", [*py, "draft_service", "--model", draft_dir, *shared, *draft_flags], draft_port)
        draft.argv += ["--port", str(draft.port)]
        children.append(draft)
        orchestrator_flags += ["--draft", f"127.0.0.1:{draft.port}"]
    if a.http_port != "off":
        orchestrator_flags += ["--http-port", str(a.http_port)]
    if not os.path.exists(a.target) and not _has(routed["orchestrator"], "--served-model-name"):
        # a model named by a short name or hub id is served by that name, not its cache directory's
        orchestrator_flags += ["--served-model-name", a.target]
    children.append(Child("orchestrator", [*py, "orchestrator", "--host", a.host, "--port", str(a.port),
                                           *orchestrator_flags, *routed["orchestrator"]], a.port))
    return children


def serving(port: int, timeout_s: float = 2.0) -> bool:
    """Whether the gRPC health service on 127.0.0.1:port says SERVING (a TLS port: whether it
    accepts connections)."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE and "ssl" in (exc.details() or "").lower():
                return True
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING


class Supervisor:
    """Starts the children, says when each serves, restarts the ones that exit, stops them all."""

    def __init__(self, children: list[Child], http_url: str | None):
        self.children, self.http_url = children, http_url
        self.stopping = threading.Event()
        self.began = time.monotonic()

    def run(self) -> int:
        for child in self.children:
            child.start()
            self._watch_ready(child)
        threading.Thread(target=self._announce_all, name="ready", daemon=True).start()
        try:
            while not self.stopping.wait(0.2):
                now = time.monotonic()
                for child in self.children:
                    self._tend(child, now)
        finally:
            self.stop()
        return 0

    def _tend(self, child: Child, now: float) -> None:
        if child.restart_at is not None:
            if now >= child.restart_at:
                child.restarts += 1
                say(f"restarting {child.name} (restart {child.restarts})")
                child.start()
                self._watch_ready(child)
            return
        code = child.proc.poll()
        if code is None:
            if now - child.started > STABLE_S:
                child.backoff_s = BACKOFF_S[0]
            return
        child.ready.clear()
        child.restart_at = now + child.backoff_s
        say(f"{child.name} exited with code {code}; restarting in {child.backoff_s:.0f} s")
        child.backoff_s = min(child.backoff_s * 2, BACKOFF_S[1])

    def _watch_ready(self, child: Child) -> None:
        proc = child.proc

        def watch() -> None:
            next_note = child.started + WAIT_NOTE_S
            while proc.poll() is None and not self.stopping.is_set():
                try:
                    up = serving(child.port)
                except Exception as exc:  # a probe that fails oddly must not end the watch
                    say(f"{child.name}: health probe failed ({type(exc).__name__}: {exc})")
                    up = False
                if up:
                    child.ready.set()
                    say(f"{child.name} SERVING on port {child.port} "
                        f"({time.monotonic() - child.started:.1f} s after its start)")
                    return
                if time.monotonic() > next_note:
                    next_note += WAIT_NOTE_S
                    # the orchestrator serves once its workers do: while one loads, that one's note says it all
                    if all(other.ready.is_set() for other in self.children if other is not child) \
                            or child is not self.children[-1]:
                        say(f"{child.name} (pid {proc.pid}) not serving yet, "
                            f"{time.monotonic() - child.started:.0f} s after its start")
                time.sleep(0.5)

        threading.Thread(target=watch, name=f"ready-{child.name}", daemon=True).start()

    def _announce_all(self) -> None:
        for child in self.children:
            while not child.ready.wait(1.0):
                if self.stopping.is_set():
                    return
        orchestrator = self.children[-1]
        say(f"ready after {time.monotonic() - self.began:.1f} s: gRPC on port {orchestrator.port}"
            + (f", OpenAI-compatible API at {self.http_url}" if self.http_url else ""))

    def stop(self) -> None:
        """SIGTERM to the orchestrator (it drains), then to the workers; SIGKILL past the grace."""
        self.stopping.set()
        for child in reversed(self.children):
            if child.proc is not None and child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
                try:
                    child.proc.wait(STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    say(f"{child.name} did not stop within {STOP_GRACE_S:.0f} s; killing it")
                    child.proc.kill()
                    child.proc.wait()


def add_arguments(p: argparse.ArgumentParser) -> None:
    from specdec.model_store import DEFAULT_DRAFT, DEFAULT_TARGET

    p.add_argument("--target", default=DEFAULT_TARGET,
                   help=f"target model: a short name, a directory, a .gguf file or a hub id (default {DEFAULT_TARGET})")
    p.add_argument("--draft", default=DEFAULT_DRAFT,
                   help=f"draft model, the same way, or 'none' (gamma 0 only) (default {DEFAULT_DRAFT})")
    p.add_argument("--host", default="127.0.0.1",
                   help="address the orchestrator's gRPC and HTTP ports listen on (0.0.0.0: every interface; "
                        "then set --auth-token-file) (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"gRPC port (default {DEFAULT_PORT})")
    p.add_argument("--http-port", default=str(DEFAULT_HTTP_PORT),
                   help=f"port of the OpenAI-compatible HTTP API, or 'off' (default {DEFAULT_HTTP_PORT})")
    p.add_argument("--target-args", default="", metavar="FLAGS", help="more flags for the target worker alone")
    p.add_argument("--draft-args", default="", metavar="FLAGS", help="more flags for the draft worker alone")


def cmd_serve(a: argparse.Namespace, extra: list[str]) -> int:
    from specdec.model_store import ModelStoreError, resolve_model

    if a.http_port != "off" and not a.http_port.isdigit():
        say(f"--http-port takes a port number or 'off', got {a.http_port!r}")
        return 2
    try:
        target_dir = str(resolve_model(a.target))
        draft_dir = None if a.draft.lower() == "none" else str(resolve_model(a.draft))
        children = build_children(a, target_dir, draft_dir, extra)
    except (ModelStoreError, ValueError) as exc:
        say(f"error: {exc}")
        return 2
    shown = "localhost" if a.host in ("0.0.0.0", "::") else a.host
    url = None if a.http_port == "off" else f"http://{shown}:{a.http_port}/v1"
    supervisor = Supervisor(children, url)
    stop = lambda signum, frame: supervisor.stopping.set()  # noqa: E731
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    say(f"starting target ({a.target})" + (f", draft ({a.draft})" if draft_dir else "") + " and orchestrator")
    code = supervisor.run()
    say("stopped")
    return code
