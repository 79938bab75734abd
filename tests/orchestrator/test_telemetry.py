"""Tracing and metrics across three real servers, read back through in-memory exporters.

One Generate must give one trace with spans from all three services in the right parent/child
structure and with the attributes the README promises; metrics must agree with the stats the
client gets; the Prometheus endpoint must serve them in the exposition format.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path
from collections import defaultdict

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from prometheus_client.parser import text_string_to_metric_families

import grpc
from draft_service.engine import DraftEngine
from orchestrator.client import Client
from specdec import telemetry as t
from specdec.modeling import load_model
from specdec.telemetry import Telemetry, _metric_readers
from target_service.engine import TargetEngine
from tests.support.servers import start_stack, stop_stack

SERVICES = ("specdec-orchestrator", "specdec-target", "specdec-draft")


@pytest.fixture(scope="module")
def traced(model_dirs):
    """Three real servers, each with its own telemetry feeding one span exporter."""
    spans = InMemorySpanExporter()
    readers = {name: InMemoryMetricReader() for name in SERVICES}
    prom_readers, prometheus = _metric_readers({
        "OTEL_METRICS_EXPORTER": "prometheus", "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1",
        "OTEL_EXPORTER_PROMETHEUS_PORT": "0"})
    tel = {
        name: Telemetry.create(name, span_exporters=[spans], batch=False,
                               metric_readers=[readers[name], *(prom_readers if name == SERVICES[0] else [])],
                               prometheus=prometheus if name == SERVICES[0] else None)
        for name in SERVICES
    }
    # engines of their own: instrumenting the session-wide ones would reroute other tests' spans
    target_engine = TargetEngine(load_model(str(model_dirs["target"]), dtype="float64"))
    draft_engine = DraftEngine(load_model(str(model_dirs["draft"]), dtype="float64"))
    # both workers prefill at the request's start (as on hosts of their own): their prefill spans show
    stack = start_stack(target_engine, draft_engine, prefill="parallel",
                        telemetry={name.removeprefix("specdec-"): tel[name] for name in SERVICES})
    with Client(stack["address"], timeout_s=120) as client:
        yield {"spans": spans, "readers": readers, "client": client, "telemetry": tel,
               "ports": stack["ports"], "engines": (target_engine, draft_engine)}
    stop_stack(stack)


def _finished_trace(spans: InMemorySpanExporter, expect_services=SERVICES, timeout_s=10.0):
    """The spans of the one trace, once all three services have ended theirs (a server span can
    end just after the client got its answer)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = spans.get_finished_spans()
        services = {s.resource.attributes["service.name"] for s in got}
        closes = [s for s in got if s.name.endswith("/CloseSession") and s.kind == SpanKind.SERVER]
        if set(expect_services) <= services and len(closes) >= len(expect_services) - 1 or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def _children(spans):
    by_parent = defaultdict(list)
    for s in spans:
        by_parent[s.parent.span_id if s.parent else None].append(s)
    for kids in by_parent.values():
        kids.sort(key=lambda s: s.start_time)
    return by_parent


def _one(spans, **where):
    found = [s for s in spans if all(getattr(s, k) == v for k, v in where.items())]
    assert len(found) == 1, (where, [s.name for s in found])
    return found[0]


