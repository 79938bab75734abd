"""specdec_tools.timeline: spans made by the real OpenTelemetry SDK (three services, one trace per request)
read back from console-exporter text, Jaeger JSON and a Jaeger URL; the per-stage summary checked
exactly against the durations the test built; the PNG checked as a PNG."""

from __future__ import annotations

import http.server
import json
import socket
import threading
from collections import defaultdict
from dataclasses import dataclass, field

import pytest
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import SpanKind

from specdec_tools import timeline
from specdec_tools.timeline import TimelineError

ORCH, DRAFT, TARGET = "specdec-orchestrator", "specdec-draft", "specdec-target"
EPOCH_US = 1_763_000_000_000_000  # whole microseconds: console output and Jaeger both keep µs
# the first has leading zeros, which Jaeger drops from the ids it prints
TRACE_A, TRACE_B, TRACE_C = 0x0000_0abc_0000_0000_0000_0000_0000_0001, 0xB0B << 100 | 2, 0xC0C << 100 | 3


class FixedIds(IdGenerator):
    """Known trace ids; span ids from a counter shared by all three services, so never clashing."""

    def __init__(self):
        self.trace_ids, self.next_span = [], 0

    def generate_trace_id(self) -> int:
        return self.trace_ids.pop(0)

    def generate_span_id(self) -> int:
        self.next_span += 1
        return self.next_span


class Services:
    """Three tracer providers (orchestrator, draft, target), each exporting to memory."""

    def __init__(self):
        self.ids, self.exporter = FixedIds(), InMemorySpanExporter()
        self.tracers = {}
        for service in (ORCH, DRAFT, TARGET):
            provider = TracerProvider(resource=Resource.create({"service.name": service}), id_generator=self.ids)
            provider.add_span_processor(SimpleSpanProcessor(self.exporter))
            self.tracers[service] = provider.get_tracer("test")

    def start(self, service, name, parent, t_us, kind=SpanKind.INTERNAL, attrs=None):
        context = trace.set_span_in_context(parent) if parent is not None else None
        return self.tracers[service].start_span(name, context=context, kind=kind, attributes=attrs or {},
                                                start_time=(EPOCH_US + t_us) * 1000)

    def spans(self):
        return list(self.exporter.get_finished_spans())


def end(span, t_us):
    span.end(end_time=(EPOCH_US + t_us) * 1000)


@dataclass
class Expected:
    """Totals in integer µs, added up while the spans were built."""

    trace_id: str
    total: int = 0
    stages: dict = field(default_factory=lambda: defaultdict(int))
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_forwards: int = 0
    target_forwards: int = 0
    rpcs: int = 0  # client/server pairs
    ahead_calls: int = 0  # draft_ahead spans (in no stage)
    ahead: int = 0  # their time
    ahead_overlap: int = 0  # the part of it beside a verify
    ahead_forwards: int = 0


