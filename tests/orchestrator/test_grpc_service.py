"""The three services over real gRPC: bad input, health, reflection, pairing, stop strings, CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from orchestrator.client import Client
from specdec.errors import ServiceError
from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc

BAD_REQUESTS = {
    "empty prompt": (dict(prompt=""), grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty"),
    "no input": (dict(), grpc.StatusCode.INVALID_ARGUMENT, "exactly one"),
    "max_new_tokens zero": (dict(prompt="a", max_new_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens"),
    "max_new_tokens negative": (dict(prompt="a", max_new_tokens=-3), grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens"),
    "beyond context": (dict(prompt="a", max_new_tokens=100_000), grpc.StatusCode.INVALID_ARGUMENT, "context"),
    "gamma negative": (dict(prompt="a", gamma=-1), grpc.StatusCode.INVALID_ARGUMENT, "gamma"),
    "gamma too large": (dict(prompt="a", gamma=17), grpc.StatusCode.INVALID_ARGUMENT, "gamma"),
    "temperature negative": (dict(prompt="a", temperature=-0.5), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    "top_p zero": (dict(prompt="a", top_p=0.0), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    "top_p above one": (dict(prompt="a", top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    "top_k negative": (dict(prompt="a", top_k=-1), grpc.StatusCode.INVALID_ARGUMENT, "top_k"),
    "token id too large": (dict(token_ids=[1, 10_000_000]), grpc.StatusCode.INVALID_ARGUMENT, "outside the vocabulary"),
    "token id negative": (dict(token_ids=[-1]), grpc.StatusCode.INVALID_ARGUMENT, "outside the vocabulary"),
    "empty token ids": (dict(token_ids=[]), grpc.StatusCode.INVALID_ARGUMENT, "token_ids is empty"),
    "empty stop string": (dict(prompt="a", stop=[""]), grpc.StatusCode.INVALID_ARGUMENT, "stop"),
    "too many stop strings": (dict(prompt="a", stop=["x"] * 17), grpc.StatusCode.INVALID_ARGUMENT, "stop"),
    "long stop string": (dict(prompt="a", stop=["x" * 257]), grpc.StatusCode.INVALID_ARGUMENT, "256 characters"),
    "too many messages": (dict(messages=[{"role": "user", "content": "a"}] * 1025), grpc.StatusCode.INVALID_ARGUMENT,
                          "at most 1024"),
    "long role": (dict(messages=[{"role": "u" * 65, "content": "a"}]), grpc.StatusCode.INVALID_ARGUMENT, "role"),
    "empty role": (dict(messages=[{"role": "", "content": "a"}]), grpc.StatusCode.INVALID_ARGUMENT, "role"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_bad_input_is_refused_and_service_stays_healthy(client, case):
    kwargs, code, words = BAD_REQUESTS[case]
    with pytest.raises(ServiceError) as info:
        client.generate(**kwargs)
    assert info.value.code == code
    assert words in info.value.message
    ok = client.generate(prompt="def", max_new_tokens=3, temperature=0)
    assert len(ok.token_ids) == 3


@pytest.fixture()
def target_stub(stack):
    channel = grpc.insecure_channel(f"127.0.0.1:{stack['ports'][0]}")
    yield target_pb2_grpc.TargetWorkerStub(channel)
    channel.close()


def test_worker_session_errors_have_precise_statuses(target_stub):
    greedy = common_pb2.SamplingParams(temperature=0)
    with pytest.raises(grpc.RpcError) as e:
        target_stub.Verify(target_pb2.VerifyRequest(session_id="unknown", sampling=greedy))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    secret = target_stub.OpenSession(common_pb2.OpenSessionRequest(session_id="s1", token_ids=[1, 2, 3])).session_secret
    with pytest.raises(grpc.RpcError) as e:
        target_stub.OpenSession(common_pb2.OpenSessionRequest(session_id="s1", token_ids=[1]))
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    with pytest.raises(grpc.RpcError) as e:
        target_stub.Truncate(common_pb2.TruncateRequest(session_id="s1", length=10, session_secret=secret))
    assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE
    with pytest.raises(grpc.RpcError) as e:
        target_stub.Verify(target_pb2.VerifyRequest(session_id="s1", start=2, token_ids=[10**7], sampling=greedy,
                                                    session_secret=secret))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as e:
        target_stub.Verify(target_pb2.VerifyRequest(session_id="s1", start=3, sampling=common_pb2.SamplingParams(
            temperature=1.0, top_p=0), session_secret=secret))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    target_stub.CloseSession(common_pb2.CloseSessionRequest(session_id="s1", session_secret=secret))
    with pytest.raises(grpc.RpcError) as e:  # closed: gone
        target_stub.Truncate(common_pb2.TruncateRequest(session_id="s1", length=1, session_secret=secret))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as e:
        target_stub.OpenSession(common_pb2.OpenSessionRequest(session_id="s2", token_ids=[]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_no_session_leaks_after_requests(client, target_engine, draft_engine):
    client.generate(prompt="abc", max_new_tokens=4, temperature=0.8, seed=1)
    with pytest.raises(ServiceError):
        client.generate(prompt="abc", max_new_tokens=0)
    assert target_engine.describe().open_sessions == 0
    assert draft_engine.describe().open_sessions == 0


@pytest.mark.parametrize("port_index", [0, 1, 2])
def test_health_and_reflection(stack, port_index):
    channel = grpc.insecure_channel(f"127.0.0.1:{stack['ports'][port_index]}")
    status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest()).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    reply = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in reply.list_services_response.service}
    expected = ["specdec.v1.TargetWorker", "specdec.v1.DraftWorker", "specdec.v1.Orchestrator"][port_index]
    assert expected in names and "grpc.health.v1.Health" in names
    channel.close()


def test_reflection_off_hides_the_api_and_health_still_answers(stack, target_engine):
    from specdec.worker.config import WorkerConfig
    from tests.support.servers import create_target, start_orchestrator

    worker, wport = create_target(WorkerConfig("target", "t", host="127.0.0.1", reflection=False), target_engine)
    orch, address = start_orchestrator([f"127.0.0.1:{wport}"], reflection=False)
    try:
        for target in (f"127.0.0.1:{wport}", address):
            with grpc.insecure_channel(target) as channel:
                status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest()).status
                assert status == health_pb2.HealthCheckResponse.SERVING
                stub = reflection_pb2_grpc.ServerReflectionStub(channel)
                with pytest.raises(grpc.RpcError) as e:
                    next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
                assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        orch.stop(None)
        worker.stop(None)


def test_worker_is_not_serving_until_its_model_loads(model_dirs):
    """The loader is held at a gate: health must say NOT_SERVING (and calls UNAVAILABLE) until
    the model is in, then SERVING."""
    import threading

    from specdec.worker.config import WorkerConfig
    from specdec.worker.server import create_server
    from target_service.role import TARGET

    gate, loading = threading.Event(), threading.Event()

    class GatedRole(type(TARGET)):
        def make_engine(self, config):
            loading.set()
            assert gate.wait(60), "the test never opened the gate"
            return super().make_engine(config)

    role = GatedRole(**{f: getattr(TARGET, f) for f in TARGET.__dataclass_fields__})
    parts, port = create_server(role, WorkerConfig("target", str(model_dirs["target"]), host="127.0.0.1"))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            assert loading.wait(30)
            assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as e:
                target_pb2_grpc.TargetWorkerStub(channel).Describe(common_pb2.DescribeRequest())
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "loading" in e.value.details()
            gate.set()
            parts.loader.join(60)
            assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
    finally:
        gate.set()
        parts.stop(None)


def test_loading_worker_answers_unavailable():
    from specdec.worker.server import EngineSlot

    with pytest.raises(ServiceError) as e:
        EngineSlot().get()
    assert e.value.code == grpc.StatusCode.UNAVAILABLE


def test_mismatched_vocabulary_is_refused(stack, model_dirs):
    from draft_service.engine import DraftEngine
    from orchestrator.config import OrchestratorConfig
    from orchestrator.server import create_server as create_orchestrator
    from specdec.modeling import load_model
    from specdec.worker.config import WorkerConfig
    from tests.support.servers import create_draft

    other = DraftEngine(load_model(str(model_dirs["other"])))
    draft, dport = create_draft(WorkerConfig("draft", "x", host="127.0.0.1"), other)
    orch, oport = create_orchestrator(
        OrchestratorConfig(target=f"127.0.0.1:{stack['ports'][0]}", draft=f"127.0.0.1:{dport}", host="127.0.0.1"))
    try:
        orch.loader.join(60)
        with Client(f"127.0.0.1:{oport}") as c, pytest.raises(ServiceError) as e:
            c.generate(prompt="abc", max_new_tokens=2)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "tiny-other-vocab" in e.value.message and "tiny-target" in e.value.message
    finally:
        orch.stop(None)
        draft.stop(None)


def test_stop_strings_cut_text(client):
    full = client.generate(prompt="hello", max_new_tokens=30, temperature=0, gamma=3)
    stop = full.text[5:7]
    assert len(stop) == 2
    r = client.generate(prompt="hello", max_new_tokens=30, temperature=0, gamma=3, stop=[stop])
    assert r.finish_reason == "stop_string"
    assert r.text == full.text[: full.text.index(stop)]
    assert r.token_ids == full.token_ids[: len(r.token_ids)]


def test_chat_input_uses_chat_template(client, target_engine):
    messages = [{"role": "user", "content": "hi"}]
    text = target_engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = target_engine.tokenizer(text, add_special_tokens=False).input_ids
    a = client.generate(messages=messages, max_new_tokens=5, temperature=0)
    b = client.generate(token_ids=ids, max_new_tokens=5, temperature=0)
    assert a.token_ids == b.token_ids and a.stats["prompt_tokens"] == len(ids)


def test_same_seed_same_sampled_output(client):
    kw = dict(prompt="abc", max_new_tokens=12, temperature=1.0, top_p=0.9, gamma=3)
    assert client.generate(seed=5, **kw).token_ids == client.generate(seed=5, **kw).token_ids


def test_greedy_sends_no_distributions(client):
    greedy = client.generate(prompt="abc", max_new_tokens=12, temperature=0, gamma=4).stats
    sampled = client.generate(prompt="abc", max_new_tokens=12, temperature=1.0, top_k=8, gamma=4, seed=1,
                              sampling_mode="rejection").stats
    dense = client.generate(prompt="abc", max_new_tokens=12, temperature=1.0, gamma=4, seed=1,
                            sampling_mode="rejection").stats
    # greedy: token ids and a few numbers (compute time, the pass's rows and seconds) only; top-k:
    # 8 (index, prob) pairs per position; plain temperature: dense
    assert greedy["wire_bytes_per_round"] < 256
    assert greedy["wire_bytes_per_round"] < sampled["wire_bytes_per_round"] < dense["wire_bytes_per_round"]


def test_cli_json(stack):
    out = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "generate", "--server", stack["address"], "--prompt", "def",
         "--max-new-tokens", "5", "--temperature", "0", "--gamma", "2", "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert len(data["token_ids"]) == 5 and data["finish_reason"] == "length"
    for key in ("rounds", "drafted_tokens", "accepted_tokens", "acceptance_rate", "target_forward_passes", "wire_bytes"):
        assert key in data["stats"]


def test_cli_refusal_prints_status(stack):
    out = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "generate", "--server", stack["address"], "--prompt", "def",
         "--gamma", "99", "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode != 0
    assert "INVALID_ARGUMENT" in out.stderr and "gamma" in out.stderr


@pytest.mark.parametrize("kwargs", [dict(prompt="a", seed=-1), dict(token_ids=[2**40]),
                                    dict(prompt="a", messages=[{"role": "user", "content": "b"}])], ids=str)
def test_client_refuses_what_protobuf_cannot_carry(client, kwargs):
    with pytest.raises(ServiceError) as e:
        client.generate(**kwargs)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_tiny_temperature_is_greedy_not_an_error(client):
    a = client.generate(prompt="abc", max_new_tokens=6, temperature=1e-9)
    b = client.generate(prompt="abc", max_new_tokens=6, temperature=0)
    assert a.token_ids == b.token_ids


def test_a_caller_that_knows_only_the_session_id_can_neither_use_nor_close_it(target_stub):
    greedy = common_pb2.SamplingParams(temperature=0)
    secret = target_stub.OpenSession(common_pb2.OpenSessionRequest(session_id="mine", token_ids=[1, 2, 3, 4])).session_secret
    assert len(secret) == 16
    for wrong in (b"", bytes(16), secret[:-1] + bytes([secret[-1] ^ 1])):
        calls = [
            lambda: target_stub.Truncate(common_pb2.TruncateRequest(session_id="mine", length=1, session_secret=wrong)),
            lambda: target_stub.CloseSession(common_pb2.CloseSessionRequest(session_id="mine", session_secret=wrong)),
            lambda: target_stub.Verify(target_pb2.VerifyRequest(session_id="mine", start=1, token_ids=[9, 9, 9],
                                                                sampling=greedy, session_secret=wrong)),
        ]
        for call in calls:
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.NOT_FOUND and "no open session" in e.value.details()
    # untouched: the opener continues where it was, and the answer is what it would have been
    v = target_stub.Verify(target_pb2.VerifyRequest(session_id="mine", start=4, draft_token_ids=[5], sampling=greedy,
                                                    session_secret=secret))
    assert v.length == 5
    target_stub.CloseSession(common_pb2.CloseSessionRequest(session_id="mine", session_secret=secret))


def test_a_draft_session_takes_proposals_only_from_its_opener(stack):
    from specdec.v1 import draft_pb2, draft_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{stack['ports'][1]}") as channel:
        stub = draft_pb2_grpc.DraftWorkerStub(channel)
        secret = stub.OpenSession(common_pb2.OpenSessionRequest(session_id="d1", token_ids=[1, 2, 3])).session_secret
        greedy = common_pb2.SamplingParams(temperature=0)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Propose(draft_pb2.ProposeRequest(session_id="d1", start=3, gamma=2, sampling=greedy)))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        got = list(stub.Propose(draft_pb2.ProposeRequest(session_id="d1", start=3, gamma=2, sampling=greedy,
                                                         session_secret=secret)))
        assert len(got) == 2
        stub.CloseSession(common_pb2.CloseSessionRequest(session_id="d1", session_secret=secret))


def test_a_sampling_mode_the_server_does_not_know_is_invalid_argument(stack, client):
    """An enum number from a newer client (or none at all) gets a precise status, and a bad
    name is refused by the client before it is sent."""
    from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc

    with grpc.insecure_channel(stack["address"]) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(orchestrator_pb2.GenerateRequest(prompt="abc", max_new_tokens=2, temperature=0.9,
                                                           sampling_mode=7), timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling_mode" in e.value.details()
    with pytest.raises(ServiceError) as err:
        client.generate(prompt="abc", max_new_tokens=2, temperature=0.9, sampling_mode="gumbel")
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert client.generate(prompt="abc", max_new_tokens=2, temperature=0.9, seed=3).stats["sampling"] == "coupled"


@pytest.mark.parametrize("kwargs,param", [
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(gamma=99), "gamma"),
    (dict(max_new_tokens=10**6), "max_new_tokens"),
    (dict(stop_token_ids=[10**7]), "stop_token_ids"),
])
def test_a_refusal_names_the_request_field_at_fault(client, kwargs, param):
    """The field travels as trailing metadata beside the message (specdec_client.errors.PARAM_METADATA):
    a client need not parse messages to point at the bad field."""
    with pytest.raises(ServiceError) as err:
        client.generate(**{"prompt": "abc", "max_new_tokens": 2, **kwargs})
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and err.value.param == param


def test_the_status_table_says_what_each_code_means():
    from specdec.errors import REQUEST_FAULTS, STATUSES, WORKER_FAULTS, status_info

    assert REQUEST_FAULTS == {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE}
    assert not REQUEST_FAULTS & WORKER_FAULTS
    assert {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.NOT_FOUND} <= WORKER_FAULTS
    assert all(s.http >= 400 for s in STATUSES.values())
    assert status_info(grpc.StatusCode.DATA_LOSS).http == 500  # a code not in the table


def test_serving_means_the_start_up_work_is_done(stack, monkeypatch):
    """The orchestrator says SERVING only once its grammar compiler (made in the background, ~2 s
    of CPU for a 150k vocabulary; slowed down here) is ready: a first wave sent at SERVING no longer
    shares the cores with it (docs/benchmarks/fresh-users)."""
    import time

    from specdec import grammar
    from tests.support.servers import start_orchestrator

    made = grammar.GrammarCompiler.__init__

    def slowly(self, *args, **kwargs):
        time.sleep(0.5)
        made(self, *args, **kwargs)

    monkeypatch.setattr(grammar.GrammarCompiler, "__init__", slowly)

    tport, dport, _ = stack["ports"]
    parts, _ = start_orchestrator([f"127.0.0.1:{tport}"], [f"127.0.0.1:{dport}"])
    try:
        assert parts.serving and parts.slot.decoder._grammars is not None
    finally:
        parts.stop(None)
