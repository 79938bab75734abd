"""Builds and runs the orchestrator's gRPC server: create_server(config) -> (parts, port), main().

Without a ready decoder, a background thread waits for both workers to report SERVING, checks
that their vocabularies agree, fetches the target's tokenizer, then flips health to SERVING.
A mismatched pair is refused for good: every request gets FAILED_PRECONDITION naming both models.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from orchestrator.config import OrchestratorConfig
from orchestrator.remote import RemoteDraft, RemoteTarget
from orchestrator.servicer import DecoderSlot, OrchestratorServicer
from orchestrator.speculative import SpeculativeDecoder
from specdec.errors import FailedPrecondition, ServiceError
from specdec.grpc_server import CLIENT_MAX_MESSAGE_BYTES, ServerParts, build_server
from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from specdec.worker_servicer import serve_until_signalled

log = logging.getLogger(__name__)
SERVICE_NAME = orchestrator_pb2.DESCRIPTOR.services_by_name["Orchestrator"].full_name


def connect(config: OrchestratorConfig, slot: DecoderSlot) -> SpeculativeDecoder:
    """Waits for the workers, pairs them, returns the decoder (raises FailedPrecondition on a mismatch)."""
    target = RemoteTarget(config.target, timeout_s=config.worker_timeout_s)
    draft = RemoteDraft(config.draft, timeout_s=config.worker_timeout_s) if config.draft else None
    for worker in (target, draft):
        if worker is not None:
            slot.waiting_for = f"{worker.peer} to load its model"
            worker.wait_until_serving(config.startup_timeout_s)
    return SpeculativeDecoder(target, draft, parallel_prefill=config.parallel_prefill)


def _pair_in_background(config: OrchestratorConfig, slot: DecoderSlot, parts: ServerParts) -> threading.Thread:
    def run():
        while True:
            try:
                slot.decoder = connect(config, slot)
            except FailedPrecondition as exc:
                slot.error = exc
                log.error("refusing to serve: %s", exc)
                return
            except ServiceError as exc:
                log.warning("workers not ready (%s); retrying", exc)
                time.sleep(1.0)
                continue
            except Exception as exc:  # noqa: BLE001 - e.g. the target's tokenizer cannot be loaded here
                slot.error = FailedPrecondition(f"cannot pair with the workers: {type(exc).__name__}: {exc}")
                log.exception("refusing to serve")
                return
            parts.set_serving(True)
            log.info("SERVING: target %s, draft %s", slot.decoder.target_info.model_name,
                     slot.decoder.draft_info.model_name if slot.decoder.draft_info else None)
            return

    thread = threading.Thread(target=run, name="pair-workers", daemon=True)
    thread.start()
    return thread


def create_server(config: OrchestratorConfig, decoder: SpeculativeDecoder | None = None) -> tuple[ServerParts, int]:
    slot = DecoderSlot(decoder)
    parts = build_server(
        config.address,
        lambda s: orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(OrchestratorServicer(slot), s),
        [SERVICE_NAME],
        max_workers=config.max_workers,
        max_message_bytes=CLIENT_MAX_MESSAGE_BYTES,
    )
    parts.slot = slot
    if decoder is not None:
        parts.set_serving(True)
    else:
        parts.loader = _pair_in_background(config, slot, parts)
    return parts, parts.port


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s orchestrator %(levelname)s %(message)s")
    config = OrchestratorConfig.from_args(argv)
    # the orchestrator's tensor work (a residual over the vocabulary now and then) is small; one
    # thread means no OpenMP team spinning on cores that co-located workers need
    torch.set_num_threads(config.torch_threads)
    parts, port = create_server(config)
    log.info("orchestrator on port %d; target %s, draft %s", port, config.target, config.draft)
    serve_until_signalled(parts.server, parts)