def test_one_request_is_one_trace_across_three_services(traced):
    spans, client = traced["spans"], traced["client"]
    spans.clear()
    r = client.generate(prompt="def fib(n):", max_new_tokens=12, temperature=0, gamma=3, top_p=0.9)
    got = _finished_trace(spans)
    stats = r.stats

    assert len({s.context.trace_id for s in got}) == 1, "every span belongs to the one trace"
    assert {s.resource.attributes["service.name"] for s in got} == set(SERVICES)
    kids = _children(got)

    root = _one(got, parent=None)
    assert (root.name, root.kind) == ("/specdec.v1.Orchestrator/Generate", SpanKind.SERVER)
    (request,) = kids[root.context.span_id]
    a = request.attributes
    assert request.name == "text_completion tiny-target"
    assert a[t.GEN_AI_OPERATION] == "text_completion" and a[t.GEN_AI_REQUEST_MODEL] == "tiny-target"
    assert a[t.GEN_AI_INPUT_TOKENS] == stats["prompt_tokens"] and a[t.GEN_AI_OUTPUT_TOKENS] == len(r.token_ids)
    assert a[t.GEN_AI_TEMPERATURE] == 0 and a[t.GEN_AI_TOP_P] == pytest.approx(0.9) and a[t.GEN_AI_MAX_TOKENS] == 12
    assert a[t.GAMMA] == 3 and a[t.DRAFT_MODEL] == "tiny-draft" and a[t.TARGET_MODEL] == "tiny-target"
    assert a[t.ACCEPTANCE_RATE] == pytest.approx(stats["acceptance_rate"])
    session_id = a[t.SESSION_ID]

    stages = [s.name for s in kids[request.context.span_id]]
    assert stages == ["prefill"] + ["round"] * stats["rounds"] + ["close"]
    rounds = [s for s in kids[request.context.span_id] if s.name == "round"]
    assert [s.attributes[t.ROUND] for s in rounds] == list(range(stats["rounds"]))
    assert sum(s.attributes[t.DRAFTED] for s in rounds) == stats["drafted_tokens"]
    assert sum(s.attributes[t.ACCEPTED] for s in rounds) == stats["accepted_tokens"]
    assert sum(s.attributes[t.EMITTED] for s in rounds) == len(r.token_ids)
    assert sum(s.attributes[t.WIRE_BYTES] for s in rounds) == stats["wire_bytes"]
    by_position = [0] * 3
    for s in rounds:
        for i, accepted in enumerate(s.attributes[t.ACCEPTED_BY_POSITION]):
            by_position[i] += accepted
    assert by_position == stats["accepted_by_position"]

    for rnd in rounds:
        gamma = rnd.attributes[t.GAMMA]
        steps = kids[rnd.context.span_id]
        assert [s.name for s in steps] == ["draft", "verify", "rejection_sampling", "rollback"][(gamma == 0):]
        rollback = steps[-1]
        assert rollback.attributes[t.DISCARDED] == gamma - rnd.attributes[t.ACCEPTED]
        verify_client = _one(kids[steps[-3].context.span_id], name="/specdec.v1.TargetWorker/VerifyBatch")
        assert verify_client.kind == SpanKind.CLIENT
        verify_server = _one(kids[verify_client.context.span_id], kind=SpanKind.SERVER)
        assert verify_server.resource.attributes["service.name"] == "specdec-target"
        forwards = [s for s in kids[verify_server.context.span_id] if s.name == "forward"]
        assert len(forwards) == 1 and forwards[0].attributes[t.FORWARD_KIND] == "verify"
        assert forwards[0].attributes[t.FORWARD_TOKENS] >= gamma + 1
        if gamma:
            propose_client = _one(kids[steps[0].context.span_id], name="/specdec.v1.DraftWorker/ProposeBatch")
            propose_server = _one(kids[propose_client.context.span_id], kind=SpanKind.SERVER)
            assert propose_server.resource.attributes["service.name"] == "specdec-draft"
            draft_forwards = [s for s in kids[propose_server.context.span_id] if s.name == "forward"]
            assert len(draft_forwards) == gamma, "one draft forward pass per proposed token"

    # prefill reaches both workers, whose own prefill span carries the session id
    prefill = kids[request.context.span_id][0]
    opens = kids[prefill.context.span_id]
    assert sorted(s.name for s in opens) == ["/specdec.v1.DraftWorker/OpenSession", "/specdec.v1.TargetWorker/OpenSession"]
    for client_span in opens:
        (server_span,) = kids[client_span.context.span_id]
        (worker_prefill,) = [s for s in kids[server_span.context.span_id] if s.name == "prefill"]
        assert worker_prefill.attributes[t.SESSION_ID] == session_id
    # a rejected draft is rolled back by the next call: the worker shows it as a truncate span
    if stats["accepted_tokens"] < stats["drafted_tokens"]:
        assert any(s.name == "truncate" for s in got)


