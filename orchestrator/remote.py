"""gRPC clients of the draft and target workers, implementing orchestrator.workers.

They convert between plain dataclasses and proto, count the bytes each call moves (protobuf
payload plus gRPC's 5-byte message prefix), and turn a worker's error status into the same
ServiceError an in-process worker raises.
"""

from __future__ import annotations

import time
from typing import Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.errors import ServiceError, Unavailable, from_rpc_error
from specdec.protocol import (WORKER_MAX_MESSAGE_BYTES, CompactProbs, DraftOptions, ModelInfo, Proposal, SamplingParams,
                              Verification, message_options)
from specdec.security import ClientTls, open_channel
from specdec.telemetry import Telemetry
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

GRPC_PREFIX_BYTES = 5  # each gRPC message is framed by a flag byte and a 4-byte length
# gRPC backs off reconnecting up to 120 s by default; a restarted worker should rejoin its pool
# within a couple of polls instead (measured in the load test: 19 s before this, with 1 s polls)
DESCRIBE_TIMEOUT_S = 2.0
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                     ("grpc.max_reconnect_backoff_ms", 2000)]


def _wire(*messages) -> int:
    return sum(m.ByteSize() + GRPC_PREFIX_BYTES for m in messages)


class _RemoteWorker:
    role = "worker"

    def __init__(self, address: str, *, timeout_s: float = 60.0, telemetry: Telemetry | None = None,
                 tls: ClientTls | None = None, server_name: str | None = None):
        self.address = address
        self.timeout_s = timeout_s
        self._raw_channel = open_channel(address, tls, message_options(WORKER_MAX_MESSAGE_BYTES) + RECONNECT_OPTIONS,
                                         server_name)
        # with tracing on: a client span per call, and the trace context in the call's metadata
        self.channel = telemetry.instrument_channel(self._raw_channel) if telemetry else self._raw_channel
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self._info: ModelInfo | None = None
        self.vocab_size = 0
        self._secrets: dict[str, bytes] = {}  # session id -> the secret its OpenSession returned

    @property
    def peer(self) -> str:
        return f"{self.role} worker at {self.address}"

    def _call(self, method, request, timeout: float | None = None):
        try:
            return method(request, timeout=timeout or self.timeout_s)
        except grpc.RpcError as err:
            raise from_rpc_error(err, self.peer) from None

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

    def open_session(self, session_id: str, token_ids: list[int]) -> tuple[int, float]:
        r = self._call(self._stub.OpenSession, common_pb2.OpenSessionRequest(session_id=session_id, token_ids=token_ids))
        self._secrets[session_id] = r.session_secret
        return r.length, r.compute_s

    def secret(self, session_id: str) -> bytes:
        return self._secrets.get(session_id, b"")

    def truncate(self, session_id: str, length: int) -> int:
        return self._call(self._stub.Truncate, common_pb2.TruncateRequest(
            session_id=session_id, length=length, session_secret=self.secret(session_id))).length

    def close_session(self, session_id: str) -> None:
        try:
            self._call(self._stub.CloseSession, common_pb2.CloseSessionRequest(
                session_id=session_id, session_secret=self.secret(session_id)))
        finally:
            self._secrets.pop(session_id, None)

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

    def propose(
        self, session_id: str, start: int, token_ids: list[int], gamma: int, params: SamplingParams, seed: int,
        options: DraftOptions = DraftOptions(),
    ) -> Iterator[Proposal]:
        request = draft_pb2.ProposeRequest(
            session_id=session_id, start=start, token_ids=token_ids, gamma=gamma, sampling=params.to_proto(), seed=seed,
            options=options.to_proto() if options != DraftOptions() else None, session_secret=self.secret(session_id),
        )
        request_bytes = _wire(request)
        # a Propose that first catches up many tokens (a lazily opened session, or rounds that did
        # not draft) is a prefill in disguise: it gets a prefill's deadline
        timeout = self.round_timeout_s
        if len(token_ids) > CATCH_UP_TOKENS:
            timeout = max(timeout, self.timeout_s)
        try:
            for msg in self._stub.Propose(request, timeout=timeout):
                probs = CompactProbs.from_proto(msg.probs, self.vocab_size) if msg.HasField("probs") else None
                yield Proposal(msg.index, msg.token_id, probs, msg.compute_s, msg.batch_rows, msg.pass_s,
                               request_bytes + _wire(msg))
                request_bytes = 0
        except grpc.RpcError as err:
            raise from_rpc_error(err, self.peer) from None


class RemoteTarget(_RemoteWorker):
    role = "target"

    def __init__(self, address: str, **kwargs):
        super().__init__(address, **kwargs)
        self._stub = target_pb2_grpc.TargetWorkerStub(self.channel)

    def verify(
        self, session_id: str, start: int, token_ids: list[int], draft_token_ids: list[int], params: SamplingParams,
        top_logprobs: int | None = None,
    ) -> Verification:
        request = target_pb2.VerifyRequest(
            session_id=session_id, start=start, token_ids=token_ids, draft_token_ids=draft_token_ids,
            sampling=params.to_proto(), logprobs=top_logprobs is not None, top_logprobs=top_logprobs or 0,
            session_secret=self.secret(session_id),
        )
        r = self._call(self._stub.Verify, request)
        probs = [CompactProbs.from_proto(p, self.vocab_size) for p in r.probs] if not params.greedy else None
        argmax = list(r.argmax_token_ids) if params.greedy else None
        if (argmax if params.greedy else probs) is None or len(argmax or probs) != len(draft_token_ids) + 1:
            raise ServiceError(f"{self.peer} returned a malformed verification", grpc.StatusCode.INTERNAL)
        positions = len(draft_token_ids) + 1
        bases = top = None
        if top_logprobs is not None:
            bases = list(r.logprob_bases)
            top = [(list(t.token_ids), list(t.logprobs)) for t in r.top_logprobs] if top_logprobs else None
            if len(bases) != positions or (top is not None and len(top) != positions):
                raise ServiceError(f"{self.peer} returned malformed logprobs", grpc.StatusCode.INTERNAL)
        return Verification(argmax, probs, r.length, r.compute_s, r.batch_rows, r.pass_s, _wire(request, r),
                            logprob_bases=bases, top_logprobs=top)

    def tokenizer_files(self) -> dict[str, bytes]:
        files: dict[str, bytearray] = {}
        try:
            for chunk in self._stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=self.timeout_s):
                files.setdefault(chunk.name, bytearray()).extend(chunk.data)
        except grpc.RpcError as err:
            raise from_rpc_error(err, self.peer) from None
        return {name: bytes(data) for name, data in files.items()}