def build_request(svc: Services, trace_id: int, t_us: int, *, model="tiny-target", gamma=4,
                  accepted=(4, 1, 0, 3, 2), worker_spans=True, target_skew_us=0, ahead=False) -> Expected:
    """One request as the services emit it, with made-up but distinct durations everywhere. ahead:
    every round but the last sends the next round's Propose beside its verify (a draft_ahead span,
    begun with the verify, the later ones outlasting it), as the step loop does where the draft
    has hardware of its own."""
    svc.ids.trace_ids.append(trace_id)
    exp = Expected(f"{trace_id:032x}")
    st = exp.stages
    t = t_us
    server = svc.start(ORCH, "/specdec.v1.Orchestrator/Generate", None, t, SpanKind.SERVER)
    t += 40
    t_request = t
    request = svc.start(ORCH, f"text_completion {model}", server, t, attrs={
        "gen_ai.operation.name": "text_completion", "gen_ai.request.model": model, "gen_ai.usage.input_tokens": 17,
        "gen_ai.request.temperature": 0.0, "gen_ai.request.max_tokens": 64, "specdec.gamma": gamma,
        "specdec.session_id": f"session-{trace_id:x}"})
    t += 25

    def rpc(parent, worker, method, work, worker_service, k):
        """client span -> server span -> work(server, t) on the worker; returns the new time."""
        nonlocal t
        skew = target_skew_us if worker_service == TARGET else 0
        client = svc.start(ORCH, f"/specdec.v1.{worker}/{method}", parent, t, SpanKind.CLIENT)
        t_client = t
        t += 110 + 7 * k  # request on the wire
        if worker_spans:
            srv = svc.start(worker_service, client.name, client, t + skew, SpanKind.SERVER)
            t_server = t
            t += 12
            t = work(srv, t, skew)
            t += 9 + k
            end(srv, t + skew)
            server_us = t - t_server
            exp.rpcs += 1
        else:
            t += 2000 + 100 * k
        t += 95 + 3 * k  # response on the wire
        end(client, t)
        if worker_spans and method in ("Propose", "Verify"):
            st["network"] += (t - t_client) - server_us
            st["worker_other"] += server_us
        return client

    # prefill: OpenSession on both workers, each prefilling the prompt
    prefill = svc.start(ORCH, "prefill", request, t)
    t_prefill = t
    t += 10
    for worker, service, cost in (("TargetWorker", TARGET, 3100), ("DraftWorker", DRAFT, 800)):
        def work(srv, t, skew, service=service, cost=cost):
            p = svc.start(service, "prefill", srv, t + skew, attrs={"specdec.forward.tokens": 17})
            end(p, t + cost + skew)
            return t + cost
        rpc(prefill, worker, "OpenSession", work, service, 0)
        t += 5
    end(prefill, t)
    st["prefill"] += t - t_prefill
    t += 15

    emitted_total = 0
    for k, acc in enumerate(accepted):
        g = gamma
        rnd = svc.start(ORCH, "round", request, t, attrs={"specdec.round": k, "specdec.gamma": g})
        t += 6
        if g > 0:
            draft = svc.start(ORCH, "draft", rnd, t)
            t_draft = t
            t += 8

            def work(srv, t, skew, k=k, g=g):
                if k > 0:  # rejected drafts of the last round are dropped first
                    tr = svc.start(DRAFT, "truncate", srv, t)
                    t += 23 + k
                    end(tr, t)
                    t += 4
                for j in range(g):
                    f = svc.start(DRAFT, "forward", srv, t, attrs={"specdec.forward.tokens": 2 if j == 0 and k else 1})
                    cost = 900 + 37 * j + 11 * k
                    t += cost
                    end(f, t)
                    st["draft_compute"] += cost
                    st["worker_other"] -= cost
                    exp.draft_forwards += 1
                    t += 20
                return t
            rpc(draft, "DraftWorker", "Propose", work, DRAFT, k)
            t += 7
            end(draft, t)
            st["draft"] += t - t_draft
            if not worker_spans:
                st["unsplit"] += t - t_draft
        verify = svc.start(ORCH, "verify", rnd, t)
        t_verify = t
        if ahead and k < len(accepted) - 1:
            # the next round's Propose, beside this verify; its time is in no stage of the summary
            next_propose = svc.start(ORCH, "draft_ahead", rnd, t)
            client = svc.start(ORCH, "/specdec.v1.DraftWorker/ProposeBatch", next_propose, t + 1, SpanKind.CLIENT)
            srv = svc.start(DRAFT, client.name, client, t + 50, SpanKind.SERVER)
            t_pass = t + 60
            for j in range(g + 1):  # the draft's guess of the bonus token, then the next round's drafts
                f = svc.start(DRAFT, "forward", srv, t_pass, attrs={"specdec.forward.tokens": 1})
                t_pass += 250 + 10 * j
                end(f, t_pass)
                t_pass += 5
                exp.ahead_forwards += 1
            end(srv, t_pass + 10)
            t_ahead_end = t + 1500 + 600 * k
            end(client, t_ahead_end - 5)
            end(next_propose, t_ahead_end)
            exp.ahead_calls += 1
            exp.ahead += t_ahead_end - t
        t += 9

        def work(srv, t, skew, k=k, g=g):
            f = svc.start(TARGET, "forward", srv, t + skew, attrs={"specdec.forward.tokens": g + 1})
            cost = 2500 + 53 * k
            t += cost
            end(f, t + skew)
            st["verify_compute"] += cost
            st["worker_other"] -= cost
            exp.target_forwards += 1
            return t
        rpc(verify, "TargetWorker", "Verify", work, TARGET, k)
        t += 5
        end(verify, t)
        st["verify"] += t - t_verify
        if ahead and k < len(accepted) - 1:
            exp.ahead_overlap += min(t_ahead_end, t) - t_verify
        if not worker_spans:
            st["unsplit"] += t - t_verify
        t += 3
        for name, cost in (("rejection_sampling", 140 + 9 * k), ("rollback", 6 + k)):
            span = svc.start(ORCH, name, rnd, t)
            t += cost
            end(span, t)
            st[name] += cost
            t += 2
        emitted = acc + 1
        rnd.set_attributes({"specdec.drafted_tokens": g, "specdec.accepted_tokens": acc,
                            "specdec.emitted_tokens": emitted, "specdec.wire_bytes": 100 + 10 * g})
        t += 30 + 5 * k  # streaming the chunk, detokenising: the loop's own time
        end(rnd, t)
        exp.rounds += 1
        exp.drafted += g
        exp.accepted += acc
        emitted_total += emitted
        t += 4

    close = svc.start(ORCH, "close", request, t)
    t_close = t
    t += 3
    for worker, service in (("TargetWorker", TARGET), ("DraftWorker", DRAFT)):
        rpc(close, worker, "CloseSession", lambda srv, t, skew: t + 15, service, 0)
    end(close, t)
    st["close"] += t - t_close
    t += 20
    request.set_attributes({"gen_ai.usage.output_tokens": emitted_total,
                            "specdec.acceptance_rate": exp.accepted / exp.drafted if exp.drafted else 0.0})
    end(request, t)
    exp.total = t - t_request
    end(server, t + 35)
    return exp


