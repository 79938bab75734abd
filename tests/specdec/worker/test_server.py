"""specdec.worker.server: a worker whose model failed to load keeps running and says why, apart
from one still loading (tests/orchestrator/test_grpc_service.py holds the loading one)."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.errors import ServiceError
from specdec.v1 import common_pb2, draft_pb2_grpc
from specdec.worker.server import EngineSlot
from tests.support.servers import start_unloadable


def test_the_slot_tells_a_load_in_progress_from_one_that_failed():
    slot = EngineSlot()
    with pytest.raises(ServiceError) as loading:
        slot.get()
    slot.error = "head h was made for a target of hidden size 48; this target's is 64"
    with pytest.raises(ServiceError) as failed:
        slot.get()
    assert (loading.value.code, loading.value.message) == (grpc.StatusCode.UNAVAILABLE, "model is still loading")
    assert failed.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert failed.value.message == f"model load failed: {slot.error}"


def test_a_draft_given_a_head_made_for_another_target_answers_why(model_dirs, tmp_path):
    parts, address = start_unloadable("draft", model_dirs["target"], tmp_path / "other-targets-head")
    try:
        with grpc.insecure_channel(address) as channel:
            stub = draft_pb2_grpc.DraftWorkerStub(channel)
            for call, request in ((stub.Describe, common_pb2.DescribeRequest()),
                                  (stub.OpenSession, common_pb2.OpenSessionRequest(session_id="s", token_ids=[1]))):
                with pytest.raises(grpc.RpcError) as e:
                    call(request, timeout=30)
                assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert e.value.details() == ("model load failed: head other-targets-head was made for a target of "
                                             "hidden size 48; this target's is 64")
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        parts.stop(None)
