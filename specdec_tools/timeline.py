"""The timeline of one speculative-decoding request, drawn from its OpenTelemetry spans.

This module owns: reading spans (the text ConsoleSpanExporter prints, a Jaeger JSON file, a Jaeger
query URL), picking one request's trace, the per-stage time summary, and a Gantt-style PNG with one
lane each for the orchestrator, the next Proposes sent ahead, the network/RPC overhead, the draft
worker and the target worker.
It imports nothing from the services: it works on whatever spans it is given, and draws less, not
nothing, when some are missing (workers not exporting, gamma 0, no gRPC instrumentation).

The spans it expects (orchestrator `specdec-orchestrator`, workers `specdec-draft`/`specdec-target`):

    /specdec.v1.Orchestrator/Generate[Stream]        gRPC SERVER
      text_completion|chat <model>                   the request: the span with gen_ai.operation.name
        prefill  -> .../OpenSession CLIENT -> worker SERVER -> prefill
        round    (specdec.round, .gamma, .drafted_tokens, .accepted_tokens, ...)
          draft  -> /specdec.v1.DraftWorker/Propose CLIENT -> SERVER -> [truncate] forward x gamma
          verify -> /specdec.v1.TargetWorker/Verify CLIENT -> SERVER -> [truncate] forward
        (under the step loop the calls are ProposeBatch / VerifyBatch, under the draft / verify span
        of the step's first request; the others' draft / verify spans link to them)
          rejection_sampling, rollback
          draft_ahead -> .../ProposeBatch CLIENT -> SERVER -> forward x (gamma + 1)
        close    -> .../CloseSession CLIENT -> SERVER

A `draft_ahead` span (the step loop, where the draft has hardware of its own: steps._send_next) is
the next round's Propose, sent beside this round's verify and ended when the draft answers. It
gets a lane of its own under the orchestrator's, so "draft k+1 beside verify k" shows as two bars
one above the other, and the draft worker's passes under it are dotted. Its time overlaps the
verify's, so the summary keeps it out of the stages (which stay disjoint) and reports it aside:
the calls, their time, and how much of it the verify hid.

    python -m specdec_tools.timeline SOURCE --out timeline.png [--trace-id HEX]
"""

from __future__ import annotations

import argparse
import calendar
import datetime
import json
import re
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from specdec_tools import PLOTS_EXTRA

ORCHESTRATOR_SERVICE = "specdec-orchestrator"
REQUEST_ATTR = "gen_ai.operation.name"  # marks the request span, whatever its name
GENERATE_METHODS = ("/specdec.v1.Orchestrator/Generate", "/specdec.v1.Orchestrator/GenerateStream")
# a round's calls: per request, or one batched call per step for all the requests on a target
RPC_NAMES = ("Worker/Propose", "Worker/Verify", "Worker/ProposeBatch", "Worker/VerifyBatch")


class TimelineError(Exception):
    """Bad input: no spans, an unknown trace, Jaeger unreachable. The CLI exits 2 with the message."""


@dataclass
class Span:
    trace_id: str  # 32 lowercase hex digits
    span_id: str  # 16 lowercase hex digits
    parent_id: str | None
    name: str
    service: str
    start_ns: int
    end_ns: int
    attributes: dict = field(default_factory=dict)
    kind: str = ""  # "server", "client", "internal", ...; "" when the source does not say

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


# ---- reading spans ---------------------------------------------------------------------------


def load_spans(source: str, trace_id: str | None = None, service: str = ORCHESTRATOR_SERVICE,
               timeout_s: float = 10.0) -> list[Span]:
    """Every span in SOURCE: a console-exporter log or Jaeger JSON file, '-' for stdin, or a Jaeger URL.

    trace_id and service only shape the Jaeger query; choosing among traces is select_trace's job.
    """
    if re.match(r"https?://", source):
        return _fetch_jaeger(source, trace_id, service, timeout_s)
    if source == "-":
        return parse_spans(sys.stdin.read())
    try:
        return parse_spans(Path(source).read_text(encoding="utf-8", errors="replace"))
    except OSError as exc:
        raise TimelineError(f"cannot read {source}: {exc.strerror or exc}") from None


def parse_spans(text: str) -> list[Span]:
    """Spans from Jaeger JSON, or else from console-exporter output mixed with any other lines."""
    stripped = text.strip()
    if stripped[:1] in ("{", "["):
        try:
            traces = _jaeger_traces(json.loads(stripped))
        except ValueError:  # concatenated objects or log lines: console output
            traces = None
        if traces is not None:
            return _from_jaeger(traces)
    return _from_console(text)