def console_text(readable) -> str:
    """What OTEL_TRACES_EXPORTER=console prints, with a service's other output in between."""
    noise = ["INFO orchestrator listening on 0.0.0.0:50050", '{"level": "info", "msg": "not a span"}',
             "WARNING weird {brace", '{"name": "no context here"}', "{ broken json"]
    parts = []
    for i, s in enumerate(readable):
        parts.append(s.to_json())
        parts.append(noise[i % len(noise)])
    return "\n".join(parts) + "\n"


def jaeger_doc(readable) -> dict:
    """Jaeger's /api/traces answer for these spans, built independently of spans_to_jaeger_json."""
    types = {bool: "bool", int: "int64", float: "float64", str: "string"}
    by_trace = defaultdict(list)
    for s in readable:
        by_trace[s.context.trace_id].append(s)
    data = []
    for tid, group in by_trace.items():
        procs = {}
        spans = []
        for s in group:
            pid = procs.setdefault(s.resource.attributes["service.name"], f"p{len(procs) + 1}")
            tags = [{"key": k, "type": types[type(v)], "value": v} for k, v in s.attributes.items()]
            tags += [{"key": "span.kind", "type": "string", "value": s.kind.name.lower()},
                     {"key": "otel.scope.name", "type": "string", "value": "test"}]
            spans.append({"traceID": f"{tid:x}", "spanID": f"{s.context.span_id:016x}", "flags": 1,
                          "operationName": s.name, "startTime": s.start_time // 1000,
                          "duration": (s.end_time - s.start_time) // 1000, "tags": tags, "logs": [],
                          "references": [{"refType": "CHILD_OF", "traceID": f"{tid:x}",
                                          "spanID": f"{s.parent.span_id:016x}"}] if s.parent else [],
                          "processID": pid, "warnings": None})
        data.append({"traceID": f"{tid:x}", "spans": spans, "warnings": None,
                     "processes": {p: {"serviceName": name, "tags": []} for name, p in procs.items()}})
    return {"data": data, "total": 0, "limit": 0, "offset": 0, "errors": None}


def as_tuples(spans):
    return sorted((s.trace_id, s.span_id, s.parent_id, s.name, s.service, s.start_ns, s.end_ns, s.kind)
                  for s in spans)


