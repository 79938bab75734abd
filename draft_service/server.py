"""Builds and runs the draft worker's gRPC server: create_server(config) -> (parts, port), main()."""

from __future__ import annotations

from draft_service.engine import DraftEngine
from draft_service.servicer import DraftServicer
from specdec.config import WorkerConfig
from specdec.modeling import load_model
from specdec.telemetry import Telemetry
from specdec.v1 import draft_pb2, draft_pb2_grpc
from specdec.worker_servicer import create_worker_server, run_worker

DEFAULT_PORT = 50052
SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftWorker"].full_name


def make_engine(config: WorkerConfig) -> DraftEngine:
    loaded = load_model(config.model, device=config.device, dtype=config.dtype, device_map=config.device_map,
                        quantization=config.quantization, head_rows=config.draft_vocab)
    return DraftEngine(loaded, max_sessions=config.max_sessions, max_cached_tokens=config.max_cached_tokens,
                       session_ttl_s=config.session_ttl_s)


def create_server(config: WorkerConfig, engine: DraftEngine | None = None, telemetry: Telemetry | None = None):
    return create_worker_server(
        config,
        engine,
        make_engine,
        lambda slot, server: draft_pb2_grpc.add_DraftWorkerServicer_to_server(DraftServicer(slot), server),
        SERVICE_NAME,
        telemetry,
    )


def main(argv: list[str] | None = None) -> None:
    run_worker(create_server, "draft", argv, DEFAULT_PORT)