def _norm_id(value, width: int) -> str | None:
    """Hex ids padded to full width: Jaeger drops a trace id's leading zeros, the SDK prints 0x."""
    if value in (None, ""):
        return None
    number = int(str(value).strip().lower().removeprefix("0x"), 16)
    return f"{number:0{width}x}" if number else None


def _iso_ns(text: str) -> int:
    """An ISO 8601 UTC timestamp as integer ns since the epoch (no float: durations stay exact)."""
    m = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:?\d\d)?", text.strip())
    if not m:
        raise ValueError(f"not a timestamp: {text!r}")
    zone = m[3] if m[3] and m[3] != "Z" else "+00:00"
    whole = datetime.datetime.fromisoformat(m[1] + zone[:3] + ":" + zone[-2:])
    return calendar.timegm(whole.utctimetuple()) * 10**9 + int((m[2] or "0")[:9].ljust(9, "0"))


def _from_console(text: str) -> list[Span]:
    # Each span is a pretty-printed JSON object; other objects and log lines are skipped, and a
    # span cut in half by another process's output fails to decode and is skipped too.
    decoder, spans = json.JSONDecoder(), []
    i = text.find("{")
    while i != -1:
        try:
            obj, end = decoder.raw_decode(text, i)
        except ValueError:
            i = text.find("{", i + 1)
            continue
        if isinstance(obj, dict) and "context" in obj and "name" in obj:
            try:
                ctx, resource = obj["context"], (obj.get("resource") or {}).get("attributes") or {}
                spans.append(Span(
                    _norm_id(ctx["trace_id"], 32), _norm_id(ctx["span_id"], 16), _norm_id(obj.get("parent_id"), 16),
                    obj["name"], str(resource.get("service.name", "")), _iso_ns(obj["start_time"]),
                    _iso_ns(obj["end_time"]), dict(obj.get("attributes") or {}),
                    str(obj.get("kind") or "").rpartition(".")[2].lower()))
            except (KeyError, TypeError, ValueError, AttributeError):
                pass  # an unfinished or foreign object that merely looks like a span
        i = text.find("{", end)
    return spans


def _jaeger_traces(doc) -> list[dict] | None:
    """The trace objects of an API answer ({"data": [...]}), one bare trace, or a list of traces."""
    if isinstance(doc, dict) and isinstance(doc.get("data"), list):
        return doc["data"]
    if isinstance(doc, dict) and "spans" in doc and "traceID" in doc:
        return [doc]
    if isinstance(doc, list) and doc and all(isinstance(t, dict) and "spans" in t for t in doc):
        return doc
    return None


def _from_jaeger(traces: list[dict]) -> list[Span]:
    spans = []
    for tr in traces:
        processes = tr.get("processes") or {}
        for s in tr.get("spans") or []:
            process = s.get("process") or processes.get(s.get("processID")) or {}
            attrs = {t["key"]: t.get("value") for t in s.get("tags") or [] if "key" in t}
            refs = s.get("references") or []
            parent = next((r for r in refs if r.get("refType") == "CHILD_OF"), refs[0] if refs else {})
            start = int(s["startTime"]) * 1000  # Jaeger keeps microseconds
            spans.append(Span(
                _norm_id(s.get("traceID") or tr.get("traceID"), 32), _norm_id(s["spanID"], 16),
                _norm_id(parent.get("spanID") or s.get("parentSpanID"), 16), s.get("operationName", ""),
                str(process.get("serviceName", "")), start, start + int(s.get("duration", 0)) * 1000,
                attrs, str(attrs.pop("span.kind", "")).lower()))
    return spans


def spans_to_jaeger_json(spans: list[Span]) -> dict:
    """Spans as Jaeger's query API answers them (/api/traces), e.g. to keep a console log for later."""
    def tag(key, value):
        kind = ("bool" if isinstance(value, bool) else "int64" if isinstance(value, int)
                else "float64" if isinstance(value, float) else "string")
        return {"key": key, "type": kind, "value": value if kind != "string" or isinstance(value, str)
                else json.dumps(value)}

    by_trace: dict[str, list[Span]] = defaultdict(list)
    for s in spans:
        by_trace[s.trace_id].append(s)
    data = []
    for tid, group in by_trace.items():
        pids: dict[str, str] = {}
        for s in group:
            pids.setdefault(s.service, f"p{len(pids) + 1}")
        data.append({"traceID": tid, "processes": {p: {"serviceName": svc, "tags": []} for svc, p in pids.items()},
                     "warnings": None, "spans": [{
                         "traceID": tid, "spanID": s.span_id, "operationName": s.name, "flags": 1,
                         "references": [{"refType": "CHILD_OF", "traceID": tid, "spanID": s.parent_id}]
                         if s.parent_id else [],
                         "startTime": s.start_ns // 1000, "duration": s.end_ns // 1000 - s.start_ns // 1000,
                         "tags": [tag(k, v) for k, v in s.attributes.items()]
                         + ([tag("span.kind", s.kind)] if s.kind else []),
                         "logs": [], "processID": pids[s.service], "warnings": None} for s in group]})
    return {"data": data, "total": 0, "limit": 0, "offset": 0, "errors": None}


