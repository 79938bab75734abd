"""The gRPC side both workers share: session RPCs, the engine slot, and background loading.

Servicers are thin: proto in, a call on the engine, proto out. Errors are raised as
ServiceError and mapped to statuses by specdec.errors.ErrorInterceptor.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Callable

import grpc

from specdec.config import WorkerConfig
from specdec.errors import Unavailable
from specdec.grpc_server import ServerParts, build_server
from specdec.telemetry import Telemetry
from specdec.v1 import common_pb2
from specdec.worker import ModelInfo, WorkerEngine

log = logging.getLogger(__name__)

TOKENIZER_CHUNK_BYTES = 1 << 20


class EngineSlot:
    """Holds the engine once it is loaded; RPCs before that get UNAVAILABLE."""

    def __init__(self, engine: WorkerEngine | None = None):
        self._engine = engine
        self.error: str | None = None

    def set(self, engine: WorkerEngine) -> None:
        self._engine = engine

    def get(self) -> WorkerEngine:
        if self._engine is None:
            raise Unavailable(f"model failed to load: {self.error}" if self.error else "model is still loading")
        return self._engine


def info_to_proto(info: ModelInfo) -> common_pb2.ModelInfo:
    return common_pb2.ModelInfo(**{**info.__dict__, "eos_token_ids": list(info.eos_token_ids)})


def info_from_proto(msg: common_pb2.ModelInfo) -> ModelInfo:
    return ModelInfo(
        model_name=msg.model_name,
        vocab_size=msg.vocab_size,
        vocab_fingerprint=msg.vocab_fingerprint,
        eos_token_ids=tuple(msg.eos_token_ids),
        bos_token_id=msg.bos_token_id,
        pad_token_id=msg.pad_token_id,
        max_context=msg.max_context,
        device=msg.device,
        dtype=msg.dtype,
        max_gamma=msg.max_gamma,
        open_sessions=msg.open_sessions,
        draining=msg.draining,
        held_tokens=msg.held_tokens,
    )


class SessionRpcs:
    """Describe, OpenSession, Truncate and CloseSession: the same on both workers."""

    def __init__(self, slot: EngineSlot):
        self.slot = slot

    def Describe(self, request, context):
        return info_to_proto(self.slot.get().describe())

    def OpenSession(self, request, context):
        length, compute_s = self.slot.get().open_session(request.session_id, list(request.token_ids))
        return common_pb2.OpenSessionResponse(length=length, compute_s=compute_s)

    def Truncate(self, request, context):
        return common_pb2.TruncateResponse(length=self.slot.get().truncate(request.session_id, request.length))

    def CloseSession(self, request, context):
        self.slot.get().close_session(request.session_id)
        return common_pb2.CloseSessionResponse()

    def GetTokenizer(self, request, context):
        for name, data in self.slot.get().tokenizer_files().items():
            for offset in range(0, max(len(data), 1), TOKENIZER_CHUNK_BYTES):
                yield common_pb2.FileChunk(name=name, data=data[offset : offset + TOKENIZER_CHUNK_BYTES])


def load_in_background(
    config: WorkerConfig, make_engine: Callable[[WorkerConfig], WorkerEngine], slot: EngineSlot, parts: ServerParts
) -> threading.Thread:
    """Loads the model while the server already answers health checks with NOT_SERVING."""

    def run():
        t0 = time.perf_counter()
        try:
            engine = make_engine(config)
            engine.instrument(parts.telemetry, config.role)
            slot.set(engine)
        except Exception as exc:  # noqa: BLE001 - reported through health and UNAVAILABLE
            slot.error = f"{type(exc).__name__}: {exc}"
            log.exception("%s worker: loading %s failed", config.role, config.model)
            return
        parts.set_serving(True)
        log.info("%s worker SERVING %s after %.1f s", config.role, config.model, time.perf_counter() - t0)

    thread = threading.Thread(target=run, name=f"{config.role}-loader", daemon=True)
    thread.start()
    return thread


def serve_until_signalled(server: grpc.Server, parts: ServerParts | None = None, grace_s: float = 5.0,
                          drain: Callable[[], None] | None = None) -> None:
    """Blocks until SIGINT/SIGTERM; then reports NOT_SERVING, runs drain (a worker lets its
    sessions finish), and stops, letting calls in flight end within grace_s."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info("stopping: NOT_SERVING, draining")
    if parts is not None:
        parts.set_serving(False)
        if drain is not None:
            drain()
        parts.stop(grace_s)
    else:
        server.stop(grace_s).wait()
    log.info("stopped")


def create_worker_server(
    config: WorkerConfig,
    engine: WorkerEngine | None,
    make_engine: Callable[[WorkerConfig], WorkerEngine],
    add_servicer: Callable[[EngineSlot, grpc.Server], None],
    service_name: str,
    telemetry: Telemetry | None = None,
) -> tuple[ServerParts, int]:
    """Starts a worker server; with no engine, loads the model in the background
    (health NOT_SERVING and RPCs UNAVAILABLE until it is ready). Returns (parts, port)."""
    slot = EngineSlot(engine)
    parts = build_server(config.address, lambda s: add_servicer(slot, s), [service_name],
                         max_workers=config.max_workers, telemetry=telemetry, tls=config.tls)
    parts.slot = slot
    if engine is not None:
        engine.instrument(parts.telemetry, config.role)
        parts.set_serving(True)
    else:
        parts.loader = load_in_background(config, make_engine, slot, parts)
    return parts, parts.port


def run_worker(create_server: Callable[..., tuple[ServerParts, int]], role: str, argv, default_port: int) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role} %(levelname)s %(message)s")
    config = WorkerConfig.from_args(role, argv, default_port=default_port)
    parts, port = create_server(config, telemetry=Telemetry.from_env(f"specdec-{role}"))
    log.info("%s worker on port %d, loading %s", role, port, config.model)

    def drain():
        try:
            engine = parts.slot.get()
        except Unavailable:
            return  # still loading: nothing to hand back
        left = engine.drain(config.drain_timeout_s)
        if left:
            log.warning("%d sessions still open after %.0f s; their orchestrators move them", left,
                        config.drain_timeout_s)

    serve_until_signalled(parts.server, parts, drain=drain)
