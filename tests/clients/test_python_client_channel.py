"""The client's gRPC-native behaviour: retries, round_robin over several orchestrators, keepalive.

- A fake orchestrator that answers UNAVAILABLE counts the attempts: a call that failed before
  any response is tried `retries` more times (and succeeds once the server recovers); a stream
  that delivered a chunk and then failed is tried once only, and raises.
- Two real orchestrators over the same tiny-model workers, one address list
  (`ipv4:127.0.0.1:P1,127.0.0.1:P2`): round_robin uses both (pick_first, the control, one);
  a stream whose orchestrator is stopped mid-way raises, and the other orchestrator never sees
  it again; with one orchestrator gone, every call still succeeds, with the same tokens.
- The options themselves: the service config and keepalive gRPC receives, and what is refused.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter
from concurrent import futures

import grpc
import pytest

from specdec_client import AsyncClient, Client, ServiceError
from specdec_client.client import MIN_KEEPALIVE_S, channel_options, keepalive_options, service_config
from specdec_client.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from tests.support.servers import HOST, paced, start_orchestrator, wait_for

PROMPT = [5, 17, 42, 8, 99, 3]
ASK = dict(token_ids=PROMPT, max_new_tokens=10, temperature=0, gamma=3)


# ---- a fake orchestrator whose failures the test chooses -----------------------------------


class FlakyOrchestrator(orchestrator_pb2_grpc.OrchestratorServicer):
    """fail_first: the first N calls of each method answer UNAVAILABLE before any response;
    cut_streams: every stream sends one chunk, then fails with UNAVAILABLE."""

    def __init__(self, fail_first: int = 0, cut_streams: bool = False):
        self.fail_first, self.cut_streams = fail_first, cut_streams
        self.calls: Counter[str] = Counter()
        self._lock = threading.Lock()

    def _count(self, method: str) -> int:
        with self._lock:
            self.calls[method] += 1
            return self.calls[method]

    def Generate(self, request, context):
        if self._count("Generate") <= self.fail_first:
            context.abort(grpc.StatusCode.UNAVAILABLE, "fake: not yet")
        return orchestrator_pb2.GenerateResponse(text="ok", token_ids=[1, 2],
                                                 finish_reason=orchestrator_pb2.FINISH_REASON_LENGTH,
                                                 stats=orchestrator_pb2.GenerationStats(generated_tokens=2))

    def GenerateStream(self, request, context):
        if self._count("GenerateStream") <= self.fail_first:
            context.abort(grpc.StatusCode.UNAVAILABLE, "fake: not yet")
        yield orchestrator_pb2.GenerateChunk(text_delta="o", token_ids=[1])
        if self.cut_streams:
            context.abort(grpc.StatusCode.UNAVAILABLE, "fake: cut after the first chunk")
        yield orchestrator_pb2.GenerateChunk(text_delta="k", token_ids=[2],
                                             finish_reason=orchestrator_pb2.FINISH_REASON_LENGTH,
                                             stats=orchestrator_pb2.GenerationStats(generated_tokens=2))


@pytest.fixture
def fake():
    """Starts fake orchestrators on free ports (each its own target, so gRPC's per-target retry
    throttling of one test never reaches another): fake(**kwargs) -> (servicer, address)."""
    servers = []

    def start(**kwargs):
        servicer = FlakyOrchestrator(**kwargs)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(servicer, server)
        port = server.add_insecure_port(f"{HOST}:0")
        server.start()
        servers.append(server)
        return servicer, f"{HOST}:{port}"

    yield start
    for server in servers:
        server.stop(None)


@pytest.mark.parametrize("retries", [0, 1, 3])
def test_unavailable_before_any_response_is_tried_retries_more_times(fake, retries):
    servicer, address = fake(fail_first=100)
    with Client(address, timeout_s=30, retries=retries) as client, pytest.raises(ServiceError) as err:
        client.generate(prompt="x")
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert servicer.calls["Generate"] == retries + 1


def test_a_call_that_has_not_started_succeeds_once_the_server_recovers(fake):
    servicer, address = fake(fail_first=2)
    with Client(address, timeout_s=30) as client:  # the default: 3 retries
        assert client.generate(prompt="x").token_ids == [1, 2]
        chunks = list(client.stream(prompt="x"))
    assert [t for c in chunks for t in c.token_ids] == [1, 2] and chunks[-1].finish_reason == "length"
    assert servicer.calls == {"Generate": 3, "GenerateStream": 3}


def test_a_stream_cut_after_its_first_chunk_raises_and_is_not_retried(fake):
    servicer, address = fake(cut_streams=True)
    with Client(address, timeout_s=30, retries=4) as client:
        stream = client.stream(prompt="x")
        assert next(stream).token_ids == [1]
        with pytest.raises(ServiceError) as err:
            next(stream)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE and "cut after the first chunk" in err.value.message
    assert servicer.calls["GenerateStream"] == 1, "a stream that had answered was started again"


def test_the_async_client_retries_the_same_way(fake):
    servicer, address = fake(fail_first=2)
    cut, cut_address = fake(cut_streams=True)

    async def main():
        async with AsyncClient(address, timeout_s=30) as ac:
            whole = await ac.generate(prompt="x")
        async with AsyncClient(cut_address, timeout_s=30) as ac:
            seen = []
            with pytest.raises(ServiceError):
                async for chunk in ac.stream(prompt="x"):
                    seen.append(chunk.token_ids)
        return whole, seen

    whole, seen = asyncio.run(main())
    assert whole.token_ids == [1, 2] and servicer.calls["Generate"] == 3
    assert seen == [[1]] and cut.calls["GenerateStream"] == 1


# ---- two real orchestrators over the same workers ------------------------------------------


def _counted(parts, counts: Counter, name: str) -> None:
    """Counts the requests an orchestrator's decoder starts (Generate and GenerateStream both)."""
    original = parts.slot.decoder.generate_stream

    def generate_stream(request):
        counts[name] += 1
        return original(request)

    parts.slot.decoder.generate_stream = generate_stream