def sdk_tuples(readable):
    return sorted((f"{s.context.trace_id:032x}", f"{s.context.span_id:016x}",
                   f"{s.parent.span_id:016x}" if s.parent else None, s.name, s.resource.attributes["service.name"],
                   s.start_time, s.end_time, s.kind.name.lower()) for s in readable)


@pytest.fixture(scope="module")
def two_requests():
    """Request A, then a later request B, then an even later health check (no request span)."""
    svc = Services()
    a = build_request(svc, TRACE_A, 0, model="model-a")
    b = build_request(svc, TRACE_B, 100_000, model="model-b", accepted=(2, 4, 4))
    svc.ids.trace_ids.append(TRACE_C)
    health = svc.start(ORCH, "/grpc.health.v1.Health/Check", None, 300_000, SpanKind.SERVER)
    end(health, 300_050)
    return svc.spans(), a, b


# ---- reading ------------------------------------------------------------------------------------


def test_console_output_round_trips(two_requests, tmp_path):
    readable, a, b = two_requests
    path = tmp_path / "console.log"
    path.write_text(console_text(readable))
    spans = timeline.load_spans(str(path))
    assert as_tuples(spans) == sdk_tuples(readable)
    by_id = {s.span_id: s for s in spans}
    for r in readable:
        assert by_id[f"{r.context.span_id:016x}"].attributes == dict(r.attributes)
    assert {s.service for s in spans} == {ORCH, DRAFT, TARGET}
    assert a.trace_id.startswith("00000abc")  # leading zeros kept


def test_jaeger_json_round_trips(two_requests, tmp_path):
    readable, a, _ = two_requests
    path = tmp_path / "jaeger.json"
    path.write_text(json.dumps(jaeger_doc(readable)))
    spans = timeline.load_spans(str(path))
    assert as_tuples(spans) == sdk_tuples(readable)  # Jaeger's short trace ids padded back
    request = next(s for s in spans if s.name == "text_completion model-a")
    assert request.attributes["gen_ai.usage.input_tokens"] == 17 and "span.kind" not in request.attributes
    # and our own writer produces what our reader reads
    again = timeline.parse_spans(json.dumps(timeline.spans_to_jaeger_json(spans)))
    assert as_tuples(again) == as_tuples(spans)
    assert [s.attributes for s in sorted(again, key=lambda s: s.span_id)] == \
        [s.attributes for s in sorted(spans, key=lambda s: s.span_id)]


def test_bare_trace_and_jaeger_details():
    """One trace object on its own (not wrapped in data), a root with no references, ids as Jaeger prints them."""
    doc = {"traceID": "abc", "processes": {"p1": {"serviceName": ORCH}}, "spans": [
        {"traceID": "abc", "spanID": "1", "operationName": "root", "references": [], "startTime": 10,
         "duration": 5, "tags": [], "processID": "p1"},
        {"traceID": "abc", "spanID": "00000000000000ff", "operationName": "child", "startTime": 11, "duration": 2,
         "references": [{"refType": "FOLLOWS_FROM", "spanID": "1"}], "tags": [{"key": "n", "value": 3}],
         "processID": "p1"}]}
    root, child = sorted(timeline.parse_spans(json.dumps(doc)), key=lambda s: s.start_ns)
    assert root.trace_id == "0" * 29 + "abc" and root.span_id == "0" * 15 + "1" and root.parent_id is None
    assert child.parent_id == root.span_id and child.attributes == {"n": 3}
    assert (child.start_ns, child.duration_ns) == (11_000, 2_000)


def test_picks_latest_request_trace_or_the_one_asked_for(two_requests):
    readable, a, b = two_requests
    spans = timeline.parse_spans(console_text(readable))
    # the health check is newer but holds no request: B is the latest request
    assert {s.trace_id for s in timeline.select_trace(spans)} == {b.trace_id}
    assert {s.trace_id for s in timeline.select_trace(spans, a.trace_id)} == {a.trace_id}
    assert {s.trace_id for s in timeline.select_trace(spans, "0xABC" + "0" * 23 + "1")} == {a.trace_id}
    assert {s.trace_id for s in timeline.select_trace(spans, b.trace_id[:8])} == {b.trace_id}  # a prefix
    with pytest.raises(TimelineError, match="is not among the 3 trace"):
        timeline.select_trace(spans, "deadbeef")
    with pytest.raises(TimelineError, match="no spans to draw"):
        timeline.select_trace([])