def test_health_checks_and_load_polls_stay_out_of_traces(traced):
    spans = traced["spans"]
    spans.clear()
    for port in traced["ports"]:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    time.sleep(1.5)  # the pools poll every worker's Describe each second
    assert spans.get_finished_spans() == ()


def test_streamed_request_is_traced_the_same_way(traced):
    spans, client = traced["spans"], traced["client"]
    spans.clear()
    chunks = list(client.stream(prompt="hello", max_new_tokens=8, temperature=0.8, seed=3, gamma=2))
    got = _finished_trace(spans)
    root = _one(got, parent=None)
    assert root.name == "/specdec.v1.Orchestrator/GenerateStream"
    (request,) = [s for s in got if s.parent and s.parent.span_id == root.context.span_id]
    assert request.attributes[t.GEN_AI_OUTPUT_TOKENS] == sum(len(c.token_ids) for c in chunks)
    assert len({s.context.trace_id for s in got}) == 1


def test_refused_request_marks_its_span_as_an_error(traced):
    spans, client = traced["spans"], traced["client"]
    spans.clear()
    with pytest.raises(Exception):
        client.generate(prompt="a", gamma=99)
    got = _finished_trace(spans, expect_services=SERVICES[:1], timeout_s=1)
    (request,) = [s for s in got if t.GEN_AI_OPERATION in s.attributes]
    assert not request.status.is_ok and "INVALID_ARGUMENT" in request.status.description
    assert request.attributes[t.STATUS] == grpc.StatusCode.INVALID_ARGUMENT.value[0]


# ---- metrics -------------------------------------------------------------------------------

def _points(reader: InMemoryMetricReader) -> dict:
    """{metric name: {frozenset(attributes): value}}, value = sum for counters, (count, sum)
    for histograms, last value for gauges."""
    out = defaultdict(dict)
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                for p in m.data.data_points:
                    key = frozenset(p.attributes.items())
                    out[m.name][key] = (p.count, p.sum) if hasattr(p, "bucket_counts") else p.value
    return out


def _diff(after: dict, before: dict) -> dict:
    out = defaultdict(dict)
    for name, points in after.items():
        for key, value in points.items():
            old = before.get(name, {}).get(key)
            if isinstance(value, tuple):
                out[name][key] = tuple(a - b for a, b in zip(value, old or (0, 0)))
            else:
                out[name][key] = value - (old or 0)
    return out


