"""orchestrator.admission: beyond --max-running running requests, requests wait in a bounded FIFO
queue (deadlines and cancellations honoured); RESOURCE_EXHAUSTED only when the queue is full."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from orchestrator.admission import Admission
from orchestrator.client import Client
from specdec.errors import Cancelled, DeadlineExceeded, ResourceExhausted, ServiceError
from tests.support.reference import greedy as reference
from tests.support.servers import start_orchestrator, wait_for


class FakeCall:
    """The two things admission asks of a gRPC context."""

    def __init__(self, timeout_s=None):
        self.active = True
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s

    def is_active(self):
        return self.active

    def time_remaining(self):
        return None if self.deadline is None else self.deadline - time.monotonic()


def test_waiters_run_in_arrival_order_and_a_full_queue_refuses():
    admission, order = Admission(max_running=1, max_queued=2), []
    gate = threading.Event()

    def request(name):
        with admission.slot(FakeCall()):
            order.append(name)
            if name == "first":
                gate.wait(30)

    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(request, "first")
        wait_for(lambda: admission.running == 1)
        second = pool.submit(request, "second")
        wait_for(lambda: admission.queued == 1)
        third = pool.submit(request, "third")
        wait_for(lambda: admission.queued == 2)
        with pytest.raises(ResourceExhausted, match="--max-queued 2"):
            with admission.slot(FakeCall()):
                pass
        gate.set()
        for f in (first, second, third):
            f.result(30)
    assert order == ["first", "second", "third"]
    assert admission.wait_idle(5)


def test_a_waiting_request_honours_its_deadline_and_its_cancellation():
    admission = Admission(max_running=1, max_queued=4)
    with admission.slot():
        with pytest.raises(DeadlineExceeded):
            with admission.slot(FakeCall(timeout_s=0.2)):
                pass
        call = FakeCall()
        threading.Timer(0.2, lambda: setattr(call, "active", False)).start()
        with pytest.raises(Cancelled):
            with admission.slot(call):
                pass
        assert admission.queued == 0
    with admission.slot(FakeCall()):  # nothing was leaked: a new request runs at once
        assert admission.running == 1


def test_queued_requests_over_grpc_wait_then_finish_exactly(stack, target_engine):
    """One request runs, two wait their turn, a fourth is refused at once; all that ran are exact."""
    tport, dport, _ = stack["ports"]
    parts, address = start_orchestrator([f"127.0.0.1:{tport}"], [f"127.0.0.1:{dport}"], max_running=1,
                                        max_queued=2)
    admission = parts.admission
    ids = target_engine.tokenizer("def queue(x):").input_ids
    try:
        with Client(address, timeout_s=120) as client, ThreadPoolExecutor(2) as pool:
            running = client.stream(token_ids=ids, max_new_tokens=40, temperature=0, gamma=2)
            first = list(next(running).token_ids)  # it runs: it holds the one slot until read out
            waiting = [pool.submit(client.generate, token_ids=ids, max_new_tokens=10, temperature=0, gamma=2)
                       for _ in range(2)]
            wait_for(lambda: admission.queued == 2, timeout_s=30, what="two queued requests")
            with pytest.raises(ServiceError) as refused:
                client.generate(token_ids=ids, max_new_tokens=4, temperature=0)
            assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            for chunk in running:
                first += chunk.token_ids
            assert first == reference(target_engine, ids, 40)
            for f in waiting:
                assert f.result(120).token_ids == reference(target_engine, ids, 10)
        assert admission.wait_idle(10)
    finally:
        parts.stop(None)


def test_one_client_holds_at_most_max_per_client_and_others_still_get_in():
    from orchestrator.admission import client_key

    a = Admission(max_running=4, max_queued=4, max_per_client=2)
    greedy, other = client_key(None, "ipv4:10.0.0.7:5000"), client_key(None, "ipv4:10.0.0.8:6000")
    assert client_key(None, "ipv4:10.0.0.7:5999") == greedy  # one host, any port
    assert client_key(b"s3cret", "ipv4:10.0.0.7:1") != greedy and "s3cret" not in client_key(b"s3cret", "x")
    with a.slot(None, greedy), a.slot(None, greedy):
        with pytest.raises(ResourceExhausted) as e:
            with a.slot(None, greedy):
                pass
        assert "--max-per-client 2" in e.value.message
        with a.slot(None, other):  # a different client is not held back
            assert a.running == 3
    with a.slot(None, greedy):  # released: the first client may come back
        assert a.running == 1
    assert a._per_client == {}


def test_a_request_without_a_deadline_gets_the_servers(stack, target_engine, monkeypatch):
    """--request-timeout: a client that sets no deadline cannot hold its slot for ever (the
    decoder is paced so that the request cannot finish first: 300 rounds of at least 50 ms)."""
    from tests.support.servers import paced, start_orchestrator, wait_for

    tport, dport, _ = stack["ports"]
    parts, address = start_orchestrator([f"127.0.0.1:{tport}"], [f"127.0.0.1:{dport}"], request_timeout_s=1.0)
    decoder = parts.slot.decoder
    monkeypatch.setattr(decoder, "generate_stream", paced(decoder.generate_stream, lambda i: time.sleep(0.05)))
    try:
        ids = target_engine.tokenizer("The quick brown fox").input_ids  # no EOS within 300 tokens
        with Client(address) as client:  # no deadline of its own
            for call in (lambda: client.generate(token_ids=ids, max_new_tokens=300, temperature=0, gamma=0),
                         lambda: list(client.stream(token_ids=ids, max_new_tokens=300, temperature=0, gamma=0))):
                with pytest.raises(ServiceError) as e:
                    call()
                assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and "--request-timeout" in e.value.message
        wait_for(lambda: parts.admission.running == 0, 30, "the slots freed")
    finally:
        parts.stop(None)