# ---- the summary: the numbers a reader will trust --------------------------------------------------


def check_summary(s: timeline.Summary, exp: Expected):
    st = exp.stages
    sec = lambda us: us * 1000 / 1e9  # noqa: E731 - same integer-ns-then-divide as the module
    assert s.trace_id == exp.trace_id
    assert s.total_s == sec(exp.total)
    assert s.prefill_s == sec(st["prefill"])
    assert s.draft_compute_s == sec(st["draft_compute"])
    assert s.verify_compute_s == sec(st["verify_compute"])
    assert s.network_s == sec(st["network"])
    assert s.worker_other_s == sec(st["worker_other"])
    assert s.unsplit_s == sec(st["unsplit"])
    assert s.sampling_s == sec(st["rejection_sampling"])
    assert s.rollback_s == sec(st["rollback"])
    assert s.close_s == sec(st["close"])
    assert s.draft_s == sec(st["draft"]) and s.verify_s == sec(st["verify"])
    named = sum(st[k] for k in ("prefill", "draft_compute", "verify_compute", "network", "worker_other", "unsplit",
                                "rejection_sampling", "rollback", "close"))
    assert s.other_s == sec(exp.total - named)
    assert 0 < s.other_s < s.total_s
    assert (s.rounds, s.drafted_tokens, s.accepted_tokens) == (exp.rounds, exp.drafted, exp.accepted)


def test_summary_is_exact(two_requests):
    readable, a, b = two_requests
    spans = timeline.parse_spans(console_text(readable))
    check_summary(timeline.summarize(spans, a.trace_id), a)
    check_summary(timeline.summarize(spans), b)
    s = timeline.summarize(spans, a.trace_id)
    assert s.model == "model-a" and s.operation == "text_completion" and s.gamma == 4
    assert s.output_tokens == sum(x + 1 for x in (4, 1, 0, 3, 2)) and s.acceptance_rate == 10 / 20
    assert s.tokens_per_second == s.output_tokens / s.total_s
    assert s.missing_worker_spans == 0 and s.unsplit_s == 0
    # the same numbers from Jaeger's copy of the spans
    assert timeline.summarize(timeline.parse_spans(json.dumps(jaeger_doc(readable))), a.trace_id) == s


def test_summary_without_worker_spans():
    svc = Services()
    exp = build_request(svc, TRACE_A, 0, worker_spans=False)
    s = timeline.summarize(timeline.parse_spans(console_text(svc.spans())))
    check_summary(s, exp)
    assert s.missing_worker_spans == 2 * exp.rounds
    assert s.draft_compute_s == s.verify_compute_s == s.network_s == 0
    assert s.unsplit_s > 0 and s.worker_other_s == 0


def test_clock_skew_moves_the_picture_not_the_numbers():
    svc = Services()
    exp = build_request(svc, TRACE_A, 0, target_skew_us=-250_000)  # the target host's clock is 250 ms behind
    spans = timeline.parse_spans(console_text(svc.spans()))
    check_summary(timeline.summarize(spans), exp)
    lay = timeline.layout(spans)
    target = [b for b in lay.bars if b.lane == "target worker"]
    assert target and all(b.start_ms >= 0 for b in target)  # pulled back inside their client spans
    assert all(b.width_ms >= 0 for b in lay.bars if b.style == "network")
    assert lay.summary.network_s == timeline.summarize(spans).network_s


# ---- the layout and the picture -------------------------------------------------------------------


def count(lay, lane, style):
    return sum(1 for b in lay.bars if b.lane == lane and b.style == style)