def test_metrics_agree_with_returned_stats(traced):
    reader = traced["readers"]["specdec-orchestrator"]
    client = traced["client"]
    before = _points(reader)
    results = [
        client.generate(prompt="def fib(n):", max_new_tokens=14, temperature=0, gamma=4),
        client.generate(prompt="import os", max_new_tokens=10, temperature=1.0, seed=5, gamma=3),
        client.generate(prompt="x = 1", max_new_tokens=6, temperature=0, gamma=0),
    ]
    d = _diff(_points(reader), before)

    drafted = [0] * 4
    accepted = [0] * 4
    for r in results:
        for i, n in enumerate(r.stats["drafted_by_position"]):
            drafted[i] += n
        for i, n in enumerate(r.stats["accepted_by_position"]):
            accepted[i] += n
    by_pos = lambda name: [d[name].get(frozenset({(t.POSITION, i)}), 0) for i in range(4)]  # noqa: E731
    assert by_pos("specdec.drafted_tokens") == drafted
    assert by_pos("specdec.accepted_tokens") == accepted
    rounds = sum(r.stats["rounds"] for r in results)
    assert d["specdec.rounds"][frozenset()] == rounds
    speculative_rounds = drafted[0]  # rounds that drafted at all (the last may not: one token left)
    assert d["specdec.round.accepted_length"][frozenset()] == (speculative_rounds, sum(accepted))
    assert d["specdec.wire_bytes"][frozenset()] == sum(r.stats["wire_bytes"] for r in results)
    tokens = d["gen_ai.server.token.usage"]
    assert tokens[frozenset({(t.GEN_AI_TOKEN_TYPE, "output")})] == sum(len(r.token_ids) for r in results)
    assert tokens[frozenset({(t.GEN_AI_TOKEN_TYPE, "input")})] == sum(r.stats["prompt_tokens"] for r in results)
    assert d["gen_ai.server.time_to_first_token"][frozenset()][0] == 3
    assert d["gen_ai.server.request.duration"][frozenset()][0] == 3
    # one clock from the request's arrival: a request lasts past its first token, a token after it takes time
    assert d["gen_ai.server.request.duration"][frozenset()][1] > d["gen_ai.server.time_to_first_token"][frozenset()][1]
    tpot_count, tpot_sum = d["gen_ai.server.time_per_output_token"][frozenset()]
    assert tpot_count == 3 and tpot_sum > 0
    assert d["specdec.requests"][frozenset({(t.STATUS, 0)})] == 3
    verify_count, verify_sum = d["specdec.stage.duration"][frozenset({(t.STAGE, "verify")})]
    assert verify_count == rounds
    assert verify_sum == pytest.approx(sum(r.stats["verify_s"] for r in results), rel=1e-6)

    # the workers: no session left open, forward passes counted by kind
    target_points = _points(traced["readers"]["specdec-target"])
    assert target_points["specdec.worker.sessions"][frozenset({(t.ROLE, "target")})] == 0
    verify_passes = target_points["specdec.worker.forward.duration"][frozenset({(t.FORWARD_KIND, "verify")})][0]
    assert verify_passes >= rounds


def test_prometheus_endpoint_serves_the_same_numbers(traced):
    client = traced["client"]
    r = client.generate(prompt="def add(a, b):", max_new_tokens=10, temperature=0, gamma=3)
    port = traced["telemetry"]["specdec-orchestrator"].prometheus_port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        body = resp.read().decode()
    families = {f.name: f for f in text_string_to_metric_families(body)}
    drafted = {s.labels["specdec_position"]: s.value for s in families["specdec_drafted_tokens"].samples
               if s.name.endswith("_total")}
    # the in-memory reader of the same provider must agree with what Prometheus scraped
    points = _points(traced["readers"]["specdec-orchestrator"])
    for position, value in drafted.items():
        assert value == points["specdec.drafted_tokens"][frozenset({(t.POSITION, int(position))})]
    assert drafted["0"] >= r.stats["drafted_by_position"][0]
    assert "gen_ai_server_time_to_first_token_seconds_bucket" in body
    assert "specdec_round_accepted_length" in body


DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "dashboards" / "specdec.json"
UNIT_SUFFIXES = {"s": "_seconds", "By": "_bytes"}  # units in braces ({token}) add none


def _prometheus_name(name: str, unit: str) -> str:
    base = name.replace(".", "_")
    suffix = UNIT_SUFFIXES.get(unit, "")
    return base if base.endswith(suffix) else base + suffix


def _exported(readers) -> dict[str, set[str]]:
    """{Prometheus base name: label names} of every metric the readers saw."""
    out = defaultdict(set)
    for reader in readers:
        data = reader.get_metrics_data()
        for rm in data.resource_metrics if data else ():
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    name = _prometheus_name(m.name, m.unit)
                    for p in m.data.data_points:
                        out[name] |= {k.replace(".", "_") for k in p.attributes}
    return out


