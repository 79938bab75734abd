"""One gRPC worker server for both roles: create_server(role, config) -> (parts, port), main(role).

A `WorkerRole` (draft_service/role.py, target_service/role.py) says what differs: the engine it
loads, the servicer it registers, its default port. Everything else is here: the session RPCs
both roles answer, the engine slot (UNAVAILABLE until the model is loaded; FAILED_PRECONDITION
naming why, for good, once loading failed), loading in the background while health says
NOT_SERVING, and draining on SIGTERM.

Servicers are thin: proto in, a call on the engine, proto out. Errors are raised as
ServiceError and mapped to statuses by specdec.errors.ErrorInterceptor.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from specdec.errors import FailedPrecondition, ServiceError, Unavailable
from specdec.grammar import GrammarLimits, compiler_ready
from specdec.grpc_server import ServerParts, build_server, serve_until_signalled
from specdec.telemetry import Telemetry
from specdec.v1 import common_pb2
from specdec.worker.config import WorkerConfig
from specdec.worker.engine import WorkerEngine

log = logging.getLogger(__name__)

TOKENIZER_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class WorkerRole:
    """What makes a worker a draft or a target."""

    name: str  # "draft" or "target": also the SPECDEC_<NAME>_* prefix and the telemetry role
    default_port: int
    engine_class: type  # a WorkerEngine subclass: DraftEngine or TargetEngine
    servicer_class: type  # its servicer, built on the EngineSlot
    add_servicer: Callable  # the generated add_<Service>Servicer_to_server
    service_name: str  # the full gRPC service name, for health and reflection

    def make_engine(self, config: WorkerConfig) -> WorkerEngine:
        """Loads the model the config names (a draft may restrict its output head)."""
        from specdec.modeling import load_model

        loaded = load_model(config.model, device=config.device, dtype=config.dtype, device_map=config.device_map,
                            quantization=config.quantization, head_rows=config.draft_vocab, role=config.role,
                            target_model=config.target_model)
        return self.engine_class(loaded, max_sessions=config.max_sessions, max_cached_tokens=config.max_cached_tokens,
                                 session_ttl_s=config.session_ttl_s, max_batch_tokens=config.max_batch_tokens,
                                 max_prefill_tokens_while_decoding=config.max_prefill_tokens_while_decoding,
                                 pass_lock=config.pass_lock, grammar_limits=GrammarLimits.from_config(config),
                                 cuda_graphs=config.cuda_graphs == "on", prefix_cache_tokens=config.prefix_cache_tokens)


class EngineSlot:
    """Holds the engine once it is loaded; RPCs before that get UNAVAILABLE (worth waiting for),
    and after a load that failed FAILED_PRECONDITION with the reason (not worth waiting for: the
    orchestrator tells its clients why, and may serve without this worker)."""

    def __init__(self, engine: WorkerEngine | None = None):
        self._engine = engine
        self.error: str | None = None  # why loading failed

    def set(self, engine: WorkerEngine) -> None:
        self._engine = engine

    def get(self) -> WorkerEngine:
        if self._engine is None:
            if self.error is not None:
                raise FailedPrecondition(f"model load failed: {self.error}")
            raise Unavailable("model is still loading")
        return self._engine

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()


def peer_identity(context) -> str:
    """The caller's certificate identity under mutual TLS (its first subject alternative name,
    else its common name); "" for a plaintext or server-only-TLS caller."""
    auth = context.auth_context() if context is not None else {}
    for key in ("x509_subject_alternative_name", "x509_common_name"):
        values = auth.get(key)
        if values:
            return values[0].decode(errors="replace")
    return ""


class SessionRpcs:
    """Describe, OpenSession, Truncate and CloseSession: the same on both workers.

    A session belongs to the caller that opened it: every later call must carry the secret
    OpenSession returned and, under mutual TLS, come from the same certificate identity; any
    other caller gets NOT_FOUND, as for an unknown session, and changes nothing."""

    def __init__(self, slot: EngineSlot):
        self.slot = slot

    def authorized(self, request, context) -> WorkerEngine:
        engine = self.slot.get()
        engine.authorize(request.session_id, request.session_secret, peer_identity(context))
        return engine

    def run_batch(self, requests, context, convert: Callable, run: Callable) -> list:
        """A batched RPC's calls: each authorized and converted (convert(request) -> call) on its
        own, then run(engine, calls) for those that passed. Per request in order: its result or
        the ServiceError it met."""
        engine = self.slot.get()
        owner = peer_identity(context)
        results: list = [None] * len(requests)
        todo: list[tuple[int, object]] = []
        for i, r in enumerate(requests):
            try:
                engine.authorize(r.session_id, r.session_secret, owner)
                todo.append((i, convert(r)))
            except ServiceError as exc:
                results[i] = exc
        for (i, _), outcome in zip(todo, run(engine, [c for _, c in todo])):
            results[i] = outcome
        return results

    def Describe(self, request, context):
        return self.slot.get().describe().to_proto()

    def OpenSession(self, request, context):
        engine = self.slot.get()
        if request.fork_of:
            length, compute_s, cached = engine.fork_session(request.session_id, request.fork_of,
                                                            list(request.token_ids), peer_identity(context),
                                                            request.fork_secret)
        else:
            length, compute_s, cached = engine.open_session(request.session_id, list(request.token_ids),
                                                            peer_identity(context), request.prefix_scope,
                                                            feature_layers=tuple(request.feature_layers))
        features = engine.opened_features(request.session_id) if request.feature_layers else None
        return common_pb2.OpenSessionResponse(length=length, compute_s=compute_s, cached_tokens=cached,
                                              session_secret=engine.secret_of(request.session_id),
                                              features=features.to_proto() if features is not None else None)

    def Truncate(self, request, context):
        engine = self.authorized(request, context)
        return common_pb2.TruncateResponse(length=engine.truncate(request.session_id, request.length))

    def CloseSession(self, request, context):
        self.authorized(request, context).close_session(request.session_id)
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
            compiler_ready(engine)  # SERVING means ready at full speed
            slot.set(engine)
        except Exception as exc:  # noqa: BLE001 - every RPC says why (EngineSlot.get); health stays NOT_SERVING
            # a ValueError is a loader's refusal worded for the operator (a head made for another
            # target, say); anything else needs its type to be understood
            slot.error = str(exc) if isinstance(exc, ValueError) and str(exc) else f"{type(exc).__name__}: {exc}"
            log.exception("%s worker: loading %s failed; every call is refused (FAILED_PRECONDITION) until "
                          "it is restarted", config.role, config.model)
            return
        parts.set_serving(True)
        log.info("%s worker SERVING %s after %.1f s", config.role, config.model, time.perf_counter() - t0)

    thread = threading.Thread(target=run, name=f"{config.role}-loader", daemon=True)
    thread.start()
    return thread


def create_server(role: WorkerRole, config: WorkerConfig, engine: WorkerEngine | None = None,
                  telemetry: Telemetry | None = None) -> tuple[ServerParts, int]:
    """Starts a worker server; with no engine, loads the model in the background
    (health NOT_SERVING and RPCs UNAVAILABLE until it is ready, FAILED_PRECONDITION if it
    cannot be). Returns (parts, port).
    Stopping the parts closes the engine the server loaded (not one it was given)."""
    slot = EngineSlot(engine)
    parts = build_server(config.address, lambda s: role.add_servicer(role.servicer_class(slot), s), [role.service_name],
                         max_workers=config.max_workers, telemetry=telemetry, tls=config.tls,
                         reflection_on=config.reflection, connection=config.connection)
    parts.slot = slot
    if engine is not None:
        engine.instrument(parts.telemetry, config.role)
        parts.set_serving(True)
    else:
        parts.loader = load_in_background(config, role.make_engine, slot, parts)
        parts.on_stop.append(slot.close)
    return parts, parts.port


def main(role: WorkerRole, argv: list[str] | None = None, config: WorkerConfig | None = None) -> None:
    """`python -m draft_service` / `python -m target_service` (which parse the flags first: config)."""
    config = config or WorkerConfig.from_args(role.name, argv, default_port=role.default_port)
    logging.basicConfig(level=config.log_level.upper(), format=f"%(asctime)s {role.name} %(levelname)s %(message)s")
    parts, port = create_server(role, config, telemetry=Telemetry.from_env(f"specdec-{role.name}"))
    log.info("%s worker on port %d, loading %s", role.name, port, config.model)

    def drain():
        try:
            engine = parts.slot.get()
        except (Unavailable, FailedPrecondition):
            return  # still loading, or failed to: nothing to hand back
        left = engine.drain(config.drain_timeout_s)
        if left:
            log.warning("%d sessions still open after %.0f s; their orchestrators move them", left,
                        config.drain_timeout_s)

    serve_until_signalled(parts.server, parts, drain=drain)
