"""Settings of the orchestrator, from the command line and SPECDEC_ORCHESTRATOR_* variables."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from orchestrator.pool import parse_entries
from specdec.config import add_server_tls_arguments
from specdec.security import ClientTls, ServerTls

DEFAULT_PORT = 50050


@dataclass(frozen=True)
class OrchestratorConfig:
    target: str  # target workers: HOST:PORT[,HOST:PORT...]; a name may resolve to many
    draft: str | None = None  # draft workers, the same way; None serves gamma 0 only
    host: str = "0.0.0.0"
    port: int = 0
    max_workers: int = 32  # concurrent client requests being served
    worker_timeout_s: float = 120.0  # deadline of each call to a worker (prefill, verify, ...)
    draft_timeout_s: float = 10.0  # deadline of one Propose: past it the round goes on without drafts
    startup_timeout_s: float = 3600.0  # how long to wait for workers to load their models
    torch_threads: int = 1  # for sampling math; more only adds spinning threads
    parallel_prefill: bool = True  # prefill draft and target at once (right when they are on separate hosts)
    drain_timeout_s: float = 20.0  # on SIGTERM: how long requests in flight may take to finish
    poll_s: float = 1.0  # how often each worker's load and health are read
    resolve_s: float = 10.0  # how often worker names are resolved again (new replicas join)
    max_new_tokens: int = 4096  # the most a request may ask for
    max_prompt_tokens: int = 0  # the longest prompt accepted (0: whatever the context allows)
    tls_cert: str | None = None  # serve clients over TLS: PEM certificate chain ...
    tls_key: str | None = None  # ... and key
    tls_client_ca: str | None = None  # mutual TLS with clients: accept certificates this CA signed
    worker_tls_ca: str | None = None  # reach workers over TLS, verifying them against this CA
    worker_tls_cert: str | None = None  # mutual TLS with workers: our certificate ...
    worker_tls_key: str | None = None  # ... and key
    auth_token_file: str | None = None  # bearer tokens clients must send, one per line

    @property
    def tls(self) -> ServerTls:
        return ServerTls(self.tls_cert, self.tls_key, self.tls_client_ca)

    @property
    def worker_tls(self) -> ClientTls:
        return ClientTls(self.worker_tls_ca, self.worker_tls_cert, self.worker_tls_key)

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
        p.add_argument("--draft-timeout", type=float, default=float(env("DRAFT_TIMEOUT", 10.0)),
                       help="deadline of one round's Propose; a slower draft is replaced (or dropped) for the request")
        p.add_argument("--startup-timeout", type=float, default=float(env("STARTUP_TIMEOUT", 3600.0)))
        p.add_argument("--torch-threads", type=int, default=int(env("TORCH_THREADS", 1)))
        p.add_argument("--prefill", choices=["parallel", "sequential"], default=env("PREFILL", "parallel"),
                       help="parallel hides the draft's prefill when workers have their own hardware; "
                            "sequential is faster when they share the same cores")
        p.add_argument("--drain-timeout", type=float, default=float(env("DRAIN_TIMEOUT", 20.0)),
                       help="on SIGTERM: seconds requests in flight get to finish")
        p.add_argument("--poll-interval", type=float, default=float(env("POLL_INTERVAL", 1.0)),
                       help="seconds between reads of each worker's load and health")
        p.add_argument("--resolve-interval", type=float, default=float(env("RESOLVE_INTERVAL", 10.0)),
                       help="seconds between DNS resolutions of worker names (new replicas join)")
        p.add_argument("--max-new-tokens", type=int, default=int(env("MAX_NEW_TOKENS", 4096)),
                       help="the most tokens one request may ask for")
        p.add_argument("--max-prompt-tokens", type=int, default=int(env("MAX_PROMPT_TOKENS", 0)),
                       help="the longest prompt accepted, in tokens (0: what the context allows)")
        add_server_tls_arguments(p, env)
        p.add_argument("--worker-tls-ca", default=env("WORKER_TLS_CA"),
                       help="reach the workers over TLS, verifying their certificates against this PEM CA")
        p.add_argument("--worker-tls-cert", default=env("WORKER_TLS_CERT"), help="mutual TLS with the workers: our cert")
        p.add_argument("--worker-tls-key", default=env("WORKER_TLS_KEY"), help="mutual TLS with the workers: our key")
        p.add_argument("--auth-token-file", default=env("AUTH_TOKEN_FILE"),
                       help="file of bearer tokens (one per line) a client must send as 'authorization: Bearer T'")
        a = p.parse_args(argv)
        try:
            parse_entries(a.target), parse_entries(a.draft)
        except ValueError as exc:
            p.error(str(exc))
        return cls(a.target, a.draft, a.host, a.port, a.max_workers, a.worker_timeout, a.draft_timeout,
                   a.startup_timeout, a.torch_threads, a.prefill == "parallel", a.drain_timeout, a.poll_interval,
                   a.resolve_interval, a.max_new_tokens, a.max_prompt_tokens, a.tls_cert, a.tls_key,
                   a.tls_client_ca, a.worker_tls_ca, a.worker_tls_cert, a.worker_tls_key, a.auth_token_file)
