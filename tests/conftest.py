"""Shared fixtures: tiny random model directories, engines, and real gRPC servers on port 0."""

from __future__ import annotations

import pytest
import torch

from draft_service.engine import DraftEngine
from specdec.config import WorkerConfig
from specdec.modeling import load_model
from target_service.engine import TargetEngine
from tests.tiny_models import build_model_dir, build_perturbed_copy

torch.set_num_threads(1)  # tiny models: threads only add noise on a 2-core machine


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    target = build_model_dir(root / "tiny-target", seed=1, layers=2)
    return {
        "target": target,
        "draft": build_perturbed_copy(target, root / "tiny-draft", seed=2, noise=0.05),
        # a different vocabulary (4 extra tokens): must be refused as a draft for "target"
        "other": build_model_dir(root / "tiny-other-vocab", seed=3, layers=1, extra_tokens=4),
    }


@pytest.fixture(scope="session")
def target_engine(model_dirs):
    # float64 makes greedy equality with transformers' generate exact (no near-tie flips)
    return TargetEngine(load_model(str(model_dirs["target"]), dtype="float64"))


@pytest.fixture(scope="session")
def draft_engine(model_dirs):
    return DraftEngine(load_model(str(model_dirs["draft"]), dtype="float64"))


@pytest.fixture(scope="session")
def stack(target_engine, draft_engine):
    """Target, draft and orchestrator as real gRPC servers on free ports, wired together."""
    from draft_service.server import create_server as create_draft
    from orchestrator.config import OrchestratorConfig
    from orchestrator.server import create_server as create_orchestrator
    from target_service.server import create_server as create_target

    target, tport = create_target(WorkerConfig("target", "tiny", host="127.0.0.1"), target_engine)
    draft, dport = create_draft(WorkerConfig("draft", "tiny", host="127.0.0.1"), draft_engine)
    config = OrchestratorConfig(target=f"127.0.0.1:{tport}", draft=f"127.0.0.1:{dport}", host="127.0.0.1")
    orch, oport = create_orchestrator(config)
    orch.loader.join(60)
    assert orch.slot.decoder is not None, "orchestrator did not pair with the workers"
    yield {"target": target, "draft": draft, "orchestrator": orch, "ports": (tport, dport, oport),
           "address": f"127.0.0.1:{oport}"}
    for parts in (orch, draft, target):
        parts.stop(None)


@pytest.fixture(scope="session")
def client(stack):
    from orchestrator.client import Client

    with Client(stack["address"], timeout_s=120) as c:
        yield c
