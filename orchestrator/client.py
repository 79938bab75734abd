"""The Python client of the orchestrator.

    from orchestrator.client import Client
    result = Client("localhost:50050").generate(prompt="def fib(n):", max_new_tokens=64, temperature=0)
    print(result.text, result.finish_reason, result.stats["acceptance_rate"])

Unset arguments take the server's defaults. A refused request raises specdec.errors.ServiceError
whose .code is the gRPC status.
"""

from __future__ import annotations

import time
from typing import Iterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchestrator.speculative import GenerationChunk, GenerationResult
from specdec.errors import InvalidArgument, ServiceError, Unavailable
from specdec.grpc_server import CLIENT_MAX_MESSAGE_BYTES, message_options
from specdec.security import ClientTls, open_channel
from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc

FINISH_NAMES = {
    orchestrator_pb2.FINISH_REASON_LENGTH: "length",
    orchestrator_pb2.FINISH_REASON_EOS: "eos",
    orchestrator_pb2.FINISH_REASON_STOP_STRING: "stop_string",
}


def stats_to_dict(msg: orchestrator_pb2.GenerationStats) -> dict:
    return {
        f.name: list(getattr(msg, f.name)) if f.is_repeated else getattr(msg, f.name)
        for f in msg.DESCRIPTOR.fields
    }


def build_request(
    prompt: str | None = None,
    *,
    messages: Sequence[dict] | None = None,
    token_ids: Sequence[int] | None = None,
    max_new_tokens: int | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    gamma: int | None = None,
    stop: Sequence[str] = (),
) -> orchestrator_pb2.GenerateRequest:
    """The request message; values protobuf cannot hold raise InvalidArgument, as the server would."""
    if sum(x is not None for x in (prompt, messages, token_ids)) > 1:
        raise InvalidArgument("give exactly one of prompt, messages or token_ids")
    try:
        return _build_request(prompt, messages, token_ids, max_new_tokens, temperature, top_k, top_p, seed, gamma, stop)
    except (ValueError, TypeError) as exc:  # e.g. a negative seed or a token id beyond int32
        raise InvalidArgument(f"invalid request: {exc}") from None


def _build_request(prompt, messages, token_ids, max_new_tokens, temperature, top_k, top_p, seed, gamma, stop):
    req = orchestrator_pb2.GenerateRequest(stop=list(stop))
    if prompt is not None:
        req.prompt = prompt
    if messages is not None:
        req.chat.messages.extend(orchestrator_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages)
        req.chat.SetInParent()
    if token_ids is not None:
        req.tokens.token_ids.extend(token_ids)
        req.tokens.SetInParent()
    for name, value in dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                            seed=seed, gamma=gamma).items():
        if value is not None:
            setattr(req, name, value)
    return req


class Client:
    def __init__(self, address: str, *, timeout_s: float | None = None, tls: ClientTls | None = None,
                 token: str | None = None):
        """tls: verify the orchestrator (and present a client certificate, for mutual TLS);
        token: sent as 'authorization: Bearer <token>' on every call."""
        self.address = address
        self.timeout_s = timeout_s
        self.channel = open_channel(address, tls, message_options(CLIENT_MAX_MESSAGE_BYTES))
        self.stub = orchestrator_pb2_grpc.OrchestratorStub(self.channel)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None

    def generate(self, prompt: str | None = None, **kwargs) -> GenerationResult:
        request = build_request(prompt, **kwargs)
        try:
            r = self.stub.Generate(request, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as err:
            raise ServiceError(err.details(), err.code()) from None
        return GenerationResult(r.text, list(r.token_ids), FINISH_NAMES.get(r.finish_reason, ""), stats_to_dict(r.stats))

    def stream(self, prompt: str | None = None, **kwargs) -> Iterator[GenerationChunk]:
        """Yields chunks as rounds complete; the last has finish_reason and stats (a dict)."""
        request = build_request(prompt, **kwargs)
        call = None
        try:
            call = self.stub.GenerateStream(request, timeout=self.timeout_s, metadata=self._metadata)
            for c in call:
                last = c.HasField("stats")
                yield GenerationChunk(
                    c.text_delta, list(c.token_ids), FINISH_NAMES.get(c.finish_reason) if last else None,
                    stats_to_dict(c.stats) if last else None,
                )
        except grpc.RpcError as err:
            raise ServiceError(err.details(), err.code()) from None
        finally:
            if call is not None:
                call.cancel()  # a caller that stops reading cancels the request (a no-op once it is done)

    def workers(self) -> list[dict]:
        """The orchestrator's worker pools: one dict per worker (role, address, state, load...)."""
        return self._worker_list(self.stub.ListWorkers, orchestrator_pb2.ListWorkersRequest())

    def add_workers(self, target: Sequence[str] = (), draft: Sequence[str] = ()) -> list[dict]:
        """Tells the orchestrator about new workers (HOST:PORT each); returns the pools after."""
        request = orchestrator_pb2.AddWorkersRequest(target=list(target), draft=list(draft))
        return self._worker_list(self.stub.AddWorkers, request)

    def _worker_list(self, method, request) -> list[dict]:
        try:
            r = method(request, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as err:
            raise ServiceError(err.details(), err.code()) from None
        return [{f.name: getattr(w, f.name) for f in w.DESCRIPTOR.fields} for w in r.workers]

    def wait_until_ready(self, timeout_s: float = 60.0) -> None:
        """Waits for the orchestrator's health service to report SERVING."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=2.0).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise Unavailable(f"orchestrator at {self.address} is not SERVING after {timeout_s:.0f} s")
            time.sleep(0.25)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
