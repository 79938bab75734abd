"""Shared fixtures: tiny random model directories, engines, and real gRPC servers on port 0."""

from __future__ import annotations

import pytest
import torch

from draft_service.engine import DraftEngine
from specdec.modeling import load_model
from specdec_tools.testing.tiny_models import build_model_dir, build_perturbed_copy
from target_service.engine import TargetEngine

torch.set_num_threads(1)  # tiny models: threads only add noise on a 2-core machine

# The integration tier: files whose tests start services as processes of their own, cut links in
# network namespaces, fuzz, run chi-square tests over thousands of requests, build packages or run
# whole benchmark stacks. Everything else is the fast tier, run on every change (`make test-fast`:
# in-process servers, unit tests, tiny models; ~3 minutes on 2 cores).
# `make test` (and CI) runs both.
INTEGRATION = {
    "clients/test_python_client_package.py", "clients/test_typescript_client.py",
    "deploy/test_autoscaling.py", "deploy/test_compose.py", "deploy/test_k8s.py",
    "orchestrator/test_cli.py", "orchestrator/test_client.py", "orchestrator/test_coupled_sampling.py",
    "orchestrator/test_draft_options.py", "orchestrator/test_faults.py", "orchestrator/test_sampled_distribution.py",
    "orchestrator/test_fuzz.py", "orchestrator/test_grpc_service.py", "orchestrator/test_hosts_apart.py",
    "orchestrator/test_http_fuzz.py", "orchestrator/test_partitions.py", "orchestrator/test_pool.py",
    "orchestrator/test_serve.py", "orchestrator/test_telemetry.py",
    "specdec/test_entry_points_version.py", "specdec/test_healthcheck.py", "specdec/test_native_build.py",
    "specdec/test_proto_checks.py", "specdec/test_protos.py", "specdec/test_threads.py",
    "specdec_tools/test_bench_anchor.py", "specdec_tools/test_bench_coupling.py", "specdec_tools/test_bench_smoke.py",
    "specdec_tools/test_bench_serve.py", "specdec_tools/test_stack_hosts.py", "specdec_tools/test_train_head.py",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = item.path.relative_to(config.rootpath / "tests").as_posix()
        if path in INTEGRATION:
            item.add_marker(pytest.mark.integration)
    # the real model pair's file first: the longest (minutes, more on a first run's conversion), so
    # under `make test` (-n 2, one file a unit, in this order) one worker runs it while the other
    # runs the rest, instead of alone at the end
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


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
    from tests.support.servers import start_stack, stop_stack

    parts = start_stack(target_engine, draft_engine)
    yield parts
    stop_stack(parts)


@pytest.fixture(scope="session")
def client(stack):
    from orchestrator.client import Client

    with Client(stack["address"], timeout_s=120) as c:
        yield c
