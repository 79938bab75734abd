"""The Python clients of the orchestrator: blocking (Client) and asyncio (AsyncClient).

    from orchestrator.client import Client
    result = Client("localhost:50050").generate(prompt="def fib(n):", max_new_tokens=64, temperature=0)
    print(result.text, result.finish_reason, result.stats["acceptance_rate"])

    async with AsyncClient("localhost:50050") as client:
        async for chunk in client.stream(prompt="def fib(n):", max_new_tokens=64):
            print(chunk.text_delta, end="")

Unset arguments take the server's defaults. A refused request raises specdec.errors.ServiceError
whose .code is the gRPC status. Neither client imports torch or transformers.
"""

from __future__ import annotations

import time
import asyncio
from typing import AsyncIterator, Iterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.errors import ServiceError, Unavailable
from specdec.protocol import (CLIENT_MAX_MESSAGE_BYTES, GenerationChunk, GenerationResult, chunk_from_proto,
                              message_options, request_to_proto, result_from_proto)
from specdec.security import ClientTls, open_aio_channel, open_channel
from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc

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
        request = request_to_proto(prompt, **kwargs)
        try:
            r = self.stub.Generate(request, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as err:
            raise ServiceError(err.details(), err.code()) from None
        return result_from_proto(r)

    def stream(self, prompt: str | None = None, **kwargs) -> Iterator[GenerationChunk]:
        """Yields chunks as rounds complete; the last has finish_reason and stats (a dict)."""
        request = request_to_proto(prompt, **kwargs)
        call = None
        try:
            call = self.stub.GenerateStream(request, timeout=self.timeout_s, metadata=self._metadata)
            for c in call:
                yield chunk_from_proto(c)
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


class AsyncClient:
    """The same calls as Client, for asyncio programs (grpc.aio): many requests on one channel
    without a thread each. Leaving `stream` early (break, or the task cancelled) cancels the
    request on the server, which stops it within one round."""

    def __init__(self, address: str, *, timeout_s: float | None = None, tls: ClientTls | None = None,
                 token: str | None = None):
        self.address = address
        self.timeout_s = timeout_s
        self.channel = open_aio_channel(address, tls, message_options(CLIENT_MAX_MESSAGE_BYTES))
        self.stub = orchestrator_pb2_grpc.OrchestratorStub(self.channel)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None

    async def generate(self, prompt: str | None = None, **kwargs) -> GenerationResult:
        request = request_to_proto(prompt, **kwargs)
        try:
            r = await self.stub.Generate(request, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as err:
            raise ServiceError(err.details(), err.code()) from None
        return result_from_proto(r)

    async def stream(self, prompt: str | None = None, **kwargs) -> AsyncIterator[GenerationChunk]:
        """Yields chunks as rounds complete; the last has finish_reason and stats (a dict)."""
        call = self.stub.GenerateStream(request_to_proto(prompt, **kwargs), timeout=self.timeout_s,
                                        metadata=self._metadata)
        try:
            async for c in call:
                yield chunk_from_proto(c)
        except grpc.RpcError as err:
            raise ServiceError(err.details(), err.code()) from None
        finally:
            call.cancel()  # a no-op once it is done

    async def workers(self) -> list[dict]:
        return await self._worker_list(self.stub.ListWorkers, orchestrator_pb2.ListWorkersRequest())

    async def add_workers(self, target: Sequence[str] = (), draft: Sequence[str] = ()) -> list[dict]:
        request = orchestrator_pb2.AddWorkersRequest(target=list(target), draft=list(draft))
        return await self._worker_list(self.stub.AddWorkers, request)

    async def _worker_list(self, method, request) -> list[dict]:
        try:
            r = await method(request, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as err:
            raise ServiceError(err.details(), err.code()) from None
        return [{f.name: getattr(w, f.name) for f in w.DESCRIPTOR.fields} for w in r.workers]

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
