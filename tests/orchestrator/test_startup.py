"""The orchestrator's start-up (orchestrator/server.py) with workers that are loading or cannot
load: a request is told which worker it waits for and what that worker is doing; a draft whose
model failed to load is served without (the target's own greedy output), a target that failed is
refused for good, each naming the worker and its reason in the answer, the log and ListWorkers.

Every worker is a real server on a free port; the failures are genuine (an EAGLE-3 head made for
another target: tests/support/servers.py start_unloadable), the loading a real load held at a gate.
"""

from __future__ import annotations

import logging
import threading

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from draft_service.role import DRAFT
from orchestrator.client import Client
from orchestrator.config import OrchestratorConfig
from orchestrator.pool import FAILED
from orchestrator.server import create_server as create_orchestrator
from specdec.errors import ServiceError
from specdec.worker.config import WorkerConfig
from specdec.worker.server import create_server
from target_service.role import TARGET
from tests.support.reference import PROMPTS, greedy as reference
from tests.support.servers import (ADMIN_TOKEN, HOST, admin_token_file, create_target, start_orchestrator,
                                   start_unloadable, wait_for)

HEAD = "other-targets-head"  # the directory of a head made for another target
REASON = "was made for a target of hidden size 48; this target's is 64"


def _errors_logged(caplog, logger: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger and r.levelno >= logging.ERROR]


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30).status


def test_a_draft_that_failed_to_load_is_served_without(model_dirs, target_engine, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    target, tport = create_target(WorkerConfig("target", "tiny", host=HOST), target_engine)
    draft, draft_address = start_unloadable("draft", model_dirs["target"], tmp_path / HEAD)
    orch, address = start_orchestrator([f"{HOST}:{tport}"], [draft_address], poll_s=0.2, http_port=0)
    try:
        with Client(address, timeout_s=120, token=ADMIN_TOKEN) as client:
            client.wait_until_ready(60)
            for prompt in PROMPTS[:3]:
                ids = target_engine.tokenizer(prompt).input_ids
                want = reference(target_engine, ids, 16)
                for gamma in ({"gamma": 0}, {"gamma": 3}, {}):  # {}: the default gamma, which asks for drafts
                    r = client.generate(token_ids=ids, max_new_tokens=16, temperature=0, **gamma)
                    assert r.token_ids == want, (prompt, gamma)
                    assert r.stats["draft_s"] == 0 and r.stats["draft_failovers"] == 0
            listed = {w["address"]: w for w in client.workers()}[draft_address]
            assert listed["state"] == FAILED
            assert listed["message"] == f"draft worker at {draft_address}: model load failed: head {HEAD} {REASON}"
            with pytest.raises(ServiceError) as e:  # its decoder has no draft pool to add to
                client.add_workers(draft=[draft_address])
            assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "serves without drafts" in e.value.message
        assert _health(address) == health_pb2.HealthCheckResponse.SERVING
        health = httpx.get(f"http://{HOST}:{orch.http.port}/health", timeout=30)
        assert health.status_code == 200 and health.json()["status"] == "serving"
        assert health.json()["message"].startswith("serving without drafts: ") and REASON in health.json()["message"]
        errors = _errors_logged(caplog, "orchestrator.server")
        assert len(errors) == 1 and draft_address in errors[0] and REASON in errors[0], errors
    finally:
        orch.stop(None)
        draft.stop(None)
        target.stop(None)


def test_a_target_that_failed_to_load_is_refused_naming_it(model_dirs, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    target, target_address = start_unloadable("target", model_dirs["target"], tmp_path / HEAD)
    orch, port = create_orchestrator(OrchestratorConfig(target=target_address, host=HOST, poll_s=0.2,
                                                        admin_token_file=admin_token_file()))
    address = f"{HOST}:{port}"
    try:
        orch.loader.join(120)
        assert not orch.loader.is_alive(), "a failure answer is final: start-up stops waiting for it"
        with Client(address, timeout_s=120, token=ADMIN_TOKEN) as client:
            for call in (lambda: client.generate(prompt="abc", max_new_tokens=2, temperature=0, gamma=0),
                         lambda: list(client.stream(prompt="abc", max_new_tokens=2, temperature=0, gamma=0))):
                with pytest.raises(ServiceError) as e:
                    call()
                assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
                assert e.value.message.startswith(f"target worker at {target_address}: model load failed: head ")
                assert REASON in e.value.message
            [listed] = client.workers()
            assert listed["state"] == FAILED and REASON in listed["message"]
        assert _health(address) == health_pb2.HealthCheckResponse.NOT_SERVING
        errors = _errors_logged(caplog, "orchestrator.server")
        assert len(errors) == 1 and target_address in errors[0] and REASON in errors[0], errors
    finally:
        orch.stop(None)
        target.stop(None)


def _gated(role):
    """The role, its model's load held until the gate opens; (role, loading, gate)."""
    gate, loading = threading.Event(), threading.Event()

    class Gated(type(role)):
        def make_engine(self, config):
            loading.set()
            assert gate.wait(120), "the test never opened the gate"
            return super().make_engine(config)

    return Gated(**{f: getattr(role, f) for f in role.__dataclass_fields__}), loading, gate


@pytest.mark.parametrize("waits_for", ["target", "draft"])
def test_a_request_while_workers_load_is_told_which_and_what_each_does(model_dirs, target_engine, waits_for):
    role, loading, gate = _gated(TARGET if waits_for == "target" else DRAFT)
    servers = []
    try:
        if waits_for == "target":
            loader, port = create_server(role, WorkerConfig("target", str(model_dirs["target"]), host=HOST,
                                                            dtype="float64"))
            servers.append(loader)
            targets, drafts = [f"{HOST}:{port}"], []
        else:
            target, tport = create_target(WorkerConfig("target", "tiny", host=HOST), target_engine)
            loader, port = create_server(role, WorkerConfig("draft", str(model_dirs["draft"]), host=HOST,
                                                            dtype="float64"))
            servers += [target, loader]
            targets, drafts = [f"{HOST}:{tport}"], [f"{HOST}:{port}"]
        assert loading.wait(60)
        orch, oport = create_orchestrator(OrchestratorConfig(
            target=",".join(targets), draft=",".join(drafts) or None, host=HOST, poll_s=0.2, gamma_policy="fixed",
            admin_token_file=admin_token_file()))
        servers.insert(0, orch)
        waiting = f"orchestrator is starting: waiting for the {waits_for} worker at {HOST}:{port} " \
                  "(model is still loading)"
        with Client(f"{HOST}:{oport}", timeout_s=60, retries=0) as client:
            answers = []

            def told() -> bool:
                try:
                    client.generate(prompt="abc", max_new_tokens=2, temperature=0, gamma=0)
                except ServiceError as exc:
                    answers.append((exc.code, exc.message))
                return answers[-1] == (grpc.StatusCode.UNAVAILABLE, waiting)

            wait_for(told, timeout_s=60, what=f"a request told it waits for the loading {waits_for}")
            assert {code for code, _ in answers} == {grpc.StatusCode.UNAVAILABLE}, answers
            gate.set()  # the load completes: the orchestrator serves, with the draft it waited for
            client.wait_until_ready(120)
            ids = target_engine.tokenizer(PROMPTS[0]).input_ids
            r = client.generate(token_ids=ids, max_new_tokens=8, temperature=0, gamma=2 if drafts else 0)
            assert r.token_ids == reference(target_engine, ids, 8)
            if drafts:
                assert r.stats["drafted_tokens"] > 0
    finally:
        gate.set()
        for parts in servers:
            parts.stop(None)
