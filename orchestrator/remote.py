"""gRPC clients of the draft and target workers, implementing orchestrator.workers.

They convert between plain dataclasses and proto, count the bytes each call moves (protobuf
payload plus gRPC's 5-byte message prefix), and turn a worker's error status into the same
ServiceError an in-process worker raises.
"""

from __future__ import annotations

import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.errors import ServiceError, Unavailable, from_rpc_error
from specdec.protocol import SamplingParams, message_options
from specdec.security import ClientTls, open_channel
from specdec.telemetry import Telemetry
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from specdec.wire import (WORKER_MAX_MESSAGE_BYTES, CompactProbs, DraftOptions, Features, ModelInfo, Proposal,
                          ProposeCall, Verification, VerifyCall, error_from_status)

GRPC_PREFIX_BYTES = 5  # each gRPC message is framed by a flag byte and a 4-byte length
# gRPC backs off reconnecting up to 120 s by default; a restarted worker should rejoin its pool
# within a couple of polls instead, so the backoff here stays at most 2 s
DESCRIBE_TIMEOUT_S = 2.0
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                     ("grpc.max_reconnect_backoff_ms", 2000)]
KEEPALIVE_S = 2.0  # the default ping interval on a worker connection (--worker-keepalive)
# a call's deadline: what it should cost (rows at the worker's measured pace) times this, at least
# DEADLINE_FLOOR_S and at most the --worker-timeout: a stalled 1-row verify is given up on in
# seconds, a 4,000-token prefill on a slow CPU still gets its minutes
DEADLINE_SLACK = 20.0
DEADLINE_FLOOR_S = 10.0
SMALL_PASS_ROWS = 16  # a pass of at most this many rows teaches the fixed cost of a pass; bigger ones the cost per row