def _get_json(url: str, timeout_s: float, not_found: str | None = None):
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as answer:
            return json.load(answer)
    except urllib.error.HTTPError as exc:
        if exc.code == 404 and not_found:
            raise TimelineError(not_found) from None
        raise TimelineError(f"Jaeger answered HTTP {exc.code} {exc.reason} for {url}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise TimelineError(f"cannot reach Jaeger at {url}: {getattr(exc, 'reason', exc)}") from None
    except ValueError:
        raise TimelineError(f"{url} did not answer JSON; is this Jaeger's query port (16686)?") from None


def _fetch_jaeger(url: str, trace_id: str | None, service: str, timeout_s: float) -> list[Span]:
    base = url.rstrip("/")
    page = re.search(r"/trace/([0-9a-fA-F]+)$", base)  # a Jaeger UI trace page, pasted as is
    if page:
        base, trace_id = base[: page.start()], trace_id or page[1]
    if "/api/traces" in base:  # a ready-made API query
        return _from_jaeger(_jaeger_traces(_get_json(base, timeout_s)) or [])
    if trace_id:
        tid = _norm_id(trace_id, 32) or trace_id
        doc = _get_json(f"{base}/api/traces/{tid}", timeout_s, f"trace {tid} is not in Jaeger at {base}")
        return _from_jaeger(_jaeger_traces(doc) or [])
    # The latest trace of the service may be a health check, so ask for the latest of each
    # generate method first, and fall back to the service's recent traces only if neither has one.
    spans = []
    for method in GENERATE_METHODS:
        query = urllib.parse.urlencode({"service": service, "operation": method, "limit": 1})
        spans += _from_jaeger(_jaeger_traces(_get_json(f"{base}/api/traces?{query}", timeout_s)) or [])
    if not any(REQUEST_ATTR in s.attributes for s in spans):
        query = urllib.parse.urlencode({"service": service, "limit": 20})
        spans += _from_jaeger(_jaeger_traces(_get_json(f"{base}/api/traces?{query}", timeout_s)) or [])
    if not spans:
        raise TimelineError(f"Jaeger at {base} has no traces of service {service!r}")
    return spans


# ---- picking and reading one request ----------------------------------------------------------


def select_trace(spans: list[Span], trace_id: str | None = None) -> list[Span]:
    """The spans of trace_id (a unique prefix will do), else of the latest trace holding a request."""
    if not spans:
        raise TimelineError("no spans to draw")
    by_trace: dict[str, list[Span]] = defaultdict(list)
    for s in spans:
        by_trace[s.trace_id].append(s)
    if trace_id:
        raw = trace_id.strip().lower().removeprefix("0x")
        exact = _norm_id(raw, 32) if re.fullmatch(r"[0-9a-f]+", raw) else None
        hits = [exact] if exact in by_trace else [t for t in by_trace if t.startswith(raw)]
        if len(hits) != 1:
            known = ", ".join(sorted(by_trace)[:5]) + (" ..." if len(by_trace) > 5 else "")
            what = "is ambiguous" if hits else "is not among"
            raise TimelineError(f"trace id {trace_id} {what} the {len(by_trace)} trace(s) found: {known}")
        return by_trace[hits[0]]

    def recency(tid):
        requests = [s for s in by_trace[tid] if REQUEST_ATTR in s.attributes]
        return bool(requests), max(s.start_ns for s in requests or by_trace[tid])

    return by_trace[max(by_trace, key=recency)]


class _Tree:
    def __init__(self, spans: list[Span]):
        self.by_id = {s.span_id: s for s in spans}
        self.children: dict[str, list[Span]] = defaultdict(list)
        for s in sorted(spans, key=lambda s: s.start_ns):
            if s.parent_id in self.by_id:
                self.children[s.parent_id].append(s)
        requests = sorted((s for s in spans if REQUEST_ATTR in s.attributes), key=lambda s: s.start_ns)
        # no request span (orchestrator not instrumented yet): anchor on the earliest root instead
        roots = sorted((s for s in spans if s.parent_id not in self.by_id), key=lambda s: s.start_ns)
        self.request = (requests or roots)[0]
        self.home = self.request.service

    def subtree(self, span: Span):
        stack = [span]
        while stack:
            s = stack.pop()
            yield s
            stack.extend(reversed(self.children[s.span_id]))

    def chain(self, span: Span):
        """The span and its ancestors, nearest first."""
        while span is not None:
            yield span
            span = self.by_id.get(span.parent_id)

    def is_server(self, span: Span) -> bool:
        """The far end of an RPC: its parent ran in another service (kind is not always known)."""
        parent = self.by_id.get(span.parent_id)
        return parent is not None and parent.service != span.service

    def worker_of(self, span: Span) -> str | None:
        for s in self.chain(span):
            if "DraftWorker/" in s.name or (s.name == "draft" and s.service == self.home):
                return "draft"
            if "TargetWorker/" in s.name or (s.name == "verify" and s.service == self.home):
                return "target"
        return None

    def in_prefill(self, span: Span) -> bool:
        return any(s.name == "prefill" or s.name.endswith("/OpenSession") for s in self.chain(span))

    def in_ahead(self, span: Span) -> bool:
        """Under a draft_ahead span: the next round's Propose, sent beside this round's verify."""
        return any(s.name == "draft_ahead" and s.service == self.home for s in self.chain(span))

    def stages(self):
        """(worker, span) for each draft/verify step: the orchestrator's draft/verify spans, or
        Propose/Verify client spans where those are missing. Calls sent ahead are none: they
        overlap a verify."""
        out = []
        for s in self.subtree(self.request):
            if s.service != self.home or self.in_ahead(s):
                continue
            named = s.name in ("draft", "verify")
            rpc = s.name.endswith(RPC_NAMES) and not any(
                a.name in ("draft", "verify") for a in self.chain(s))
            if named or rpc:
                out.append((self.worker_of(s), s))
        return out


@dataclass
class Summary:
    """Where one request's time went, in seconds. Stages are disjoint; other_s is the remainder."""

    trace_id: str
    model: str
    operation: str
    total_s: float  # the request span
    prefill_s: float
    draft_compute_s: float  # draft-worker forward passes inside Propose
    verify_compute_s: float  # target-worker forward passes inside Verify
    worker_other_s: float  # Propose/Verify server time outside forward passes (truncate, (de)serialising, lock waits)
    network_s: float  # Propose/Verify client time not covered by the worker's server span
    unsplit_s: float  # draft/verify steps without worker spans: compute and network not told apart
    sampling_s: float
    rollback_s: float
    close_s: float
    other_s: float  # orchestrator work outside the stages above (streaming, detokenising, client-side gRPC)
    draft_s: float  # the orchestrator's draft spans in all (compute + network + overheads)
    verify_s: float
    rounds: int
    gamma: int
    drafted_tokens: int
    accepted_tokens: int
    input_tokens: int
    output_tokens: int
    acceptance_rate: float
    tokens_per_second: float
    wire_bytes: int
    missing_worker_spans: int  # draft/verify steps counted in unsplit_s
    ahead_calls: int = 0  # draft_ahead spans: next Proposes sent beside a verify (in no stage above)
    ahead_s: float = 0.0  # their time in all
    ahead_overlap_s: float = 0.0  # the part of it while the request's verify ran


def summarize(spans: list[Span], trace_id: str | None = None) -> Summary:
    """Per-stage totals of the request in trace_id (default: the latest request among spans)."""
    return _summarize(_Tree(select_trace(spans, trace_id)))


def _summarize(tree: _Tree) -> Summary:
    req = tree.request
    ns: dict[str, int] = defaultdict(int)  # integer ns throughout, seconds only at the end: exact sums
    for s in tree.subtree(req):
        if s.service == tree.home and s.name in ("prefill", "rejection_sampling", "rollback", "close"):
            ns[s.name] += s.duration_ns
    missing = 0
    for worker, stage in tree.stages():
        ns[f"{worker}_s"] += stage.duration_ns
        inside = list(tree.subtree(stage))
        remote = [s for s in inside if s.service != tree.home]
        forwards = [s for s in inside if s.name == "forward"]
        if not remote and not forwards:
            ns["unsplit"] += stage.duration_ns
            missing += 1
            continue
        ns[f"{worker}_compute"] += sum(f.duration_ns for f in forwards)
        for server in (s for s in inside if tree.is_server(s)):
            ns["network"] += tree.by_id[server.parent_id].duration_ns - server.duration_ns
            ns["worker_other"] += server.duration_ns - sum(
                f.duration_ns for f in tree.subtree(server) if f.name == "forward")
    parts = ("prefill", "draft_compute", "target_compute", "worker_other", "network", "unsplit",
             "rejection_sampling", "rollback", "close")
    other = req.duration_ns - sum(ns[p] for p in parts)
    rounds = [s for s in tree.subtree(req) if s.name == "round" and s.service == tree.home]
    a = req.attributes
    drafted = sum(int(r.attributes.get("specdec.drafted_tokens", 0)) for r in rounds)
    accepted = sum(int(r.attributes.get("specdec.accepted_tokens", 0)) for r in rounds)
    emitted = sum(int(r.attributes.get("specdec.emitted_tokens", 0)) for r in rounds)
    output = int(a.get("gen_ai.usage.output_tokens", emitted))
    home = [s for s in tree.subtree(req) if s.service == tree.home]
    aheads, verifies = [s for s in home if s.name == "draft_ahead"], [s for s in home if s.name == "verify"]
    overlap = sum(max(0, min(x.end_ns, v.end_ns) - max(x.start_ns, v.start_ns)) for x in aheads for v in verifies)
    sec = lambda key: ns[key] / 1e9  # noqa: E731
    return Summary(
        trace_id=req.trace_id, model=str(a.get("gen_ai.request.model", "")),
        operation=str(a.get(REQUEST_ATTR, req.name)), total_s=req.duration_ns / 1e9, prefill_s=sec("prefill"),
        draft_compute_s=sec("draft_compute"), verify_compute_s=sec("target_compute"),
        worker_other_s=sec("worker_other"), network_s=sec("network"), unsplit_s=sec("unsplit"),
        sampling_s=sec("rejection_sampling"), rollback_s=sec("rollback"), close_s=sec("close"), other_s=other / 1e9,
        draft_s=sec("draft_s"), verify_s=sec("target_s"), rounds=len(rounds),
        gamma=int(a.get("specdec.gamma", max((int(r.attributes.get("specdec.gamma", 0)) for r in rounds), default=0))),
        drafted_tokens=drafted, accepted_tokens=accepted, input_tokens=int(a.get("gen_ai.usage.input_tokens", 0)),
        output_tokens=output,
        acceptance_rate=float(a.get("specdec.acceptance_rate", accepted / drafted if drafted else 0.0)),
        tokens_per_second=output / (req.duration_ns / 1e9) if req.duration_ns > 0 else 0.0,
        wire_bytes=sum(int(r.attributes.get("specdec.wire_bytes", 0)) for r in rounds),
        missing_worker_spans=missing, ahead_calls=len(aheads), ahead_s=sum(x.duration_ns for x in aheads) / 1e9,
        ahead_overlap_s=overlap / 1e9)


# ---- the picture ------------------------------------------------------------------------------

LANES = ("orchestrator", "draft ahead", "network / RPC", "draft worker", "target worker")
# style: (face colour, legend entry, bar height, hatch), drawn in this order (later on top)
STYLES = {
    "server": ("#dcdcdc", "worker RPC handling outside forward passes", 0.84, None),
    "wait-draft": ("#c6dbf2", "orchestrator waiting for draft / target", 0.28, None),
    "wait-target": ("#f8d9bd", None, 0.28, None),
    "network": ("#8c8c8c", "network + gRPC (client span minus server span)", 0.5, None),
    "unsplit-draft": ("#c6dbf2", "draft / verify without worker spans (network included)", 0.7, "////"),
    "unsplit-target": ("#f8d9bd", None, 0.7, "////"),
    # rollback before sampling: both are often under a pixel, next to each other, and sampling matters more
    "rollback": ("#c9403a", "rollback / truncate", 0.7, None),
    "prefill": ("#8d6cbf", "prefill", 0.7, None),
    "draft": ("#3f7fcf", "draft forward pass", 0.7, None),
    "target": ("#e6802e", "target forward pass", 0.7, None),
    "ahead": ("#6a9fdc", "next Propose sent beside the verify (draft_ahead)", 0.5, None),
    "draft-ahead": ("#3f7fcf", "draft forward pass of a Propose sent ahead", 0.7, "...."),
    "sampling": ("#3b9f58", "rejection sampling", 0.7, None),
    "close": ("#b8a47c", "close sessions", 0.7, None),
}
LEGEND_ORDER = ("prefill", "draft", "target", "sampling", "rollback", "network", "server", "wait-draft",
                "wait-target", "unsplit-draft", "unsplit-target", "ahead", "draft-ahead", "close")
EDGES = {"unsplit-draft": "#3f7fcf", "unsplit-target": "#e6802e", "draft": "white", "target": "white",
         "draft-ahead": "white"}


@dataclass
class Bar:
    lane: str
    start_ms: float  # from the request start
    width_ms: float
    style: str
    label: str = ""


@dataclass
class Round:
    start_ms: float
    end_ms: float
    index: int
    drafted: int
    accepted: int


@dataclass
class Layout:
    summary: Summary
    lanes: list[str]
    bars: list[Bar]
    rounds: list[Round]
    end_ms: float
    session_id: str = ""


def _clock_offsets(tree: _Tree) -> dict[str, int]:
    """Per span, ns to add so that every server span lies within its client span.

    Workers on other hosts have their own clocks; a server span outside its client span is skew,
    so its subtree is shifted to sit centred in the client span (as Jaeger's UI does). Durations,
    and so the summary, are untouched by skew.
    """
    offsets: dict[str, int] = {}
    stack = [s for s in tree.by_id.values() if s.parent_id not in tree.by_id]
    while stack:
        s = stack.pop()
        shift = offsets.get(s.parent_id, 0)
        if tree.is_server(s):
            client = tree.by_id[s.parent_id]
            c0, c1 = client.start_ns + shift, client.end_ns + shift
            if s.start_ns + shift < c0 or s.end_ns + shift > c1:
                shift = c0 + max(0, client.duration_ns - s.duration_ns) // 2 - s.start_ns
        offsets[s.span_id] = shift
        stack.extend(tree.children[s.span_id])
    return offsets


def layout(spans: list[Span], trace_id: str | None = None) -> Layout:
    """What to draw, in ms from the request start: the picture's content without matplotlib."""
    tree = _Tree(select_trace(spans, trace_id))
    req, off = tree.request, _clock_offsets(tree)
    t0 = req.start_ns + off.get(req.span_id, 0)
    ms = lambda ns: ns / 1e6  # noqa: E731
    bars: list[Bar] = []

    def bar(lane, s, style, label="", start=None, end=None):
        start = s.start_ns + off[s.span_id] if start is None else start
        end = s.end_ns + off[s.span_id] if end is None else end
        if end > start:
            bars.append(Bar(lane, ms(start - t0), ms(end - start), style, label))

    orchestrator_styles = {"prefill": "prefill", "rejection_sampling": "sampling", "rollback": "rollback",
                           "close": "close", "draft": "wait-draft", "verify": "wait-target"}
    lane_of = {"draft": "draft worker", "target": "target worker", None: "target worker"}
    for s in tree.subtree(req):
        worker = tree.worker_of(s)
        if s.service == tree.home and s.name in orchestrator_styles:
            bar("orchestrator", s, orchestrator_styles[s.name], "prefill" if s.name == "prefill" else "")
        elif s.service == tree.home and s.name == "draft_ahead":
            bar("draft ahead", s, "ahead", "ahead")
        elif tree.is_server(s):
            client = tree.by_id[s.parent_id]
            bar("network / RPC", client, "network", end=s.start_ns + off[s.span_id])
            bar("network / RPC", client, "network", start=s.end_ns + off[s.span_id])
            bar(lane_of[worker], s, "server")
        elif s.name == "forward" or (s.name == "prefill" and s.service != tree.home):
            style = "prefill" if tree.in_prefill(s) else worker or "target"
            style = "draft-ahead" if style == "draft" and tree.in_ahead(s) else style
            label = "prefill" if s.name == "prefill" else "verify" if style == "target" else ""
            bar(lane_of[worker], s, style, label)
        elif s.name == "truncate":
            bar(lane_of[worker], s, "rollback")
    # steps with no worker spans: the orchestrator's view, hatched, on the worker's lane
    for worker, stage in tree.stages():
        inside = list(tree.subtree(stage))
        if not any(s.service != tree.home or s.name == "forward" for s in inside):
            rpc = next((s for s in inside if s is not stage and s.name.endswith(RPC_NAMES)), stage)
            bar(lane_of[worker], rpc, f"unsplit-{worker or 'target'}", "draft" if worker == "draft" else "verify")

    rounds = [Round(ms(s.start_ns + off[s.span_id] - t0), ms(s.end_ns + off[s.span_id] - t0),
                    int(s.attributes.get("specdec.round", i)), int(s.attributes.get("specdec.drafted_tokens", 0)),
                    int(s.attributes.get("specdec.accepted_tokens", 0)))
             for i, s in enumerate(s for s in tree.subtree(req) if s.name == "round" and s.service == tree.home)]
    used = {b.lane for b in bars}
    lanes = [lane for lane in LANES if lane in used or lane in ("orchestrator", "target worker")]
    return Layout(_summarize(tree), lanes, bars, rounds, ms(req.duration_ns),
                  str(req.attributes.get("specdec.session_id", "")))


def round_labels(rounds: list[Round], px_per_ms: float, char_px: float) -> list[tuple[float, str, str]]:
    """(x ms, text, colour) for the round labels that fit: the full "r7 3/4" where the round is wide
    enough, else the number alone, skipping any that would overlap the previous one."""
    out, right = [], float("-inf")
    for r in rounds:
        full = f"r{r.index}\n{r.accepted}/{r.drafted}" if r.drafted else f"r{r.index}"
        width = lambda text: max(len(line) for line in text.split("\n")) * char_px  # noqa: E731
        text = full if (r.end_ms - r.start_ms) * px_per_ms >= width(full) + 4 else f"{r.index}"
        half = width(text) / 2
        x = (r.start_ms + r.end_ms) / 2
        if x * px_per_ms - half < right + 3:
            continue
        right = x * px_per_ms + half
        colour = ("#555555" if not r.drafted else "#2e8b46" if r.accepted == r.drafted
                  else "#c9403a" if r.accepted == 0 else "#555555")
        out.append((x, text, colour))
    return out


def _summary_text(s: Summary) -> str:
    rows = [("prefill", s.prefill_s), ("draft compute", s.draft_compute_s), ("verify compute", s.verify_compute_s),
            ("worker other", s.worker_other_s), ("network/RPC", s.network_s)]
    if s.missing_worker_spans:
        rows.append(("draft/verify*", s.unsplit_s))
    rows += [("sampling", s.sampling_s), ("rollback", s.rollback_s), ("close", s.close_s), ("other", s.other_s)]
    total = s.total_s or 1.0
    lines = [f"{'request':<15}{s.total_s * 1e3:9.2f} ms", ""]
    lines += [f"{name:<15}{sec * 1e3:9.2f} ms {100 * sec / total:5.1f}%" for name, sec in rows]
    lines += ["", f"{s.rounds} rounds, gamma {s.gamma}", f"accepted {s.accepted_tokens}/{s.drafted_tokens} drafts",
              f"{s.input_tokens} prompt -> {s.output_tokens} new tokens"]
    if s.wire_bytes:
        lines.append(f"wire {s.wire_bytes / 1024:.1f} KiB")
    if s.ahead_calls:
        hidden = 100 * s.ahead_overlap_s / s.ahead_s if s.ahead_s else 0.0
        lines += ["", f"{s.ahead_calls} Proposes ahead", f"  {s.ahead_s * 1e3:.2f} ms, {hidden:.0f}% beside verify"]
    if s.missing_worker_spans:
        lines += ["", f"* {s.missing_worker_spans} steps without worker", "  spans: network not split off"]
    return "\n".join(lines)


def render(lay: Layout, out_path, title: str | None = None, dpi: int = 110) -> Path:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit(f"specdec timeline draws with matplotlib, which is not installed: {PLOTS_EXTRA}") from None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    from matplotlib.transforms import blended_transform_factory

    s = lay.summary
    fig = Figure(figsize=(16, 2.9 + 0.8 * len(lay.lanes)), dpi=dpi)  # no pyplot: no global state
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(1, 2, width_ratios=[5, 1.15], wspace=0.03, left=0.075, right=0.99, top=0.84, bottom=0.2)
    ax, side = fig.add_subplot(grid[0]), fig.add_subplot(grid[1])
    side.axis("off")

    ends = [b.start_ms + b.width_ms for b in lay.bars] + [lay.end_ms]
    lo, hi = min([0.0] + [b.start_ms for b in lay.bars]), max(ends)
    pad = (hi - lo) * 0.01 or 1.0
    ax.set_xlim(lo - pad, hi + pad)
    ax.set_ylim(-0.6, len(lay.lanes) - 0.15)
    px_per_ms = ax.get_position().width * fig.get_figwidth() * dpi / (hi - lo + 2 * pad)
    char_px = 0.62 * 7 / 72 * dpi  # a 7-point character
    y_of = {lane: len(lay.lanes) - 1 - i for i, lane in enumerate(lay.lanes)}

    for i, r in enumerate(lay.rounds):  # alternate shading tells the rounds apart at a glance
        ax.axvspan(r.start_ms, r.end_ms, color="#eef1f5" if i % 2 == 0 else "#fbfbfb", zorder=0, lw=0)
    top = blended_transform_factory(ax.transData, ax.transAxes)
    for x, text, colour in round_labels(lay.rounds, px_per_ms, char_px):
        ax.text(x, 0.985, text, transform=top, ha="center", va="top", fontsize=7, color=colour, linespacing=1.0)

    min_w = 1.0 / px_per_ms  # sub-pixel bars (sampling, rollback) drawn one pixel wide so they show
    for z, (style, (colour, _, height, hatch)) in enumerate(STYLES.items()):
        for lane in lay.lanes:
            spans = [(b.start_ms, max(b.width_ms, min_w)) for b in lay.bars if b.style == style and b.lane == lane]
            if spans:
                edge = EDGES.get(style, "none")
                ax.broken_barh(spans, (y_of[lane] - height / 2, height), facecolors=colour, edgecolors=edge,
                               linewidth=0.4 if edge != "none" else 0, hatch=hatch, zorder=2 + z)
    for b in lay.bars:  # labels only where they fit inside the bar
        if b.label and b.width_ms * px_per_ms > len(b.label) * char_px + 6:
            ax.text(b.start_ms + b.width_ms / 2, y_of[b.lane], b.label, ha="center", va="center", fontsize=7,
                    color="black" if b.style.startswith("unsplit") else "white", zorder=50)

    ax.set_yticks(list(y_of.values()), list(y_of.keys()), fontsize=9)
    ax.set_xlabel("ms since the request started", fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(axis="x", color="#d0d0d0", lw=0.5, zorder=1)
    ax.set_axisbelow(True)
    for spine in ("top", "right"):
        ax.spines[spine].set_visible(False)

    rate = f", acceptance {s.acceptance_rate:.0%}" if s.drafted_tokens else ""
    plural = lambda n, word: f"{n} {word}" + ("" if n == 1 else "s")  # noqa: E731
    fig.suptitle(title or f"{s.model or 'speculative decoding'}: {plural(s.output_tokens, 'token')} in "
                 f"{s.total_s * 1e3:.0f} ms, {s.tokens_per_second:.1f} tok/s{rate} "
                 f"(gamma {s.gamma}, {plural(s.rounds, 'round')})",
                 fontsize=13, x=0.075, ha="left", y=0.975)
    session = f"   session {lay.session_id}" if lay.session_id else ""
    fig.text(0.075, 0.905, f"{s.operation}   trace {s.trace_id}{session}", fontsize=8, color="#666666")
    side.text(0.02, 1.0, _summary_text(s), transform=side.transAxes, va="top", ha="left", family="monospace",
              fontsize=8, bbox=dict(boxstyle="round,pad=0.6", facecolor="#f7f7f7", edgecolor="#c8c8c8"))

    seen = {b.style for b in lay.bars}
    handles, labelled = [], set()
    for style in LEGEND_ORDER:
        colour, text, _, hatch = STYLES[style]
        sibling = style.replace("target", "draft")
        if style in seen and (text or STYLES[sibling][1] not in labelled):
            text = text or STYLES[sibling][1]
            labelled.add(text)
            handles.append(Patch(facecolor=colour, edgecolor=EDGES.get(style, colour) if hatch else colour,
                                 hatch=hatch, label=text))
    fig.legend(handles=handles, loc="lower left", bbox_to_anchor=(0.07, 0.0), ncol=min(4, len(handles)),
               fontsize=8, frameon=False)

    out = Path(out_path)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, format="png")
    except OSError as exc:
        raise TimelineError(f"cannot write {out}: {exc.strerror or exc}") from None
    return out


def draw(spans: list[Span], out_path, title: str | None = None, trace_id: str | None = None) -> Summary:
    """Draws the request of trace_id (default: the latest one) into a PNG; returns its summary."""
    lay = layout(spans, trace_id)
    render(lay, out_path, title)
    return lay.summary


# ---- command line -----------------------------------------------------------------------------


def main(argv: list[str] | None = None, prog: str = "python -m specdec_tools.timeline") -> int:
    p = argparse.ArgumentParser(prog=prog, description="Draw one speculative-decoding request's timeline "
                                "from its OpenTelemetry spans.")
    p.add_argument("source", metavar="SOURCE", help="console-exporter log (OTEL_TRACES_EXPORTER=console), "
                   "Jaeger JSON file, '-' for stdin, or a Jaeger URL such as http://localhost:16686")
    p.add_argument("--out", default="timeline.png", help="PNG to write (default timeline.png)")
    p.add_argument("--trace-id", help="the trace to draw (hex, a unique prefix will do); default: the latest request")
    p.add_argument("--service", default=ORCHESTRATOR_SERVICE, help="service to ask Jaeger for (default %(default)s)")
    p.add_argument("--title", help="replace the generated title")
    a = p.parse_args(argv)
    try:
        spans = load_spans(a.source, a.trace_id, a.service)
        if not spans:
            raise TimelineError(f"no spans found in {a.source} (services print them with OTEL_TRACES_EXPORTER=console)")
        s = draw(spans, a.out, a.title, a.trace_id)
    except TimelineError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    print(f"{a.out}: trace {s.trace_id}, {s.rounds} rounds, {s.output_tokens} tokens in {s.total_s * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
