"""`specdec run`: the whole stack as three processes on loopback, then one streamed answer.

Starts `python -m target_service`, `python -m draft_service` and `python -m orchestrator` on
free ports, waits until the orchestrator reports SERVING (the workers load their models in the
meantime; their logs show progress), streams the answer to a prompt and prints the stats.
Ctrl-C (or the end of the answer) stops all three.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

DEFAULT_PROMPT = "Write a Python function that checks whether a string is a palindrome, ignoring case and punctuation."


def add_arguments(p: argparse.ArgumentParser) -> None:
    from specdec.model_store import DEFAULT_DRAFT, DEFAULT_TARGET

    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="the question (sent as a chat message)")
    p.add_argument("--raw", action="store_true", help="send the prompt as plain text, without the chat template")
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"target model (default {DEFAULT_TARGET})")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help=f"draft model (default {DEFAULT_DRAFT})")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--compare", action="store_true", help="also run target-only decoding and print the speed-up")
    p.add_argument("--startup-timeout", type=float, default=1800.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: list[str], name: str) -> subprocess.Popen:
    # own process group, so Ctrl-C in the terminal reaches us and we stop the children in order
    return subprocess.Popen([sys.executable, "-m", *args], start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def stop_all(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()


def cmd_run(a: argparse.Namespace) -> int:
    from orchestrator.client import Client
    from specdec.cli import _request_kwargs, format_stats
    from specdec.errors import ServiceError
    from specdec.model_store import resolve_model

    # fetch and convert in this process first, so the two workers never race on the cache
    target_dir, draft_dir = str(resolve_model(a.target)), str(resolve_model(a.draft))
    ports = {name: free_port() for name in ("target", "draft", "orchestrator")}
    common = ["--host", "127.0.0.1", "--device", a.device, "--dtype", a.dtype]
    procs = [
        launch(["target_service", "--model", target_dir, "--port", str(ports["target"]), *common], "target"),
        launch(["draft_service", "--model", draft_dir, "--port", str(ports["draft"]), *common], "draft"),
        launch(["orchestrator", "--host", "127.0.0.1", "--port", str(ports["orchestrator"]),
                "--target", f"127.0.0.1:{ports['target']}", "--draft", f"127.0.0.1:{ports['draft']}"], "orchestrator"),
    ]
    try:
        client = Client(f"127.0.0.1:{ports['orchestrator']}")
        t0 = time.monotonic()
        print(f"[specdec] starting target ({a.target}), draft ({a.draft}) and orchestrator ...", file=sys.stderr)
        client.wait_until_ready(a.startup_timeout)
        print(f"[specdec] all three SERVING after {time.monotonic() - t0:.1f} s", file=sys.stderr)
        kwargs = _request_kwargs(a)
        if kwargs["max_new_tokens"] is None:
            kwargs["max_new_tokens"] = 128
        if kwargs["temperature"] is None:
            kwargs["temperature"] = 0.0
        kwargs.update({"prompt": a.prompt} if a.raw else {"messages": [{"role": "user", "content": a.prompt}]})
        print(f"\n>>> {a.prompt}\n", file=sys.stderr)
        for chunk in client.stream(**kwargs):
            print(chunk.text_delta, end="", flush=True)
            if chunk.stats is not None:
                print("\n")
                print(format_stats(chunk.finish_reason, chunk.stats), file=sys.stderr)
                spec = chunk.stats
        if a.compare:
            base = client.generate(**{**kwargs, "gamma": 0}).stats
            print(f"[specdec] target-only: {base['tokens_per_second']:.2f} tok/s; speculative: "
                  f"{spec['tokens_per_second']:.2f} tok/s; speed-up {spec['tokens_per_second'] / base['tokens_per_second']:.2f}x",
                  file=sys.stderr)
        return 0
    except ServiceError as err:
        print(f"{err.code.name}: {err.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\n[specdec] interrupted; stopping the services", file=sys.stderr)
        return 130
    finally:
        stop_all(procs)
