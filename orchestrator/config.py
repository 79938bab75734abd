"""Settings of the orchestrator, from the command line and SPECDEC_ORCHESTRATOR_* variables."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from orchestrator.pool import parse_entries

DEFAULT_PORT = 50050


@dataclass(frozen=True)
class OrchestratorConfig:
    target: str  # target workers: HOST:PORT[,HOST:PORT...]; a name may resolve to many
    draft: str | None = None  # draft workers, the same way; None serves gamma 0 only
    host: str = "0.0.0.0"
    port: int = 0
    max_workers: int = 32  # concurrent client requests being served
    worker_timeout_s: float = 120.0  # deadline of each call to a worker
    startup_timeout_s: float = 3600.0  # how long to wait for workers to load their models
    torch_threads: int = 1  # for sampling math; more only adds spinning threads
    parallel_prefill: bool = True  # prefill draft and target at once (right when they are on separate hosts)
    poll_s: float = 1.0  # how often each worker's load and health are read
    resolve_s: float = 10.0  # how often worker names are resolved again (new replicas join)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> "OrchestratorConfig":
        env = lambda name, default=None: os.environ.get(f"SPECDEC_ORCHESTRATOR_{name}", default)  # noqa: E731
        p = argparse.ArgumentParser(prog="python -m orchestrator", description="Run the orchestrator.")
        p.add_argument("--target", default=env("TARGET"), required=env("TARGET") is None,
                       help="target workers: HOST:PORT, comma-separated, or a name that resolves to every replica")
        p.add_argument("--draft", default=env("DRAFT"),
                       help="draft workers, the same way (omit to serve gamma 0 only)")
        p.add_argument("--host", default=env("HOST", "0.0.0.0"))
        p.add_argument("--port", type=int, default=int(env("PORT", DEFAULT_PORT)))
        p.add_argument("--max-workers", type=int, default=int(env("MAX_WORKERS", 32)))
        p.add_argument("--worker-timeout", type=float, default=float(env("WORKER_TIMEOUT", 120.0)))
        p.add_argument("--startup-timeout", type=float, default=float(env("STARTUP_TIMEOUT", 3600.0)))
        p.add_argument("--torch-threads", type=int, default=int(env("TORCH_THREADS", 1)))
        p.add_argument("--prefill", choices=["parallel", "sequential"], default=env("PREFILL", "parallel"),
                       help="parallel hides the draft's prefill when workers have their own hardware; "
                            "sequential is faster when they share the same cores")
        p.add_argument("--poll-interval", type=float, default=float(env("POLL_INTERVAL", 1.0)),
                       help="seconds between reads of each worker's load and health")
        p.add_argument("--resolve-interval", type=float, default=float(env("RESOLVE_INTERVAL", 10.0)),
                       help="seconds between DNS resolutions of worker names (new replicas join)")
        a = p.parse_args(argv)
        try:
            parse_entries(a.target), parse_entries(a.draft)
        except ValueError as exc:
            p.error(str(exc))
        return cls(a.target, a.draft, a.host, a.port, a.max_workers, a.worker_timeout, a.startup_timeout,
                   a.torch_threads, a.prefill == "parallel", a.poll_interval, a.resolve_interval)