def keepalive_options(ping_s: float) -> list[tuple[str, int]]:
    """Client keepalive for a worker connection: a ping every ping_s seconds, calls or not; a
    worker that does not answer one within 2 * ping_s (a cut link, a frozen host: nothing resets
    the connection) is cut off, and the calls waiting on it fail UNAVAILABLE at once, to move to
    another worker. The workers' servers accept pings this often (specdec.grpc_server.PING_MIN_S).
    0: off (the kernel's TCP timeouts only: minutes)."""
    if ping_s <= 0:
        return []
    return [("grpc.keepalive_time_ms", int(ping_s * 1000)), ("grpc.keepalive_timeout_ms", int(2 * ping_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)]


class PassClock:
    """A worker's pace, from the passes it reports: a small pass's seconds and a big pass's
    seconds per row (moving averages). deadline(rows) is what a call of that many rows should
    cost, times DEADLINE_SLACK, clamped to [DEADLINE_FLOOR_S, ceiling]; the ceiling until it has
    seen both kinds of pass."""

    def __init__(self, ceiling_s: float):
        self.ceiling_s = ceiling_s
        self.pass_s: float | None = None
        self.row_s: float | None = None

    def observe(self, rows: int, seconds: float) -> None:
        if rows <= 0 or seconds <= 0:
            return
        if rows <= SMALL_PASS_ROWS:
            self.pass_s = seconds if self.pass_s is None else 0.8 * self.pass_s + 0.2 * seconds
        else:
            per_row = seconds / rows
            self.row_s = per_row if self.row_s is None else 0.8 * self.row_s + 0.2 * per_row

    def deadline(self, rows: int) -> float:
        if self.pass_s is None or (rows > SMALL_PASS_ROWS and self.row_s is None):
            return self.ceiling_s
        expected = self.pass_s + rows * (self.row_s or 0.0)
        return min(self.ceiling_s, max(DEADLINE_FLOOR_S, DEADLINE_SLACK * expected))


def _wire(*messages) -> int:
    return sum(m.ByteSize() + GRPC_PREFIX_BYTES for m in messages)


class _RemoteWorker:
    role = "worker"

    def __init__(self, address: str, *, timeout_s: float = 60.0, telemetry: Telemetry | None = None,
                 tls: ClientTls | None = None, server_name: str | None = None, keepalive_s: float = KEEPALIVE_S):
        self.address = address
        self.timeout_s = timeout_s
        self.clock = PassClock(timeout_s)
        self._raw_channel = open_channel(
            address, tls, message_options(WORKER_MAX_MESSAGE_BYTES) + RECONNECT_OPTIONS + keepalive_options(keepalive_s),
            server_name)
        # with tracing on: a client span per call, and the trace context in the call's metadata
        self.channel = telemetry.instrument_channel(self._raw_channel) if telemetry else self._raw_channel
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self._info: ModelInfo | None = None
        self.vocab_size = 0
        self._secrets: dict[str, bytes] = {}  # session id -> the secret its OpenSession returned
        self._opened: dict[str, Features] = {}  # session id -> its prefill's features, until taken
        self._lock = threading.Lock()
        self._calls: set = set()  # unary calls in flight (grpc futures)
        self._abandoned: dict = {}  # call -> why abandon_calls cancelled it

    @property
    def peer(self) -> str:
        return f"{self.role} worker at {self.address}"

    def _call(self, method, request, timeout: float | None = None):
        call = method.future(request, timeout=timeout or self.timeout_s)
        with self._lock:
            self._calls.add(call)
        try:
            return call.result()
        except (grpc.FutureCancelledError, grpc.RpcError) as err:
            with self._lock:
                why = self._abandoned.pop(call, None)
            if why is not None:
                raise Unavailable(f"{self.peer} {why}") from None
            if isinstance(err, grpc.FutureCancelledError):
                raise Unavailable(f"{self.peer}: the call was cancelled") from None
            raise from_rpc_error(err, self.peer) from None
        finally:
            with self._lock:
                self._calls.discard(call)
                self._abandoned.pop(call, None)

    def abandon_calls(self, why: str) -> int:
        """Cancels every call in flight here: each fails UNAVAILABLE ("<peer> <why>") now instead of
        at its deadline, and its request moves to another worker (the pool calls this when the
        worker stops answering). Returns how many there were."""
        with self._lock:
            calls = list(self._calls)
            self._abandoned.update((c, why) for c in calls)
        for call in calls:
            call.cancel()
        return len(calls)

    def _batch(self, method, request, calls: list, convert, timeout: float | None = None) -> list:
        """A batched RPC (request.calls answered by response.results, each with a CallStatus):
        per call, convert(call, result, wire bytes) or the error its status carries. A failure
        of the RPC itself is every call's error. A call's wire bytes are its own messages' (the
        RPC's framing goes to the first)."""
        try:
            response = self._call(method, request, timeout)
        except ServiceError as exc:
            return [exc] * len(calls)
        if len(response.results) != len(calls):
            return [ServiceError(f"{self.peer} answered {len(response.results)} of {len(calls)} calls",
                                 grpc.StatusCode.INTERNAL)] * len(calls)
        out: list = []
        framing = 2 * GRPC_PREFIX_BYTES
        for call, call_msg, result in zip(calls, request.calls, response.results):
            error = error_from_status(result.status, self.peer)
            if error is None:
                try:
                    out.append(convert(call, result, call_msg.ByteSize() + result.ByteSize() + framing))
                    framing = 0
                    continue
                except ServiceError as exc:  # a malformed answer
                    error = exc
            out.append(error)
        return out

    def wait_until_serving(self, timeout_s: float) -> None:
        """Polls the standard health service until SERVING (the model has loaded)."""
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            try:
                status = self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
            except grpc.RpcError as err:
                last = err.code().name
            time.sleep(0.5)
        raise Unavailable(f"{self.peer} is not SERVING after {timeout_s:.0f} s (last status: {last})")

    def describe(self) -> ModelInfo:
        # polled every second by the pool: a stalled worker must not hold the poll for long
        info = ModelInfo.from_proto(self._call(self._stub.Describe, common_pb2.DescribeRequest(),
                                          timeout=min(DESCRIBE_TIMEOUT_S, self.timeout_s)))
        self.vocab_size = info.vocab_size
        return info

    def open_session(self, session_id: str, token_ids: list[int], scope: str = "", *,
                     feature_layers: tuple[int, ...] = ()) -> tuple[int, float, int]:
        r = self._call(self._stub.OpenSession, common_pb2.OpenSessionRequest(
            session_id=session_id, token_ids=token_ids, prefix_scope=scope, feature_layers=feature_layers),
            self.clock.deadline(len(token_ids)))
        self.clock.observe(r.length - r.cached_tokens, r.compute_s)
        self._secrets[session_id] = r.session_secret
        features = Features.from_proto(r.features)
        if features is not None:
            self._opened[session_id] = features
        return r.length, r.compute_s, r.cached_tokens

    def opened_features(self, session_id: str) -> Features | None:
        """The features the session's OpenSession returned (feature_layers), once."""
        return self._opened.pop(session_id, None)

    def fork_session(self, session_id: str, parent_id: str, token_ids: list[int]) -> tuple[int, float, int]:
        r = self._call(self._stub.OpenSession, common_pb2.OpenSessionRequest(
            session_id=session_id, token_ids=token_ids, fork_of=parent_id, fork_secret=self.secret(parent_id)),
            self.clock.deadline(len(token_ids)))
        self._secrets[session_id] = r.session_secret
        return r.length, r.compute_s, r.cached_tokens

    def secret(self, session_id: str) -> bytes:
        return self._secrets.get(session_id, b"")

    def truncate(self, session_id: str, length: int) -> int:
        return self._call(self._stub.Truncate, common_pb2.TruncateRequest(
            session_id=session_id, length=length, session_secret=self.secret(session_id)), self.clock.deadline(0)).length

    def close_session(self, session_id: str) -> None:
        try:
            self._call(self._stub.CloseSession, common_pb2.CloseSessionRequest(
                session_id=session_id, session_secret=self.secret(session_id)), self.clock.deadline(0))
        finally:
            self._secrets.pop(session_id, None)
            self._opened.pop(session_id, None)

    def close(self) -> None:
        self._raw_channel.close()


CATCH_UP_TOKENS = 64  # a Propose bringing more new tokens than this gets the prefill deadline


class RemoteDraft(_RemoteWorker):
    role = "draft"

    def __init__(self, address: str, *, round_timeout_s: float | None = None, **kwargs):
        super().__init__(address, **kwargs)
        self._stub = draft_pb2_grpc.DraftWorkerStub(self.channel)
        # a Propose must finish within this: a stalled draft costs one round, not the request
        self.round_timeout_s = round_timeout_s or self.timeout_s

    def _request(self, c: ProposeCall) -> draft_pb2.ProposeRequest:
        return draft_pb2.ProposeRequest(
            session_id=c.session_id, start=c.start, token_ids=c.token_ids, gamma=c.gamma, sampling=c.params.to_proto(),
            seed=c.seed, options=c.options.to_proto() if c.options != DraftOptions() else None,
            session_secret=self.secret(c.session_id),
            features=c.features.to_proto() if c.features is not None else None)

    def _timeout(self, new_tokens: int) -> float:
        # a Propose that first catches up many tokens (a lazily opened session, or rounds that did
        # not draft) is a prefill in disguise: it gets a prefill's deadline
        return max(self.round_timeout_s, self.timeout_s) if new_tokens > CATCH_UP_TOKENS else self.round_timeout_s

    def _proposal(self, msg: draft_pb2.Proposal, wire_bytes: int) -> Proposal:
        probs = CompactProbs.from_proto(msg.probs, self.vocab_size) if msg.HasField("probs") else None
        return Proposal(msg.index, msg.token_id, probs, msg.compute_s, msg.batch_rows, msg.pass_s, wire_bytes)

    def propose_batch(self, calls: list[ProposeCall]) -> list[list[Proposal] | ServiceError]:
        """One ProposeBatch RPC for all the calls (one step's drafts); per call, its proposals or
        its error (see _RemoteWorker._batch)."""
        request = draft_pb2.ProposeBatchRequest(calls=[self._request(c) for c in calls])

        def proposals(call, result, wire: int) -> list[Proposal]:
            out = [self._proposal(m, 0) for m in result.proposals]
            if out:
                out[0].wire_bytes = wire
            return out

        return self._batch(self._stub.ProposeBatch, request, calls, proposals,
                           timeout=self._timeout(max((len(c.token_ids) for c in calls), default=0)))


class RemoteTarget(_RemoteWorker):
    role = "target"

    def __init__(self, address: str, **kwargs):
        super().__init__(address, **kwargs)
        self._stub = target_pb2_grpc.TargetWorkerStub(self.channel)

    def _request(self, c: VerifyCall) -> target_pb2.VerifyRequest:
        return target_pb2.VerifyRequest(
            session_id=c.session_id, start=c.start, token_ids=c.token_ids, draft_token_ids=c.draft_token_ids,
            sampling=c.params.to_proto(), logprobs=c.top_logprobs is not None, top_logprobs=c.top_logprobs or 0,
            session_secret=self.secret(c.session_id))

    def _verification(self, r: target_pb2.VerifyResponse, c: VerifyCall, wire_bytes: int) -> Verification:
        decided = c.params.deterministic  # the target's own tokens (greedy or coupled), else p per position
        probs = [CompactProbs.from_proto(p, self.vocab_size) for p in r.probs] if not decided else None
        argmax = list(r.argmax_token_ids) if decided else None
        positions = len(c.draft_token_ids) + 1
        if len(argmax if decided else probs) != positions:
            raise ServiceError(f"{self.peer} returned a malformed verification", grpc.StatusCode.INTERNAL)
        bases = top = norms = None
        if c.top_logprobs is not None:
            bases = list(r.logprob_bases)
            top = [(list(t.token_ids), list(t.logprobs)) for t in r.top_logprobs] if c.top_logprobs else None
            norms = list(r.raw_log_norms) or None
            if (len(bases) != positions or (top is not None and len(top) != positions)
                    or (norms is not None and len(norms) != positions)):
                raise ServiceError(f"{self.peer} returned malformed logprobs", grpc.StatusCode.INTERNAL)
        return Verification(argmax, probs, r.length, r.compute_s, r.batch_rows, r.pass_s, wire_bytes,
                            logprob_bases=bases, top_logprobs=top, raw_log_norms=norms,
                            features=Features.from_proto(r.features))

    def verify(
        self, session_id: str, start: int, token_ids: list[int], draft_token_ids: list[int], params: SamplingParams,
        top_logprobs: int | None = None,
    ) -> Verification:
        call = VerifyCall(session_id, start, token_ids, draft_token_ids, params, top_logprobs)
        request = self._request(call)
        r = self._call(self._stub.Verify, request, self.clock.deadline(len(token_ids) + len(draft_token_ids)))
        self.clock.observe(r.batch_rows, r.pass_s)
        return self._verification(r, call, _wire(request, r))

    def verify_batch(self, calls: list[VerifyCall]) -> list[Verification | ServiceError]:
        """One VerifyBatch RPC for all the calls (one step's verify pass); per call, its
        Verification or its error (see _RemoteWorker._batch)."""
        request = target_pb2.VerifyBatchRequest(calls=[self._request(c) for c in calls])
        rows = sum(len(c.token_ids) + len(c.draft_token_ids) for c in calls)
        out = self._batch(self._stub.VerifyBatch, request, calls,
                          lambda call, result, wire: self._verification(result.response, call, wire),
                          timeout=self.clock.deadline(rows))
        done = [v for v in out if not isinstance(v, ServiceError)]
        if done:  # the calls shared one pass (or rode along in a few): the widest saw it whole
            widest = max(done, key=lambda v: v.batch_rows)
            self.clock.observe(widest.batch_rows, widest.pass_s)
        return out

    def tokenizer_files(self) -> dict[str, bytes]:
        files: dict[str, bytearray] = {}
        try:
            for chunk in self._stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=self.timeout_s):
                files.setdefault(chunk.name, bytearray()).extend(chunk.data)
        except grpc.RpcError as err:
            raise from_rpc_error(err, self.peer) from None
        return {name: bytes(data) for name, data in files.items()}
