"""`specdec run`: the whole stack as three processes on loopback, then one streamed answer.

`ProcessStack` starts `python -m target_service`, `python -m draft_service` and
`python -m orchestrator` on free ports (the benchmark uses it too). `specdec run` waits until
the orchestrator reports SERVING (the workers load their models meanwhile; their logs show it),
streams the answer to a prompt and prints the stats. Ctrl-C, or the end of the answer, stops
all three.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def _is_head_dir(path: str) -> bool:
    from specdec.eagle3 import is_head_dir  # torch: only where a stack starts

    return is_head_dir(path)


DEFAULT_PROMPT = "Write a Python function that checks whether a string is a palindrome, ignoring case and punctuation."
DEFAULT_DRAFT_VOCAB = 32768  # the default pair's draft scores the 32k most common ids (see docs/performance.md)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PROMETHEUS_OFFSETS = {"orchestrator": 0, "target_service": 1, "draft_service": 2}


def child_env(module: str) -> dict:
    """The OTEL_* settings, made to fit three processes on one host: each serves Prometheus
    metrics on a port of its own (orchestrator on the configured port, target +1, draft +2),
    and a service name given for the stack gets the role appended."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if "prometheus" in env.get("OTEL_METRICS_EXPORTER", ""):
        base = int(env.get("OTEL_EXPORTER_PROMETHEUS_PORT", "9464"))
        if base:  # 0: each picks a free port
            env["OTEL_EXPORTER_PROMETHEUS_PORT"] = str(base + PROMETHEUS_OFFSETS[module])
    if env.get("OTEL_SERVICE_NAME"):
        env["OTEL_SERVICE_NAME"] += "-" + module.removesuffix("_service")
    return env


def cpu_count(cpus: str) -> int:
    """The CPUs of a taskset list ("0", "1-2", "0,3-4")."""
    return sum(int(b) - int(a) + 1 if "-" in part else 1
               for part in cpus.split(",") for a, _, b in [part.partition("-")])


