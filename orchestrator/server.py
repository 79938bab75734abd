"""Builds and runs the orchestrator's gRPC server: create_server(config) -> (parts, port), main().

Without a ready decoder, a background thread builds the worker pools (orchestrator/pool.py),
waits until a target (and, when configured, a draft) serves a model that pairs, fetches the
target's tokenizer, then flips health to SERVING. The pools keep discovering and polling workers
from then on. Until then every request gets UNAVAILABLE naming the workers waited for and what
each is doing. A draft pool that only ever offered mismatched models is refused for good: every
request gets FAILED_PRECONDITION naming both models; so is a target pool whose every worker failed
to load its model, naming each and why. A draft pool whose every worker failed to load is left
out (logged at ERROR): requests run as with every draft down (target passes, suffix drafts).
"""

from __future__ import annotations

import logging
import threading
import time

import torch
from opentelemetry import metrics

from orchestrator.admission import Admission
from orchestrator.config import OrchestratorConfig
from orchestrator.gamma import GammaPolicy
from orchestrator.http.app import FrontDoor
from orchestrator.http.transport import HttpServer
from orchestrator.proposers.ngram import NGRAM_MODEL, NgramDraft
from orchestrator.pool import LoadFailed, WorkerPool, pair_pools, parse_entries
from orchestrator.remote import RemoteDraft, RemoteTarget
from orchestrator.decoder import SpeculativeDecoder
from orchestrator.servicer import DecoderSlot, OrchestratorServicer
from specdec.errors import FailedPrecondition, ServiceError
from specdec.grammar import GrammarLimits, compiler_ready
from specdec.grpc_server import HEALTH_RESERVE, ServerParts, build_server, serve_until_signalled
from specdec.protocol import CLIENT_MAX_MESSAGE_BYTES, RequestLimits
from specdec.security import BearerTokenInterceptor, TokenSet, read_tokens
from specdec.telemetry import Telemetry
from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = orchestrator_pb2.DESCRIPTOR.services_by_name["Orchestrator"].full_name


def build_pools(config: OrchestratorConfig, telemetry: Telemetry) -> tuple[WorkerPool, WorkerPool | None]:
    """The target and draft pools, paired and monitoring (they connect lazily, so this never blocks)."""
    def connect(cls, **kwargs):
        return lambda address, server_name=None: cls(address, timeout_s=config.worker_timeout_s, telemetry=telemetry,
                                                     tls=config.worker_tls, server_name=server_name,
                                                     keepalive_s=config.worker_keepalive_s, **kwargs)

    targets = WorkerPool("target", parse_entries(config.target), connect=connect(RemoteTarget),
                         poll_s=config.poll_s, resolve_s=config.resolve_s)
    drafts = None
    if config.draft == NGRAM_MODEL:  # a model-free draft in this process (orchestrator/proposers/ngram.py)
        drafts = WorkerPool.fixed("draft", [NgramDraft()])
    elif config.draft:
        drafts = WorkerPool("draft", parse_entries(config.draft),
                            connect=connect(RemoteDraft, round_timeout_s=config.draft_timeout_s),
                            poll_s=config.poll_s, resolve_s=config.resolve_s)
    pair_pools(targets, drafts)
    for pool in (targets, drafts):
        if pool is not None:
            pool.start()
    return targets, drafts


def connect(config: OrchestratorConfig, slot: DecoderSlot, telemetry: Telemetry) -> SpeculativeDecoder:
    """Waits for the pools to have a serving member each; returns the decoder (raises
    FailedPrecondition when every draft offered so far is a mismatch, or every target failed to
    load its model). A draft pool whose every worker failed to load is left out (slot.without_drafts)."""
    targets, drafts = slot.pools
    slot.waiting_on = targets
    targets.wait_for_member(config.startup_timeout_s)
    if drafts is not None:
        slot.waiting_on = drafts
        try:
            drafts.wait_for_member(config.startup_timeout_s)
        except LoadFailed as exc:
            # the draft is optional: a broken one must not keep the target from serving. The pool
            # goes on polling (ListWorkers shows it), but this decoder never drafts with it
            slot.without_drafts, drafts = exc.message, None
            log.error("serving without drafts (target passes and suffix drafts only): %s; restart the "
                      "orchestrator once a draft worker loads its model", exc.message)
    return SpeculativeDecoder(targets, drafts, prefill=config.prefill, draft_ahead=config.draft_ahead,
                              telemetry=telemetry, drafts_left_out=bool(slot.without_drafts),
                              gamma_policy=GammaPolicy(adaptive=config.gamma_policy != "fixed"),
                              limits=RequestLimits(config.max_new_tokens, config.max_prompt_tokens),
                              draft_options=config.draft_options, sampling=config.sampling,
                              suffix_cache_tokens=config.suffix_cache_tokens if config.suffix_drafts else None,
                              grammar_limits=GrammarLimits.from_config(config))