def test_round_robin_over_two_orchestrators_survives_one_stopping(stack, client, target_engine, draft_engine):
    tport, dport, _ = stack["ports"]
    ref = client.generate(**ASK)
    started = {name: start_orchestrator([f"{HOST}:{tport}"], [f"{HOST}:{dport}"]) for name in ("a", "b")}
    parts = {name: p for name, (p, _) in started.items()}
    ports = {name: address.rsplit(":", 1)[1] for name, (_, address) in started.items()}
    counts: Counter[str] = Counter()
    for name, p in parts.items():
        _counted(p, counts, name)
    target = f"ipv4:{HOST}:{ports['a']},{HOST}:{ports['b']}"
    go = threading.Event()
    stopper = None
    try:
        with Client(target, timeout_s=60) as both:
            both.wait_until_ready(30)
            for _ in range(6):
                assert both.generate(**ASK).token_ids == ref.token_ids
            assert counts["a"] >= 1 and counts["b"] >= 1, f"round_robin used one orchestrator: {counts}"

            # the control: pick_first sends every call to the one address it connected to
            before = counts.copy()
            with Client(target, timeout_s=60, load_balancing="pick_first") as first:
                for _ in range(4):
                    assert first.generate(**ASK).token_ids == ref.token_ids
            assert sorted((counts - before).values()) == [4], f"pick_first spread its calls: {counts - before}"

            # a stream whose orchestrator stops mid-way raises; the other one never sees it again
            for p in parts.values():
                p.slot.decoder.generate_stream = paced(p.slot.decoder.generate_stream, lambda i: i > 0 or go.wait(60))
            before = counts.copy()
            stream = both.stream(**ASK)
            first_chunk = next(stream)
            assert first_chunk.token_ids == ref.token_ids[:len(first_chunk.token_ids)]
            (victim,) = (counts - before).keys()
            survivor = "b" if victim == "a" else "a"
            # its gRPC server stops with no grace: the calls in flight end at once (the paced request
            # itself still waits on `go`, and closes its worker sessions once it may go on)
            stopper = threading.Thread(target=parts[victim].server.stop, args=(None,))
            stopper.start()
            with pytest.raises(ServiceError) as cut:
                for _ in stream:
                    pass
            # UNAVAILABLE, the very code retried before a response: after one, never
            assert cut.value.code == grpc.StatusCode.UNAVAILABLE, cut.value
            assert counts[survivor] == before[survivor], "the cut stream was silently restarted elsewhere"
            go.set()
            stopper.join(30)
            # both workers' sessions, before the victim's worker pools stop (the draft's close comes second)
            wait_for(lambda: target_engine.describe().open_sessions == 0 and draft_engine.describe().open_sessions == 0,
                     30, "the cut request's sessions closed")
            parts[victim].stop(None)  # the rest of it: its worker pools

            # one orchestrator gone: every call still succeeds, on the other one
            before = counts.copy()
            for _ in range(6):
                assert both.generate(**ASK).token_ids == ref.token_ids
            for _ in range(2):
                assert [t for c in both.stream(**ASK) for t in c.token_ids] == ref.token_ids

            async def more():
                async with AsyncClient(target, timeout_s=60) as ac:
                    return [(await ac.generate(**ASK)).token_ids for _ in range(3)]

            assert asyncio.run(more()) == [ref.token_ids] * 3
            assert counts[survivor] - before[survivor] == 11 and counts[victim] == before[victim]
    finally:
        go.set()
        if stopper is not None:
            stopper.join(30)
        for p in parts.values():
            p.stop(None)
    # the shared workers hold no session of either orchestrator afterwards
    wait_for(lambda: target_engine.describe().open_sessions == 0 and draft_engine.describe().open_sessions == 0,
             timeout_s=30, what="every session of the two orchestrators closed")


