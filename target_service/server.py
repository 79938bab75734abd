"""Builds and runs the target worker's gRPC server: create_server(config) -> (parts, port), main()."""

from __future__ import annotations

from target_service.engine import TargetEngine
from target_service.servicer import TargetServicer
from specdec.config import WorkerConfig
from specdec.modeling import load_model
from specdec.telemetry import Telemetry
from specdec.v1 import target_pb2, target_pb2_grpc
from specdec.worker_servicer import create_worker_server, run_worker

DEFAULT_PORT = 50051
SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["TargetWorker"].full_name


def make_engine(config: WorkerConfig) -> TargetEngine:
    loaded = load_model(config.model, device=config.device, dtype=config.dtype, device_map=config.device_map,
                        quantization=config.quantization)
    return TargetEngine(loaded, max_sessions=config.max_sessions, max_cached_tokens=config.max_cached_tokens,
                       session_ttl_s=config.session_ttl_s)


def create_server(config: WorkerConfig, engine: TargetEngine | None = None, telemetry: Telemetry | None = None):
    return create_worker_server(
        config,
        engine,
        make_engine,
        lambda slot, server: target_pb2_grpc.add_TargetWorkerServicer_to_server(TargetServicer(slot), server),
        SERVICE_NAME,
        telemetry,
    )


def main(argv: list[str] | None = None) -> None:
    run_worker(create_server, "target", argv, DEFAULT_PORT)
