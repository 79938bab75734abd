"""Settings of a worker (draft or target), from the command line and the environment.

Every flag has an environment variable (SPECDEC_<ROLE>_<FLAG>, e.g. SPECDEC_TARGET_MODEL), so a
container can be configured without a command line.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from specdec.security import ServerTls


def add_server_tls_arguments(p: argparse.ArgumentParser, env) -> None:
    p.add_argument("--tls-cert", default=env("TLS_CERT"), help="serve TLS: PEM certificate chain")
    p.add_argument("--tls-key", default=env("TLS_KEY"), help="serve TLS: PEM private key")
    p.add_argument("--tls-client-ca", default=env("TLS_CLIENT_CA"),
                   help="mutual TLS: accept only clients whose certificate this PEM CA signed")


@dataclass(frozen=True)
class WorkerConfig:
    role: str  # "draft" or "target"
    model: str
    host: str = "0.0.0.0"
    port: int = 0
    device: str = "cpu"
    dtype: str = "auto"
    device_map: str | None = None
    quantization: str = "auto"  # auto: fp16 Linear weights on CPU, none elsewhere
    draft_vocab: int = 0  # draft only: score just the first N token ids (0: all)
    max_sessions: int = 64
    max_cached_tokens: int = 131072  # tokens in all sessions' KV caches (the target's: ~7.5 GB in fp32)
    session_ttl_s: float = 600.0  # an idle session is freed after this (its orchestrator may be gone)
    drain_timeout_s: float = 20.0  # on SIGTERM: how long open sessions may take to finish
    max_workers: int = 64  # gRPC handler threads: calls mostly wait for the model thread
    tls_cert: str | None = None  # serve TLS with this PEM certificate chain ...
    tls_key: str | None = None  # ... and key
    tls_client_ca: str | None = None  # require client certificates signed by this CA (mTLS)

    @property
    def tls(self) -> ServerTls:
        return ServerTls(self.tls_cert, self.tls_key, self.tls_client_ca)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def from_args(cls, role: str, argv: list[str] | None = None, default_port: int = 0) -> "WorkerConfig":
        env = lambda name, default=None: os.environ.get(f"SPECDEC_{role.upper()}_{name}", default)  # noqa: E731
        p = argparse.ArgumentParser(prog=f"python -m {role}_service", description=f"Run the {role} worker.")
        p.add_argument("--model", default=env("MODEL"), required=env("MODEL") is None,
                       help="local transformers directory, a .gguf file, a default-pair short name or a hub id")
        p.add_argument("--host", default=env("HOST", "0.0.0.0"))
        p.add_argument("--port", type=int, default=int(env("PORT", default_port)))
        p.add_argument("--device", default=env("DEVICE", "cpu"), help="cpu, cuda, cuda:1, ...")
        p.add_argument("--dtype", default=env("DTYPE", "auto"), help="auto, float32, float16, bfloat16, float64")
        p.add_argument("--device-map", default=env("DEVICE_MAP"),
                       help="accelerate device map, e.g. 'auto' to spread the model over several GPUs")
        p.add_argument("--quantize", default=env("QUANTIZE", "auto"), choices=["auto", "none", "fp16", "int8"],
                       help="dynamic quantization of Linear layers on CPU: auto = fp16 weights on CPU (exact per "
                            "row, ~2x faster verify), int8 = faster but batch-dependent numerics, none = plain")
        if role == "draft":
            p.add_argument("--draft-vocab", type=int, default=int(env("DRAFT_VOCAB", 0)),
                           help="propose only from the first N token ids (smaller output head; 0 = all)")
        p.add_argument("--max-sessions", type=int, default=int(env("MAX_SESSIONS", 64)))
        p.add_argument("--max-cached-tokens", type=int, default=int(env("MAX_CACHED_TOKENS", 131072)),
                       help="tokens all sessions may hold together; beyond it RESOURCE_EXHAUSTED")
        p.add_argument("--session-ttl", type=float, default=float(env("SESSION_TTL", 600.0)),
                       help="seconds an idle session is kept (frees what a vanished orchestrator left)")
        p.add_argument("--drain-timeout", type=float, default=float(env("DRAIN_TIMEOUT", 20.0)),
                       help="on SIGTERM: seconds open sessions get to finish before the worker exits")
        p.add_argument("--max-workers", type=int, default=int(env("MAX_WORKERS", 64)))
        add_server_tls_arguments(p, env)
        a = p.parse_args(argv)
        return cls(role, a.model, a.host, a.port, a.device, a.dtype, a.device_map, a.quantize,
                   getattr(a, "draft_vocab", 0), a.max_sessions, a.max_cached_tokens, a.session_ttl, a.drain_timeout, a.max_workers,
                   a.tls_cert, a.tls_key, a.tls_client_ca)