def test_layout_lanes_and_bars(two_requests):
    readable, a, _ = two_requests
    lay = timeline.layout(timeline.parse_spans(console_text(readable)), a.trace_id)
    assert lay.lanes == ["orchestrator", "network / RPC", "draft worker", "target worker"]
    assert count(lay, "draft worker", "draft") == a.draft_forwards == 4 * 5
    assert count(lay, "target worker", "target") == a.target_forwards == 5
    assert count(lay, "network / RPC", "network") == 2 * a.rpcs
    assert count(lay, "orchestrator", "sampling") == count(lay, "orchestrator", "rollback") == 5
    assert count(lay, "orchestrator", "prefill") == 1
    assert count(lay, "draft worker", "prefill") == count(lay, "target worker", "prefill") == 1
    assert count(lay, "draft worker", "rollback") == 4  # truncate in every round but the first
    assert not any(b.style.startswith("unsplit") for b in lay.bars)
    assert [r.index for r in lay.rounds] == list(range(5))
    assert [(r.drafted, r.accepted) for r in lay.rounds] == [(4, x) for x in (4, 1, 0, 3, 2)]
    assert all(b.start_ms >= 0 and b.start_ms + b.width_ms <= lay.end_ms + 1e-9 for b in lay.bars)
    assert lay.end_ms == a.total / 1000 and lay.session_id == f"session-{TRACE_A:x}"


def test_layout_without_worker_spans_and_with_gamma_0():
    svc = Services()
    build_request(svc, TRACE_A, 0, worker_spans=False)
    lay = timeline.layout(timeline.parse_spans(console_text(svc.spans())))
    assert lay.lanes == ["orchestrator", "draft worker", "target worker"]  # nothing to put on the network lane
    assert count(lay, "draft worker", "unsplit-draft") == count(lay, "target worker", "unsplit-target") == 5
    assert count(lay, "draft worker", "draft") == 0

    svc = Services()
    build_request(svc, TRACE_B, 0, gamma=0, accepted=(0,) * 6)
    spans = timeline.parse_spans(console_text(svc.spans()))
    lay = timeline.layout(spans)
    assert "draft worker" in lay.lanes  # the draft's prefill / close still happen in this test's trace
    assert count(lay, "draft worker", "draft") == 0 and count(lay, "target worker", "target") == 6
    assert lay.summary.draft_compute_s == 0 and lay.summary.acceptance_rate == 0
    no_draft = [s for s in spans if s.service != DRAFT and "DraftWorker" not in s.name]
    assert timeline.layout(no_draft).lanes == ["orchestrator", "network / RPC", "target worker"]


def test_round_labels_thin_out_but_never_overlap():
    rounds = [timeline.Round(i * 10.0, i * 10.0 + 9.5, i, 4, i % 5) for i in range(40)]
    char_px = 5.0
    wide = timeline.round_labels(rounds, px_per_ms=10.0, char_px=char_px)
    assert len(wide) == 40 and all("\n" in text for _, text, _ in wide)
    narrow = timeline.round_labels(rounds, px_per_ms=0.5, char_px=char_px)
    assert 0 < len(narrow) < 40
    edges = [(x * 0.5 - len(t) * char_px / 2, x * 0.5 + len(t) * char_px / 2) for x, t, _ in narrow]
    assert all(right < next_left for (_, right), (next_left, _) in zip(edges, edges[1:]))
    colours = {text: colour for _, text, colour in wide}
    assert colours["r4\n4/4"] != colours["r1\n1/4"] != colours["r5\n0/4"]


def check_png(path):
    import matplotlib.image

    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    image = matplotlib.image.imread(str(path))
    height, width = image.shape[:2]
    assert width == 16 * 110 and 500 < height < 1000 and image.shape[2] in (3, 4)
    assert image[..., :3].std() > 0.05  # not a blank canvas


def test_draw_writes_a_png(two_requests, tmp_path):
    readable, a, _ = two_requests
    spans = timeline.parse_spans(console_text(readable))
    summary = timeline.draw(spans, tmp_path / "sub" / "a.png", trace_id=a.trace_id)
    assert summary.trace_id == a.trace_id
    check_png(tmp_path / "sub" / "a.png")