def test_the_grafana_dashboard_queries_what_the_services_export(traced):
    traced["client"].generate(prompt="def add(a, b):", max_new_tokens=10, temperature=0, gamma=3)
    exported = _exported(traced["readers"].values())
    # the naming rule above is Prometheus' own: every orchestrator metric is in its real scrape
    port = traced["telemetry"]["specdec-orchestrator"].prometheus_port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        scraped = {f.name for f in text_string_to_metric_families(resp.read().decode())}
    orchestrator = _exported([traced["readers"]["specdec-orchestrator"]])
    assert orchestrator and set(orchestrator) <= scraped, set(orchestrator) - scraped

    exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]
    assert len(exprs) >= 10
    for expr in exprs:
        grouped = [x.strip() for group in re.findall(r"by \(([^)]*)\)", expr) for x in group.split(",")]
        matched = re.findall(r"(\w+)=", expr)
        bare = re.sub(r"by \([^)]*\)", "", re.sub(r"\{[^}]*\}", "", expr))
        names = {re.sub(r"_(total|bucket|sum|count)$", "", n)
                 for n in re.findall(r"\b((?:specdec|gen_ai)_[a-z0-9_]+)\b", bare)}
        assert names, expr
        for name in names:
            assert name in exported, f"{name} is not exported (exported: {sorted(exported)})"
            labels = {x for x in grouped + matched if x != "le"}
            assert labels <= exported[name] | {"le"}, (expr, labels - exported[name])


# ---- configuration from the environment ----------------------------------------------------

def test_nothing_set_means_off_with_no_interceptors():
    tel = Telemetry.from_env("specdec-test", env={})
    assert not tel.tracing and tel.server_interceptors() == []
    channel = object()
    assert tel.instrument_channel(channel) is channel
    assert tel.meter_provider is None


def test_otlp_endpoint_turns_tracing_on_and_service_name_is_honoured():
    tel = Telemetry.from_env("specdec-test", env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1",
                                                  "OTEL_SERVICE_NAME": "my-target", "OTEL_METRICS_EXPORTER": "none"})
    try:
        assert tel.tracing and tel.service_name == "my-target"
        assert tel.tracer_provider.resource.attributes["service.name"] == "my-target"
        assert len(tel.server_interceptors()) == 1 and tel.meter_provider is None
    finally:
        tel.tracer_provider.shutdown()


def test_sdk_disabled_and_unknown_exporters():
    assert not Telemetry.from_env("x", env={"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "console"}).tracing
    with pytest.raises(ValueError, match="OTEL_TRACES_EXPORTER"):
        Telemetry.from_env("x", env={"OTEL_TRACES_EXPORTER": "zipkin-typo"})
    with pytest.raises(ValueError, match="OTEL_METRICS_EXPORTER"):
        Telemetry.from_env("x", env={"OTEL_METRICS_EXPORTER": "statsd"})


def test_timeline_is_drawn_from_a_real_request(traced, tmp_path):
    """The spans a real request produced, written as the console exporter writes them, become a PNG."""
    import subprocess
    import sys

    from specdec_tools.timeline import summarize

    spans, client = traced["spans"], traced["client"]
    spans.clear()
    r = client.generate(prompt="def fib(n):", max_new_tokens=16, temperature=0, gamma=4)
    got = _finished_trace(spans)
    source = tmp_path / "spans.log"
    source.write_text("\n".join(s.to_json() for s in got))
    out = tmp_path / "timeline.png"
    done = subprocess.run([sys.executable, "-m", "specdec_tools.cli", "timeline", str(source), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    from specdec_tools.timeline import load_spans

    summary = summarize(load_spans(str(source)))
    assert (summary.rounds, summary.output_tokens) == (r.stats["rounds"], len(r.token_ids))
    assert (summary.drafted_tokens, summary.accepted_tokens) == (r.stats["drafted_tokens"], r.stats["accepted_tokens"])
    assert summary.missing_worker_spans == 0 and summary.draft_compute_s > 0 and summary.verify_compute_s > 0
