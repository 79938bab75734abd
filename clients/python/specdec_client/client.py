"""The Python clients of the orchestrator: blocking (Client) and asyncio (AsyncClient).

    from specdec_client import Client
    result = Client("localhost:50050").generate(prompt="def fib(n):", max_new_tokens=64, temperature=0)
    print(result.text, result.finish_reason, result.stats["acceptance_rate"])

    async with AsyncClient("localhost:50050") as client:
        async for chunk in client.stream(prompt="def fib(n):", max_new_tokens=64):
            print(chunk.text_delta, end="")

Unset arguments take the server's defaults. A refused request raises
specdec_client.ServiceError whose .code is the gRPC status. Neither client needs torch or
transformers: this package depends on grpcio, grpcio-health-checking and protobuf only.

How the channel behaves (gRPC's own machinery, set through the channel's service config):

- address: any gRPC target. `HOST:PORT`; `dns:///NAME:PORT`, where every address the name
  resolves to is used (several orchestrators behind a Kubernetes headless Service, whose name
  resolves to every ready pod); or a fixed list, `ipv4:10.0.0.1:50050,10.0.0.2:50050`.
- load_balancing="round_robin" (default) spreads calls over every address the target gives and
  skips those that are down; "pick_first" sticks to one until it fails.
- retries=3 (default; 0 to 4): a call that fails with UNAVAILABLE before any response has
  arrived is tried again, up to `retries` more times, after a random backoff of up to 0.2 s,
  0.4 s, 0.8 s... (at most 2 s); round_robin sends the next attempt to another address. gRPC
  retries only while nothing has been received: a GenerateStream that delivered its first chunk
  is never restarted, and its failure raises (a retry would repeat text the caller has already
  seen). A Generate that failed before answering has no effect to undo, so trying it again is
  safe. Retries are throttled per target (gRPC's retryThrottling: after a run of failures
  retries pause until calls succeed again), and timeout_s bounds the call with all its attempts.
  Requests over 256 KiB are not retried (gRPC's retry buffer).
- keepalive_s=30 (default; 0: off): while a call is in flight, ping the server after this many
  seconds without traffic and give up on the connection when no answer comes within 20 s, so a
  vanished server fails the call instead of hanging it. Never below 10 s: the servers (default
  --keepalive 60) let clients ping every 10 s and answer faster pings with GOAWAY
  "too_many_pings". Idle connections are not pinged (the servers ping them). A server started
  with --keepalive 0 keeps gRPC's default of one ping per 5 minutes: use keepalive_s=0 (or
  >= 300) with it.
- options: further gRPC channel options, appended last (they win).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, AsyncIterator, Iterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec_client.channel import ClientTls, open_aio_channel, open_channel
from specdec_client.errors import ServiceError, Unavailable, param_of
from specdec_client.protocol import (CLIENT_MAX_MESSAGE_BYTES, GenerationChunk, GenerationResult, chunk_from_proto,
                                     message_options, request_to_proto, result_from_proto)
from specdec_client.v1 import orchestrator_pb2, orchestrator_pb2_grpc

DEFAULT_RETRIES = 3  # attempts after the first
MAX_RETRIES = 4  # gRPC caps maxAttempts at 5
RETRY_INITIAL_BACKOFF_S = 0.2
RETRY_MAX_BACKOFF_S = 2.0
RETRY_BACKOFF_MULTIPLIER = 2.0
# gRPC's token bucket per target: each failed attempt takes 1 token, each success gives back
# 0.1; retries stop while it holds half or less (so a dead service is not hammered 4x).
RETRY_THROTTLING = {"maxTokens": 10, "tokenRatio": 0.1}
RETRIED_SERVICES = ("specdec.v1.Orchestrator", "grpc.health.v1.Health")
LOAD_BALANCING = ("round_robin", "pick_first")
DEFAULT_KEEPALIVE_S = 30.0
MIN_KEEPALIVE_S = 10.0  # what every server version accepts (today's accept pings every PING_MIN_S, specdec/grpc_server.py)
KEEPALIVE_TIMEOUT_S = 20.0  # as the servers' own pings


def service_config(retries: int = DEFAULT_RETRIES, load_balancing: str = "round_robin") -> dict:
    """The channel's gRPC service config: the load-balancing policy, and the retry policy for
    UNAVAILABLE on every Orchestrator and Health method (none when retries is 0)."""
    if not isinstance(retries, int) or not 0 <= retries <= MAX_RETRIES:
        raise ValueError(f"retries must be an integer in [0, {MAX_RETRIES}], got {retries!r}")
    if load_balancing not in LOAD_BALANCING:
        raise ValueError(f"load_balancing must be one of {LOAD_BALANCING}, got {load_balancing!r}")
    config: dict[str, Any] = {"loadBalancingConfig": [{load_balancing: {}}]}
    if retries:
        config["methodConfig"] = [{
            "name": [{"service": s} for s in RETRIED_SERVICES],
            "retryPolicy": {
                "maxAttempts": retries + 1,
                "initialBackoff": f"{RETRY_INITIAL_BACKOFF_S}s",
                "maxBackoff": f"{RETRY_MAX_BACKOFF_S}s",
                "backoffMultiplier": RETRY_BACKOFF_MULTIPLIER,
                "retryableStatusCodes": ["UNAVAILABLE"],
            },
        }]
        config["retryThrottling"] = dict(RETRY_THROTTLING)
    return config


def keepalive_options(keepalive_s: float = DEFAULT_KEEPALIVE_S) -> list[tuple[str, int]]:
    """Client keepalive within what the servers permit (no pings more often than every 10 s)."""
    if keepalive_s != 0 and not keepalive_s >= MIN_KEEPALIVE_S:  # also refuses NaN and negatives
        raise ValueError(f"keepalive_s must be 0 (off) or >= {MIN_KEEPALIVE_S:.0f}: the servers answer more "
                         f"frequent pings with GOAWAY too_many_pings; got {keepalive_s!r}")
    if keepalive_s == 0:
        return []
    return [("grpc.keepalive_time_ms", int(keepalive_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
            # only while calls are in flight: a server with --keepalive 0 would count idle pings as abuse
            ("grpc.keepalive_permit_without_calls", 0),
            # keep pinging through a long unary Generate, during which nothing else is sent
            ("grpc.http2.max_pings_without_data", 0)]


def channel_options(*, retries: int = DEFAULT_RETRIES, load_balancing: str = "round_robin",
                    keepalive_s: float = DEFAULT_KEEPALIVE_S, options: Sequence[tuple[str, Any]] = ()) -> list:
    """Every gRPC channel option a Client sets: message limits, service config, keepalive."""
    return [*message_options(CLIENT_MAX_MESSAGE_BYTES),
            ("grpc.service_config", json.dumps(service_config(retries, load_balancing))),
            ("grpc.service_config_disable_resolution", 1),  # ours, not one a DNS TXT record names
            ("grpc.enable_retries", 1),
            *keepalive_options(keepalive_s),
            *options]


def _bearer(token: str | None):
    return (("authorization", f"Bearer {token}"),) if token else None


def _error(err: grpc.RpcError) -> ServiceError:
    return ServiceError(err.details(), err.code(), param_of(err))


def _workers(response) -> list[dict]:
    return [{f.name: getattr(w, f.name) for f in w.DESCRIPTOR.fields} for w in response.workers]


class Client:
    """A blocking client of the orchestrator; safe to share between threads.

    address: a gRPC target (HOST:PORT, dns:///NAME:PORT, ipv4:A:P,B:P); timeout_s: the deadline of
    each call, all its attempts included (None: none); tls: verify the orchestrator (and present
    a client certificate, for mutual TLS); token: sent as 'authorization: Bearer <token>' on every
    call; retries, load_balancing, keepalive_s, options: see the module's docstring."""

    def __init__(self, address: str, *, timeout_s: float | None = None, tls: ClientTls | None = None,
                 token: str | None = None, retries: int = DEFAULT_RETRIES, load_balancing: str = "round_robin",
                 keepalive_s: float = DEFAULT_KEEPALIVE_S, options: Sequence[tuple[str, Any]] = ()):
        self.address = address
        self.timeout_s = timeout_s
        self.channel = open_channel(address, tls, channel_options(retries=retries, load_balancing=load_balancing,
                                                                  keepalive_s=keepalive_s, options=options))
        self.stub = orchestrator_pb2_grpc.OrchestratorStub(self.channel)
        self._metadata = _bearer(token)

    def generate(self, prompt: str | None = None, *, token: str | None = None, **kwargs) -> GenerationResult:
        """token: this call's bearer token instead of the client's (a gateway forwarding its users')."""
        request = request_to_proto(prompt, **kwargs)
        try:
            r = self.stub.Generate(request, timeout=self.timeout_s, metadata=_bearer(token) or self._metadata)
        except grpc.RpcError as err:
            raise _error(err) from None
        return result_from_proto(r)

    def stream(self, prompt: str | None = None, *, token: str | None = None, **kwargs) -> Iterator[GenerationChunk]:
        """Yields chunks as rounds complete; the last has finish_reason and stats (a dict). A
        stream that fails after its first chunk raises ServiceError (it is never restarted).
        token: as for generate."""
        request = request_to_proto(prompt, **kwargs)
        call = None
        try:
            call = self.stub.GenerateStream(request, timeout=self.timeout_s, metadata=_bearer(token) or self._metadata)
            for c in call:
                yield chunk_from_proto(c)
        except grpc.RpcError as err:
            raise _error(err) from None
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
            return _workers(method(request, timeout=self.timeout_s, metadata=self._metadata))
        except grpc.RpcError as err:
            raise _error(err) from None

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


class AsyncClient:
    """The same calls as Client, for asyncio programs (grpc.aio): many requests on one channel
    without a thread each, with the same options (retries, load_balancing, keepalive_s). Leaving
    `stream` early (break, or the task cancelled) cancels the request on the server, which stops
    it within one round."""

    def __init__(self, address: str, *, timeout_s: float | None = None, tls: ClientTls | None = None,
                 token: str | None = None, retries: int = DEFAULT_RETRIES, load_balancing: str = "round_robin",
                 keepalive_s: float = DEFAULT_KEEPALIVE_S, options: Sequence[tuple[str, Any]] = ()):
        self.address = address
        self.timeout_s = timeout_s
        self.channel = open_aio_channel(address, tls, channel_options(retries=retries, load_balancing=load_balancing,
                                                                      keepalive_s=keepalive_s, options=options))
        self.stub = orchestrator_pb2_grpc.OrchestratorStub(self.channel)
        self._metadata = _bearer(token)

    async def generate(self, prompt: str | None = None, *, token: str | None = None, **kwargs) -> GenerationResult:
        """token: this call's bearer token instead of the client's (a gateway forwarding its users')."""
        request = request_to_proto(prompt, **kwargs)
        try:
            r = await self.stub.Generate(request, timeout=self.timeout_s, metadata=_bearer(token) or self._metadata)
        except grpc.RpcError as err:
            raise _error(err) from None
        return result_from_proto(r)

    async def stream(self, prompt: str | None = None, *, token: str | None = None,
                     **kwargs) -> AsyncIterator[GenerationChunk]:
        """Yields chunks as rounds complete; the last has finish_reason and stats (a dict). token:
        as for generate."""
        call = self.stub.GenerateStream(request_to_proto(prompt, **kwargs), timeout=self.timeout_s,
                                        metadata=_bearer(token) or self._metadata)
        try:
            async for c in call:
                yield chunk_from_proto(c)
        except grpc.RpcError as err:
            raise _error(err) from None
        finally:
            call.cancel()  # a no-op once it is done

    async def workers(self) -> list[dict]:
        return await self._worker_list(self.stub.ListWorkers, orchestrator_pb2.ListWorkersRequest())

    async def add_workers(self, target: Sequence[str] = (), draft: Sequence[str] = ()) -> list[dict]:
        request = orchestrator_pb2.AddWorkersRequest(target=list(target), draft=list(draft))
        return await self._worker_list(self.stub.AddWorkers, request)

    async def _worker_list(self, method, request) -> list[dict]:
        try:
            return _workers(await method(request, timeout=self.timeout_s, metadata=self._metadata))
        except grpc.RpcError as err:
            raise _error(err) from None

    async def wait_until_ready(self, timeout_s: float = 60.0) -> None:
        stub = health_pb2_grpc.HealthStub(self.channel)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                r = await stub.Check(health_pb2.HealthCheckRequest(), timeout=2.0)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise Unavailable(f"orchestrator at {self.address} is not SERVING after {timeout_s:.0f} s")
            await asyncio.sleep(0.25)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