def test_draw_many_rounds_and_degraded_traces(tmp_path):
    svc = Services()
    build_request(svc, TRACE_A, 0, accepted=[(3 * i) % 5 for i in range(40)])
    build_request(svc, TRACE_B, 500_000, worker_spans=False)
    build_request(svc, TRACE_C, 900_000, gamma=0, accepted=(0,) * 8)
    spans = svc.spans()
    spans = timeline.parse_spans(console_text(spans))
    for trace_id in (TRACE_A, TRACE_B, TRACE_C):
        out = tmp_path / f"{trace_id:x}.png"
        timeline.draw(spans, out, trace_id=f"{trace_id:x}")
        check_png(out)


def test_a_propose_sent_ahead_is_drawn_beside_the_verify_and_kept_out_of_the_stages(tmp_path):
    """The step loop's draft_ahead spans (the next round's Propose, sent beside this round's verify):
    a lane of their own under the orchestrator's, each bar over its round's verify; the draft's
    passes under them dotted; the summary's stages exactly as without them, the calls told aside."""
    svc = Services()
    exp = build_request(svc, TRACE_A, 0, ahead=True)
    spans = timeline.parse_spans(console_text(svc.spans()))
    s = timeline.summarize(spans)
    check_summary(s, exp)  # draft, verify, compute, network: the ahead calls' time counted in none
    sec = lambda us: us * 1000 / 1e9  # noqa: E731
    assert (s.ahead_calls, s.ahead_s, s.ahead_overlap_s) == (4, sec(exp.ahead), sec(exp.ahead_overlap))
    assert 0 < s.ahead_overlap_s < s.ahead_s  # the last one outlasts its verify
    assert "4 Proposes ahead" in timeline._summary_text(s)

    lay = timeline.layout(spans)
    assert lay.lanes == ["orchestrator", "draft ahead", "network / RPC", "draft worker", "target worker"]
    ahead = [b for b in lay.bars if b.style == "ahead"]
    verifies = [b for b in lay.bars if b.style == "wait-target"]
    assert len(ahead) == 4 and all(b.lane == "draft ahead" and b.label == "ahead" for b in ahead)
    for a, v in zip(ahead, verifies):  # draft k+1 beside verify k: begun with it, drawn over it
        assert a.start_ms == v.start_ms and a.width_ms > 0 and v.width_ms > 0
    assert count(lay, "draft worker", "draft-ahead") == exp.ahead_forwards == 4 * 5
    assert count(lay, "draft worker", "draft") == exp.draft_forwards  # the round's own passes as before
    out = tmp_path / "ahead.png"
    timeline.draw(spans, out)
    check_png(out)

    # without worker spans the orchestrator's view still shows them, and no step is unsplit for them
    svc = Services()
    build_request(svc, TRACE_B, 0, ahead=True, worker_spans=False)
    spans = [s for s in timeline.parse_spans(console_text(svc.spans())) if s.service == ORCH]
    lay = timeline.layout(spans)
    assert count(lay, "draft ahead", "ahead") == 4 and count(lay, "draft worker", "unsplit-draft") == 5


# ---- the command line ------------------------------------------------------------------------------


def test_main_draws_from_console_and_jaeger_files(two_requests, tmp_path, capsys):
    readable, a, b = two_requests
    console, jaeger = tmp_path / "spans.log", tmp_path / "trace.json"
    console.write_text(console_text(readable))
    jaeger.write_text(json.dumps(jaeger_doc(readable)))
    assert timeline.main([str(console), "--out", str(tmp_path / "c.png")]) == 0
    assert b.trace_id in capsys.readouterr().out
    check_png(tmp_path / "c.png")
    assert timeline.main([str(jaeger), "--out", str(tmp_path / "j.png"), "--trace-id", a.trace_id,
                          "--title", "my title"]) == 0
    assert a.trace_id in capsys.readouterr().out
    check_png(tmp_path / "j.png")