# ---- the options ---------------------------------------------------------------------------


def test_the_service_config_and_keepalive_given_to_grpc():
    options = dict(channel_options())
    config = json.loads(options["grpc.service_config"])
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    (method,) = config["methodConfig"]
    assert {n["service"] for n in method["name"]} == {"specdec.v1.Orchestrator", "grpc.health.v1.Health"}
    policy = method["retryPolicy"]
    assert policy["maxAttempts"] == 4 and policy["retryableStatusCodes"] == ["UNAVAILABLE"]
    assert float(policy["initialBackoff"].rstrip("s")) > 0 and policy["backoffMultiplier"] > 1
    assert config["retryThrottling"]["maxTokens"] > 0
    # keepalive within what the servers permit (specdec/grpc_server.py lets clients ping every second)
    from specdec.grpc_server import connection_options

    server = dict(connection_options(60.0, 0, 0))
    assert options["grpc.keepalive_time_ms"] >= server["grpc.http2.min_recv_ping_interval_without_data_ms"]
    assert MIN_KEEPALIVE_S * 1000 >= server["grpc.http2.min_recv_ping_interval_without_data_ms"]
    assert options["grpc.keepalive_timeout_ms"] == server["grpc.keepalive_timeout_ms"]
    assert options["grpc.keepalive_permit_without_calls"] == 0

    assert "methodConfig" not in service_config(retries=0)
    assert service_config(load_balancing="pick_first")["loadBalancingConfig"] == [{"pick_first": {}}]
    assert keepalive_options(0) == []
    assert dict(channel_options(options=[("grpc.keepalive_time_ms", 120_000)]))["grpc.keepalive_time_ms"] == 120_000


@pytest.mark.parametrize("bad", [dict(retries=5), dict(retries=-1), dict(load_balancing="random"),
                                 dict(keepalive_s=5), dict(keepalive_s=float("nan"))])
def test_options_grpc_would_refuse_or_the_servers_punish_are_refused(bad):
    with pytest.raises(ValueError):
        Client("localhost:1", **bad)