class ProcessStack:
    """Target, draft and orchestrator as child processes on loopback."""

    def __init__(self, target_dir: str, draft_dir: str, *, device: str = "cpu", dtype: str = "auto",
                 quantization: str = "auto", draft_vocab: int = 0, pass_lock: bool = True,
                 cores: dict[str, str] | None = None, orchestrator_args: tuple[str, ...] = (),
                 draft_args: tuple[str, ...] = (), prefix_cache: bool = False, suffix_cache: bool = False,
                 synthetic_acceptance: float = 0.0):
        """Every process runs with its default flags where they matter to speed: the workers find
        out whether they share cores (--pass-lock auto) and the orchestrator whether they share
        hardware (--prefill auto, --draft-ahead auto). pass_lock False: the workers take no lock
        (--pass-lock off, as before they found out). cores: {"target": "0", "draft": "1"} pins
        each worker to CPUs of its own (taskset -c, as many OpenMP threads as CPUs): two hosts on
        one machine. orchestrator_args / draft_args: more flags for the orchestrator (e.g. --draft-ahead
        4) / the draft worker (e.g. --quantize int8-rows: the last one wins). prefix_cache: the
        workers keep ended requests' KV (--prefix-cache-tokens' default); off by default here, as
        benchmarks send their prompts again and again and must prefill each time, as the first did.
        suffix_cache: the orchestrator drafts from ended requests' tokens (--suffix-cache-tokens'
        default); off by default for the same reason (a request's own tokens are searched either way).
        synthetic_acceptance: benchmarks of random-weight models only: the target keeps each greedy
        draft with this probability, not by its model (specdec_tools/synthetic_target.py), and the
        orchestrator makes no suffix drafts (the coin would keep theirs too)."""
        self.ports = {name: free_port() for name in ("target", "draft", "orchestrator")}
        self.cores = cores or {}
        common = ["--host", "127.0.0.1", "--device", device, "--dtype", dtype, "--quantize", quantization,
                  *([] if pass_lock else ["--pass-lock", "off"]),
                  *([] if prefix_cache else ["--prefix-cache-tokens", "0"])]
        synthetic = ["specdec_tools.synthetic_target", "--synthetic-acceptance", str(synthetic_acceptance)]
        self.commands = [
            [*(synthetic if synthetic_acceptance else ["target_service"]), "--model", target_dir, "--port", str(self.ports["target"]), *common],
            ["draft_service", "--model", draft_dir, "--port", str(self.ports["draft"]), *common,
             *(["--target-model", target_dir] if _is_head_dir(draft_dir) else ["--draft-vocab", str(draft_vocab)]),
             *draft_args],
            ["orchestrator", "--host", "127.0.0.1", "--port", str(self.ports["orchestrator"]),
             "--target", f"127.0.0.1:{self.ports['target']}", "--draft", f"127.0.0.1:{self.ports['draft']}",
             *([] if suffix_cache else ["--suffix-cache-tokens", "0"]),
             *(["--suffix-drafts", "off"] if synthetic_acceptance else []), *orchestrator_args],
        ]
        self.procs: list[subprocess.Popen] = []
        self.extra_addresses: list[str] = []  # more orchestrators (add_orchestrator)
        self._target_dir, self._common, self._draft_vocab = target_dir, common, draft_vocab

    def add_orchestrator(self, *args: str) -> str:
        """One more orchestrator on the same two workers, with its own flags (started by the next
        start(), which may come after the first); returns its address. Benchmarks use it to compare orchestrator settings side by side."""
        port = free_port()
        self.commands.append(["orchestrator", "--host", "127.0.0.1", "--port", str(port),
                              *self.commands[2][5:], *args])
        self.extra_addresses.append(f"127.0.0.1:{port}")
        return self.extra_addresses[-1]

    def add_draft(self, draft_dir: str, *args: str) -> str:
        """One more draft worker on this host (started by the next start()); returns its address: an
        orchestrator added with ("--draft", address) drafts with it on the same target."""
        port = free_port()
        extra = ["--target-model", self._target_dir] if _is_head_dir(draft_dir) else \
            ["--draft-vocab", str(self._draft_vocab)]
        self.commands.append(["draft_service", "--model", draft_dir, "--port", str(port), *self._common, *extra, *args])
        return f"127.0.0.1:{port}"

    def _argv(self, cmd: list[str]) -> tuple[list[str], dict]:
        module = "target_service" if cmd[0] == "specdec_tools.synthetic_target" else cmd[0]
        env = child_env(module)
        role = module.removesuffix("_service")
        if role not in self.cores:
            return [sys.executable, "-m", *cmd], env
        cpus = self.cores[role]
        env["OMP_NUM_THREADS"] = str(cpu_count(cpus))
        return ["taskset", "-c", cpus, sys.executable, "-m", *cmd], env

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.ports['orchestrator']}"

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system, all threads) each role's processes have used so far: target,
        draft and orchestrator, each summed over the stack's processes of that role (Linux /proc;
        {} elsewhere)."""
        tick = os.sysconf("SC_CLK_TCK")
        used: dict[str, float] = {}
        for cmd, proc in zip(self.commands, self.procs):
            try:
                fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                return {}
            role = cmd[0].removesuffix("_service")
            used[role] = used.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        return used

    def start(self, stdout=None) -> "ProcessStack":
        """Starts every process not started yet (orchestrators added after a start included)."""
        # own sessions: Ctrl-C reaches only us, and we stop the children in order
        self.procs += [subprocess.Popen(argv, start_new_session=True, env=env, stdout=stdout)
                       for argv, env in map(self._argv, self.commands[len(self.procs):])]
        return self

    def wait_until_ready(self, timeout_s: float) -> None:
        """Until every orchestrator reports SERVING (so both workers have loaded)."""
        from orchestrator.client import Client

        deadline = time.monotonic() + timeout_s
        for address in [self.address, *self.extra_addresses]:
            with Client(address) as client:
                self._wait(client, deadline)

    def _wait(self, client, deadline: float) -> None:
        while True:
            dead = [cmd[0] for cmd, p in zip(self.commands, self.procs) if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} exited during start-up; see its log above")
            try:
                client.wait_until_ready(min(5.0, max(0.1, deadline - time.monotonic())))
                return
            except Exception:  # noqa: BLE001 - not ready yet
                if time.monotonic() > deadline:
                    raise

    def stop(self, grace_s: float = 10.0) -> None:
        stop_processes(self.procs, grace_s)

    def __enter__(self) -> "ProcessStack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def stop_processes(procs: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM to each process still running, SIGKILL to those still there after the grace."""
    running = [p for p in procs if p.poll() is None]
    for p in running:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in running:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from specdec.model_store import DEFAULT_DRAFT, DEFAULT_TARGET

    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="the question (sent as a chat message)")
    p.add_argument("--raw", action="store_true", help="send the prompt as plain text, without the chat template")
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"target model (default {DEFAULT_TARGET})")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help=f"draft model (default {DEFAULT_DRAFT})")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantize", default="auto", choices=["auto", "none", "fp16", "int8", "int8-rows", "int4-rows", "q4k-rows"])
    p.add_argument("--draft-vocab", type=int, default=DEFAULT_DRAFT_VOCAB, help="0 = the draft's whole vocabulary")
    p.add_argument("--compare", action="store_true", help="also run target-only decoding and print the speed-up")
    p.add_argument("--startup-timeout", type=float, default=1800.0)


