"""Builds a gRPC server the way all three services need it.

Every server gets the error interceptor (ServiceError -> status), the standard health service
(NOT_SERVING until the role says it is ready), reflection, and deliberate message-size limits.
"""

from __future__ import annotations

import logging
import signal
import threading
from concurrent import futures
from dataclasses import dataclass, field
from typing import Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec.errors import ErrorInterceptor
from specdec.lifetime import supervisor_gone
from specdec.protocol import message_options
from specdec.security import ServerTls, bind
from specdec.telemetry import Telemetry
from specdec.wire import WORKER_MAX_MESSAGE_BYTES

log = logging.getLogger(__name__)

HEALTH_RESERVE = 4  # handler threads kept free of long calls
KEEPALIVE_TIMEOUT_S = 20.0
# a client may ping this often, calls or not, and is never told off for it: the orchestrator pings
# its workers every --worker-keepalive seconds (2 s by default) to find a cut link in seconds
PING_MIN_S = 1.0


def connection_options(keepalive_s: float, max_age_s: float, max_age_grace_s: float) -> list[tuple[str, int]]:
    """gRPC server options: let clients ping every PING_MIN_S; ping idle connections every
    keepalive_s and drop peers that do not answer (a client that vanished without closing stops
    holding its calls), and ask clients to reconnect after max_age_s, so a long-lived client moves
    to new replicas. 0 turns either off."""
    options = [("grpc.keepalive_permit_without_calls", 1),
               ("grpc.http2.min_recv_ping_interval_without_data_ms", int(PING_MIN_S * 1000)),
               ("grpc.http2.max_ping_strikes", 0)]
    if keepalive_s > 0:
        options += [("grpc.keepalive_time_ms", int(keepalive_s * 1000)),
                    ("grpc.keepalive_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000))]
    if max_age_s > 0:
        options += [("grpc.max_connection_age_ms", int(max_age_s * 1000)),
                    ("grpc.max_connection_age_grace_ms", int(max_age_grace_s * 1000))]
    return options


@dataclass
class ServerParts:
    server: grpc.Server
    port: int
    health: health.HealthServicer

    def set_serving(self, serving: bool) -> None:
        self.serving = serving
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        self.health.set("", status)
        for name in self.service_names:
            self.health.set(name, status)

    service_names: tuple[str, ...] = ()
    serving: bool = False  # what health reports
    loader: object = None  # the model-loading thread, when the server loads its own model
    telemetry: Telemetry | None = None
    on_stop: list = field(default_factory=list)  # callables run after the server stops

    def stop(self, grace_s: float | None = None) -> None:
        """Stops serving, runs on_stop, then flushes telemetry (spans of the last calls included)."""
        self.server.stop(grace_s).wait()
        for fn in self.on_stop:
            fn()
        if self.telemetry is not None:
            self.telemetry.shutdown()


def build_server(
    address: str,
    register: Callable[[grpc.Server], None],
    service_names: list[str],
    *,
    max_workers: int = 16,
    max_message_bytes: int = WORKER_MAX_MESSAGE_BYTES,
    telemetry: Telemetry | None = None,
    tls: ServerTls | None = None,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    reflection_on: bool = True,
    connection: Sequence[tuple[str, int]] = (),
) -> ServerParts:
    """Binds (TLS when configured) and starts a server; health says NOT_SERVING until
    set_serving(True). interceptors run inside tracing and outside error mapping (e.g. auth)."""
    telemetry = telemetry or Telemetry.off()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        # tracing outermost, so its server span sees the status the error interceptor sets
        interceptors=[*telemetry.server_interceptors(), *interceptors, ErrorInterceptor()],
        options=[*message_options(max_message_bytes), *connection],
        # beyond this, calls get RESOURCE_EXHAUSTED instead of queueing, so the pool always has
        # threads left for health checks
        maximum_concurrent_rpcs=max(1, max_workers - HEALTH_RESERVE),
    )
    register(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if reflection_on:
        reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = bind(server, address, tls)
    if port == 0:
        raise RuntimeError(f"could not bind {address}")
    server.start()
    parts = ServerParts(server, port, health_servicer, tuple(service_names), telemetry=telemetry)
    parts.set_serving(False)
    log.info("listening on port %d", port)
    return parts


def serve_until_signalled(server: grpc.Server, parts: ServerParts | None = None, grace_s: float = 5.0,
                          drain: Callable[[], None] | None = None) -> None:
    """Blocks until SIGINT/SIGTERM, or until the `specdec serve` that started this process is
    gone; then reports NOT_SERVING, runs drain (a worker lets its sessions finish), and stops,
    letting calls in flight end within grace_s. It waits a second at a time: a signal the kernel
    hands to another thread runs its Python handler only once this (main) thread is back in Python."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        if supervisor_gone() and not stop.is_set():
            log.warning("specdec serve, which started this process, is gone and no signal came: stopping")
            break
    log.info("stopping: NOT_SERVING, draining")
    if parts is not None:
        parts.set_serving(False)
        if drain is not None:
            drain()
        parts.stop(grace_s)
    else:
        server.stop(grace_s).wait()
    log.info("stopped")