def test_main_errors_exit_2(two_requests, tmp_path, capsys):
    readable, *_ = two_requests
    empty, noise, spans = tmp_path / "empty.log", tmp_path / "noise.log", tmp_path / "spans.log"
    empty.write_text("")
    noise.write_text("INFO nothing here\n{\"a\": 1}\n")
    spans.write_text(console_text(readable))
    out = tmp_path / "never.png"
    for argv, message in (([str(empty)], "no spans found"), ([str(noise)], "no spans found"),
                          ([str(tmp_path / "missing.log")], "cannot read"),
                          ([str(spans), "--trace-id", "feedface"], "trace id feedface is not among")):
        assert timeline.main(argv + ["--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert "error:" in err and message in err, err
    assert not out.exists()


@pytest.fixture
def jaeger_server(two_requests):
    """A stand-in for Jaeger's query service on a free port, serving the two requests' traces."""
    readable, a, b = two_requests
    doc = jaeger_doc(readable)
    traces = {t["traceID"]: t for t in doc["data"]}
    seen, state = [], {"operation_filter_finds": True}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            seen.append(self.path)
            path, _, query = self.path.partition("?")
            if path.startswith("/api/traces/"):
                tid = path.rsplit("/", 1)[1].lstrip("0")  # Jaeger ignores leading zeros too
                found = [t for key, t in traces.items() if key.lstrip("0") == tid]
                body, code = ({"data": found, "errors": None}, 200) if found else (
                    {"data": None, "errors": [{"code": 404, "msg": "trace not found"}]}, 404)
            elif path == "/api/traces":
                # newest first, and the operation filter honoured, as Jaeger does
                params = dict(p.split("=", 1) for p in query.split("&"))
                body, code = {"data": [traces[f"{TRACE_B:x}"], traces[f"{TRACE_A:x}"]][: int(params["limit"])]}, 200
                if "operation" in params and (params["operation"] != "%2Fspecdec.v1.Orchestrator%2FGenerate"
                                              or not state["operation_filter_finds"]):
                    body = {"data": []}
            else:
                body, code = {"error": "no"}, 404
            payload = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", seen, state, a, b
    server.shutdown()
    server.server_close()


def test_main_fetches_from_jaeger(jaeger_server, tmp_path, capsys):
    url, seen, state, a, b = jaeger_server
    assert timeline.main([url, "--trace-id", a.trace_id, "--out", str(tmp_path / "a.png")]) == 0
    assert seen == [f"/api/traces/{a.trace_id}"] and a.trace_id in capsys.readouterr().out
    check_png(tmp_path / "a.png")
    seen.clear()
    assert timeline.main([url + "/", "--out", str(tmp_path / "latest.png")]) == 0
    assert b.trace_id in capsys.readouterr().out
    assert all("service=specdec-orchestrator" in p and "limit=1" in p for p in seen) and len(seen) == 2
    seen.clear()
    # no trace under the generate methods' names: the service's recent traces are asked for instead
    state["operation_filter_finds"] = False
    assert timeline.main([url, "--out", str(tmp_path / "fallback.png")]) == 0
    assert b.trace_id in capsys.readouterr().out
    assert len(seen) == 3 and "operation" not in seen[2] and "limit=20" in seen[2]
    seen.clear()
    # a Jaeger UI trace page pasted as the source
    assert timeline.main([f"{url}/trace/{a.trace_id.lstrip('0')}", "--out", str(tmp_path / "ui.png")]) == 0
    assert a.trace_id in capsys.readouterr().out


def test_unknown_trace_at_jaeger_and_unreachable_jaeger(jaeger_server, tmp_path, capsys):
    url, *_ = jaeger_server
    assert timeline.main([url, "--trace-id", "feedface", "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "feedface" in err and "is not in Jaeger" in err
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert timeline.main([f"http://127.0.0.1:{port}", "--out", str(tmp_path / "x.png")]) == 2
    assert "cannot reach Jaeger" in capsys.readouterr().err


def test_main_reads_stdin(two_requests, tmp_path, monkeypatch, capsys):
    import io

    readable, _, b = two_requests
    monkeypatch.setattr("sys.stdin", io.StringIO(console_text(readable)))
    assert timeline.main(["-", "--out", str(tmp_path / "stdin.png")]) == 0
    assert b.trace_id in capsys.readouterr().out
    check_png(tmp_path / "stdin.png")