def cmd_run(a: argparse.Namespace) -> int:
    from orchestrator.client import Client
    from specdec.errors import ServiceError
    from specdec.model_store import resolve_model
    from orchestrator.cli import format_stats, request_kwargs

    # Ctrl-C and `kill` both stop the children: they run in their own sessions, so nothing else
    # would (and a shell's background job starts with SIGINT ignored)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    # fetch and convert here first, so the two workers never race on the cache
    target_dir, draft_dir = str(resolve_model(a.target)), str(resolve_model(a.draft))
    stack = ProcessStack(target_dir, draft_dir, device=a.device, dtype=a.dtype, quantization=a.quantize,
                         draft_vocab=a.draft_vocab)
    try:
        stack.start()
        t0 = time.monotonic()
        print(f"[specdec] starting target ({a.target}), draft ({a.draft}) and orchestrator ...", file=sys.stderr)
        stack.wait_until_ready(a.startup_timeout)
        print(f"[specdec] all three SERVING after {time.monotonic() - t0:.1f} s", file=sys.stderr)
        kwargs = request_kwargs(a)
        kwargs["max_new_tokens"] = kwargs["max_new_tokens"] or 128
        kwargs["temperature"] = 0.0 if kwargs["temperature"] is None else kwargs["temperature"]
        kwargs.update({"prompt": a.prompt} if a.raw else {"messages": [{"role": "user", "content": a.prompt}]})
        print(f"\n>>> {a.prompt}\n", file=sys.stderr)
        with Client(stack.address) as client:
            for chunk in client.stream(**kwargs):
                print(chunk.text_delta, end="", flush=True)
                if chunk.stats is not None:
                    print("\n")
                    print(format_stats(chunk.finish_reason, chunk.stats), file=sys.stderr)
                    spec = chunk.stats
            if a.compare:
                print("[specdec] running the same request with gamma 0 (target only) ...", file=sys.stderr)
                base = client.generate(**{**kwargs, "gamma": 0}).stats
                print(f"[specdec] target only: {base['tokens_per_second']:.2f} tok/s; speculative: "
                      f"{spec['tokens_per_second']:.2f} tok/s; speed-up "
                      f"{spec['tokens_per_second'] / base['tokens_per_second']:.2f}x", file=sys.stderr)
        return 0
    except ServiceError as err:
        print(f"{err.code.name}: {err.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\n[specdec] interrupted; stopping the services", file=sys.stderr)
        return 130
    finally:
        stack.stop()