def _pair_in_background(config: OrchestratorConfig, slot: DecoderSlot, parts: ServerParts) -> threading.Thread:
    def run():
        while True:
            try:
                slot.decoder = connect(config, slot, parts.telemetry)
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
            compiler_ready(slot.decoder)  # SERVING means ready at full speed
            parts.set_serving(True)
            log.info("SERVING: target %s, draft %s", slot.decoder.target_info.model_name,
                     slot.decoder.draft_info.model_name if slot.decoder.draft_info else None)
            return

    thread = threading.Thread(target=run, name="pair-workers", daemon=True)
    thread.start()
    return thread


def _auth(config: OrchestratorConfig) -> list:
    tokens = read_tokens(config.auth_token_file)
    if not tokens:
        return []
    # an admin may do what a client may; both files are followed (tokens change without a restart)
    tokens = TokenSet(files=(config.auth_token_file, config.admin_token_file))
    if not config.tls.enabled:
        log.warning("bearer tokens over plaintext can be read on the wire: serve TLS (--tls-cert) as well")
    return [BearerTokenInterceptor(tokens, f"/{SERVICE_NAME}/")]


def _queue_gauges(meter, admission: Admission) -> None:
    meter.create_observable_gauge(
        "specdec.orchestrator.queue.depth", unit="{request}", description="Requests waiting for a turn",
        callbacks=[lambda options: [metrics.Observation(admission.queued)]])
    meter.create_observable_gauge(
        "specdec.orchestrator.requests.running", unit="{request}", description="Requests decoding now",
        callbacks=[lambda options: [metrics.Observation(admission.running)]])


def create_server(config: OrchestratorConfig, decoder: SpeculativeDecoder | None = None,
                  telemetry: Telemetry | None = None) -> tuple[ServerParts, int]:
    slot = DecoderSlot(decoder)
    admission = Admission(config.max_running, config.max_queued, config.max_per_client)
    parts = build_server(
        config.address,
        lambda s: orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(
            OrchestratorServicer(slot, admission, TokenSet(files=(config.admin_token_file,)),
                                 config.request_timeout_s), s),
        [SERVICE_NAME],
        # a thread for every running and every queued request, and some for health and ListWorkers:
        # the admission queue, not gRPC, says RESOURCE_EXHAUSTED when the server is full
        max_workers=config.max_running + config.max_queued + 2 * HEALTH_RESERVE,
        max_message_bytes=CLIENT_MAX_MESSAGE_BYTES,
        telemetry=telemetry,
        tls=config.tls,
        interceptors=_auth(config),
        reflection_on=config.reflection,
        connection=config.connection,
    )
    parts.slot = slot
    parts.admission = admission
    parts.http = None
    if config.http_port is not None:  # the OpenAI-compatible door on the same decoder and queue
        tokens = TokenSet(files=(config.auth_token_file, config.admin_token_file)) if config.auth_token_file \
            else TokenSet()
        parts.http = HttpServer(FrontDoor(slot, admission, tokens=tokens,
                                          served_model_name=config.served_model_name,
                                          serving=lambda: parts.serving, request_timeout_s=config.request_timeout_s,
                                          max_body_bytes=config.http_max_body_bytes,
                                          body_timeout_s=config.http_body_timeout_s,
                                          metrics_registry=parts.telemetry.registry),
                                config.host, config.http_port, config.tls, config.log_level,
                                head_timeout_s=config.http_head_timeout_s,
                                max_connections=config.http_max_connections).start()
        parts.on_stop.insert(0, lambda: parts.http.stop(config.drain_timeout_s))
    _queue_gauges(parts.telemetry.meter, admission)
    if decoder is not None:
        slot.pools = (decoder.targets, decoder.drafts)
        parts.set_serving(True)
    else:
        slot.pools = build_pools(config, parts.telemetry)
        # the step loops stop (and the policy's measurements are logged) before the pools
        parts.on_stop += [lambda: slot.decoder is not None and slot.decoder.close(),
                          *(pool.stop for pool in slot.pools if pool is not None)]
        parts.loader = _pair_in_background(config, slot, parts)
    return parts, parts.port


def main(argv: list[str] | None = None, config: OrchestratorConfig | None = None) -> None:
    """`python -m orchestrator` (which parses the flags first: config)."""
    config = config or OrchestratorConfig.from_args(argv)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s orchestrator %(levelname)s %(message)s")
    # the orchestrator's tensor work (a residual over the vocabulary now and then) is small; one
    # thread means no OpenMP team spinning on cores that co-located workers need
    torch.set_num_threads(config.torch_threads)
    # the HTTP door serves Prometheus text at /metrics, as vLLM's does: its metrics are kept even
    # where no OTEL_METRICS_EXPORTER asks for them
    parts, port = create_server(config, telemetry=Telemetry.from_env("specdec-orchestrator",
                                                                     scrape=config.http_port is not None))
    log.info("orchestrator on port %d%s; target %s, draft %s", port,
             f", OpenAI-compatible HTTP on port {parts.http.port}" if parts.http else "", config.target, config.draft)
    serve_until_signalled(parts.server, parts, grace_s=config.drain_timeout_s)
