"""OpenTelemetry wiring for all three services: providers, exporters, gRPC interceptors, names.

Everything telemetry lives here: each server builds one `Telemetry` from the standard OTEL_*
variables (or from explicit exporters in tests) and passes it on; nothing touches OTel's global
providers, so three services in one process (the tests) keep their own service names.

Environment (the OpenTelemetry SDK's own variables):
  OTEL_SDK_DISABLED=true              everything off
  OTEL_SERVICE_NAME                   default specdec-orchestrator / specdec-target / specdec-draft
  OTEL_TRACES_EXPORTER=otlp,console   or none; default otlp when an OTLP endpoint is set, else none
  OTEL_METRICS_EXPORTER=otlp,prometheus,console
                                      same default rule
  OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_PROTOCOL=grpc|http/protobuf (default grpc)
  OTEL_EXPORTER_PROMETHEUS_HOST / _PORT   where /metrics is served (default localhost:9464)
  OTEL_TRACES_SAMPLER, OTEL_BSP_*, OTEL_METRIC_EXPORT_INTERVAL, OTEL_RESOURCE_ATTRIBUTES
Off (the default with nothing set) means no SDK provider and no interceptors: the API's no-op
tracer and meter, which cost a function call each.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.instrumentation.grpc import client_interceptor, filters, server_interceptor
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter

log = logging.getLogger(__name__)

INSTRUMENTATION_SCOPE = "specdec"

# ---- attribute names (GenAI semantic conventions where one exists, specdec.* otherwise) -------
GEN_AI_OPERATION = "gen_ai.operation.name"
GEN_AI_PROVIDER = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_TOP_P = "gen_ai.request.top_p"
GEN_AI_TOP_K = "gen_ai.request.top_k"
GEN_AI_SEED = "gen_ai.request.seed"
GEN_AI_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_TOKEN_TYPE = "gen_ai.token.type"

SESSION_ID = "specdec.session_id"
GAMMA = "specdec.gamma"
ROUND = "specdec.round"
ROUNDS = "specdec.rounds"
DRAFTED = "specdec.drafted_tokens"
ACCEPTED = "specdec.accepted_tokens"
EMITTED = "specdec.emitted_tokens"
ACCEPTED_BY_POSITION = "specdec.accepted_by_position"  # per round: 1/0 for each draft position
ACCEPTANCE_RATE = "specdec.acceptance_rate"
WIRE_BYTES = "specdec.wire_bytes"
POSITION = "specdec.position"
STAGE = "specdec.stage"
ARM = "specdec.arm"  # a step drafted ("draft") or not ("plain"): orchestrator/gamma.py
OUTCOME = "specdec.outcome"  # a round drafted ahead: its drafts all made in time ("hit") or not ("miss")
EXPLORED = "specdec.explored"  # the step explored the arm not running
ROLE = "specdec.role"
TARGET_ADDRESS = "specdec.target.address"
DRAFT_ADDRESS = "specdec.draft.address"
TARGET_MODEL = "specdec.target.model"
DRAFT_MODEL = "specdec.draft.model"
TARGET_LENGTH = "specdec.target.length"
DRAFT_LENGTH = "specdec.draft.length"
DISCARDED = "specdec.rollback.discarded_tokens"
FORWARD_TOKENS = "specdec.forward.tokens"
FORWARD_KIND = "specdec.forward.kind"  # prefill, propose or verify
PREFIX_CACHED = "specdec.prefix.cached_tokens"  # prompt tokens a new session copied from the prefix cache
BATCH_ROWS = "specdec.batch.rows"  # tokens of all sessions in the pass this forward ran in
BATCH_SESSIONS = "specdec.batch.sessions"  # sessions in that pass
TRUNCATE_FROM = "specdec.truncate.from"
TRUNCATE_TO = "specdec.truncate.to"
FALLBACK = "specdec.fallback"
STATUS = "rpc.grpc.status_code"

# latency buckets in seconds: a tiny model's step is ~1 ms, a CPU prefill can take a minute
ROWS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

# gRPC calls that are polled, not requested: tracing them would bury the requests
_POLLED = filters.any_of(filters.health_check(), filters.method_name("Describe"),
                         filters.service_prefix("grpc.reflection"))
_TRACED = filters.negate(_POLLED)


def _exporter_names(env: Mapping[str, str], kind: str) -> list[str]:
    raw = env.get(f"OTEL_{kind}_EXPORTER")
    if raw is None:  # the SDK's default is otlp; we default to it only where an endpoint is set
        has_endpoint = env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get(f"OTEL_EXPORTER_OTLP_{kind}_ENDPOINT")
        raw = "otlp" if has_endpoint else "none"
    names = [n.strip().lower() for n in raw.split(",") if n.strip()]
    return [n for n in names if n != "none"]


def _otlp_protocol(env: Mapping[str, str], kind: str) -> str:
    return env.get(f"OTEL_EXPORTER_OTLP_{kind}_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"


def _span_exporters(env: Mapping[str, str]) -> list[SpanExporter]:
    exporters = []
    for name in _exporter_names(env, "TRACES"):
        if name == "otlp":
            if _otlp_protocol(env, "TRACES") == "grpc":
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            else:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            exporters.append(OTLPSpanExporter())
        elif name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            exporters.append(ConsoleSpanExporter())
        else:
            raise ValueError(f"OTEL_TRACES_EXPORTER: unknown exporter {name!r} (use otlp, console or none)")
    return exporters


def _prometheus_reader() -> tuple[MetricReader, object]:
    """A Prometheus reader on a registry of its own (several services in one process must not
    share one), and that registry."""
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry(auto_describe=True)
    return PrometheusMetricReader(registry=registry), registry


def _metric_readers(env: Mapping[str, str]) -> tuple[list[MetricReader], dict]:
    """Returns the readers and, when Prometheus is on, its registry and bind address."""
    readers, prometheus = [], {}
    for name in _exporter_names(env, "METRICS"):
        if name == "otlp":
            if _otlp_protocol(env, "METRICS") == "grpc":
                from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
            else:
                from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
            readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
        elif name == "console":
            from opentelemetry.sdk.metrics.export import ConsoleMetricExporter

            readers.append(PeriodicExportingMetricReader(ConsoleMetricExporter()))
        elif name == "prometheus":
            reader, registry = _prometheus_reader()
            readers.append(reader)
            prometheus = {
                "registry": registry,
                "host": env.get("OTEL_EXPORTER_PROMETHEUS_HOST", "localhost"),
                "port": int(env.get("OTEL_EXPORTER_PROMETHEUS_PORT", "9464")),
            }
        else:
            raise ValueError(f"OTEL_METRICS_EXPORTER: unknown exporter {name!r} (use otlp, prometheus, console or none)")
    return readers, prometheus


@dataclass
class Telemetry:
    """One service's tracer and meter, and the interceptors that carry trace context over gRPC."""

    service_name: str
    tracer_provider: TracerProvider | None = None  # None: tracing off
    meter_provider: MeterProvider | None = None  # None: metrics off
    prometheus_port: int | None = None  # the bound port of /metrics, when served
    registry: object = field(default=None, repr=False)  # the Prometheus registry of its metrics, if any
    _prometheus_server: object = field(default=None, repr=False)

    def __post_init__(self):
        tp, mp = self.tracer_provider, self.meter_provider
        self.tracer = tp.get_tracer(INSTRUMENTATION_SCOPE) if tp else trace.NoOpTracer()
        self.meter = mp.get_meter(INSTRUMENTATION_SCOPE) if mp else metrics.NoOpMeter(INSTRUMENTATION_SCOPE)

    @property
    def tracing(self) -> bool:
        return self.tracer_provider is not None

    @classmethod
    def off(cls, service_name: str = "specdec") -> "Telemetry":
        return cls(service_name)

    @classmethod
    def create(
        cls,
        service_name: str,
        *,
        span_exporters: Sequence[SpanExporter] = (),
        metric_readers: Sequence[MetricReader] = (),
        batch: bool = True,
        prometheus: dict | None = None,
        scrape: bool = False,
    ) -> "Telemetry":
        """Providers for these exporters and readers (tests pass in-memory ones, batch=False).
        scrape: keep the metrics in a Prometheus registry (Telemetry.registry) even where no
        Prometheus port is configured, for a server that serves them itself (the HTTP door's
        /metrics)."""
        resource = Resource.create({
            "service.name": service_name,
            "service.instance.id": f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}",
        })
        tp = None
        if span_exporters:
            tp = TracerProvider(resource=resource)
            for exporter in span_exporters:
                tp.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
        readers, registry = list(metric_readers), (prometheus or {}).get("registry")
        if scrape and registry is None:
            reader, registry = _prometheus_reader()
            readers.append(reader)
        mp = MeterProvider(resource=resource, metric_readers=readers) if readers else None
        telemetry = cls(service_name, tp, mp, registry=registry)
        if prometheus:
            from prometheus_client import start_http_server

            server, _ = start_http_server(prometheus["port"], addr=prometheus["host"], registry=prometheus["registry"])
            telemetry._prometheus_server = server
            telemetry.prometheus_port = server.server_port
            log.info("Prometheus metrics on http://%s:%d/metrics", prometheus["host"], telemetry.prometheus_port)
        return telemetry

    @classmethod
    def from_env(cls, default_service_name: str, env: Mapping[str, str] | None = None,
                 scrape: bool = False) -> "Telemetry":
        env = os.environ if env is None else env
        name = env.get("OTEL_SERVICE_NAME") or default_service_name
        if env.get("OTEL_SDK_DISABLED", "").lower() == "true":
            return cls.off(name)
        readers, prometheus = _metric_readers(env)
        return cls.create(name, span_exporters=_span_exporters(env), metric_readers=readers, prometheus=prometheus,
                          scrape=scrape)

    def server_interceptors(self) -> list:
        if not self.tracing:
            return []
        return [server_interceptor(tracer_provider=self.tracer_provider, filter_=_TRACED)]

    def instrument_channel(self, channel):
        """The channel with a client span per call and the trace context in its metadata."""
        if not self.tracing:
            return channel
        from opentelemetry.instrumentation.grpc.grpcext import intercept_channel

        return intercept_channel(channel, client_interceptor(tracer_provider=self.tracer_provider, filter_=_TRACED))

    def shutdown(self) -> None:
        """Flushes what is buffered; call when the server stops."""
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()
        if self.meter_provider is not None:
            self.meter_provider.shutdown()
        if self._prometheus_server is not None:
            self._prometheus_server.shutdown()
            self._prometheus_server.server_close()


def run_in_context(ctx, fn, *args):
    """Runs fn(*args) under an OTel context captured on another thread (thread pools lose it)."""
    token = otel_context.attach(ctx)
    try:
        return fn(*args)
    finally:
        otel_context.detach(token)


current_context = otel_context.get_current
