"""Every command in docker-compose*.yml, deploy/k8s and the Dockerfile is a real entry point of
this repo, and its flags and SPECDEC_* variables parse with the services' own parsers. Renaming a
flag, a module or an environment variable breaks these tests instead of a deployment."""

from __future__ import annotations

import shlex

import pytest

from tests.deploy.deployfiles import (
    COMPOSE,
    COMPOSE_GPU,
    DOCKERFILE,
    ROLES,
    WORKER_ROLES,
    by_kind,
    check_command,
    check_specdec_env,
    compose_services,
    container_env,
    healthcheck_argv,
    k8s_docs,
    service_env,
)

VARIANTS = {"cpu": (COMPOSE,), "gpu": (COMPOSE, COMPOSE_GPU)}
MODULE = {"target": "target_service", "draft": "draft_service", "orchestrator": "orchestrator"}


def _parsed_compose(variant: str) -> dict:
    services = compose_services(*VARIANTS[variant])
    out = {}
    for role in ROLES:
        svc = services[role]
        out[role] = (svc, check_command(svc["command"], service_env(svc)))
    return out


# ---------------------------------------------------------------------------------- compose --

@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("role", ROLES)
def test_compose_commands_parse(variant, role):
    svc, config = _parsed_compose(variant)[role]
    assert svc["command"][:3] == ["python", "-m", MODULE[role]]
    check_specdec_env(svc["command"], service_env(svc), service_env(compose_services(COMPOSE)[role]))
    # the healthcheck probes the port the server listens on
    probe = check_command(healthcheck_argv(svc))
    host, port = probe.address.rsplit(":", 1)
    assert host == "localhost" and int(port) == config.port, (probe.address, config.port)


@pytest.mark.parametrize("variant", VARIANTS)
def test_compose_orchestrator_points_at_the_worker_services(variant):
    parsed = _parsed_compose(variant)
    orch = parsed["orchestrator"][1]
    assert orch.target == f"target:{parsed['target'][1].port}"
    assert orch.draft == f"draft:{parsed['draft'][1].port}"
    # on CPU the worker containers share the host's cores (prefill one after the other); with
    # the GPU override each worker has a GPU of its own (prefill both at once)
    assert orch.prefill == ("parallel" if variant == "gpu" else "sequential")


def test_compose_devices():
    cpu, gpu = _parsed_compose("cpu"), _parsed_compose("gpu")
    for role in WORKER_ROLES:
        assert cpu[role][1].device == "cpu", "the base file must run on CPU alone"
        config = gpu[role][1]
        assert config.device.startswith("cuda") and config.quantization == "none", config
        assert config.dtype in ("bfloat16", "float16"), config


# ------------------------------------------------------------------------------- kubernetes --

def _k8s_containers():
    docs = k8s_docs()
    configmaps = by_kind(docs, "ConfigMap")
    for name, dep in sorted(by_kind(docs, "Deployment").items()):
        for c in dep["spec"]["template"]["spec"]["containers"]:
            yield name, c, container_env(c, configmaps)


K8S_CONTAINERS = list(_k8s_containers())


@pytest.mark.parametrize("name,container,env", K8S_CONTAINERS, ids=[c[0] for c in K8S_CONTAINERS])
def test_k8s_commands_parse(name, container, env):
    argv = container.get("command", []) + container.get("args", [])
    assert argv, f"{name}: give the command explicitly (the image's CMD names no role)"
    config = check_command(argv, env)
    check_specdec_env(argv, env)
    # native gRPC probes ask the port the server listens on
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == config.port, (name, probe)


def test_k8s_orchestrator_points_at_the_worker_services():
    docs = k8s_docs()
    services = by_kind(docs, "Service")
    parsed = {name: check_command(c["command"] + c["args"], env) for name, c, env in K8S_CONTAINERS}
    orch = parsed["specdec-orchestrator"]
    for role, address in (("target", orch.target), ("draft", orch.draft)):
        host, port = address.rsplit(":", 1)
        assert host == f"specdec-{role}", address
        assert int(port) == parsed[f"specdec-{role}"].port
        assert int(port) in [p["port"] for p in services[host]["spec"]["ports"]], (address, "not a port of the Service")
    assert orch.prefill == "parallel"


# ------------------------------------------------------------------------------- Dockerfile --

def test_dockerfile_cmd_is_an_entry_point():
    import json

    cmd = [line for line in DOCKERFILE.read_text().splitlines() if line.startswith("CMD ")]
    assert len(cmd) == 1
    check_command(json.loads(cmd[0][4:]))


# --------------------------------------------------------------------- the checker has teeth --

@pytest.mark.parametrize("argv", [
    "python -m draft_service --model m --draft-vocabulary 32768",  # renamed flag
    "python -m target_service --model m --quantize fp8",  # value outside the choices
    "python -m orchestrator --draft draft:50052",  # --target is required
    "python -m no_such_service --port 1",  # no such module
    "python -m specdec.config",  # a module, but not runnable
    "specdec-server --help",  # no such console script
])
def test_checker_rejects(argv):
    with pytest.raises(AssertionError):
        check_command(shlex.split(argv))


def test_checker_rejects_an_ignored_variable():
    argv = ["python", "-m", "target_service", "--model", "m"]
    check_specdec_env(argv, {"SPECDEC_TARGET_DEVICE": "cuda"})
    with pytest.raises(AssertionError, match="SPECDEC_TARGET_DEVICES"):
        check_specdec_env(argv, {"SPECDEC_TARGET_DEVICES": "cuda"})
    # a flag on the command line wins over the variable, which then does nothing
    with pytest.raises(AssertionError, match="SPECDEC_TARGET_DEVICE"):
        check_specdec_env(argv + ["--device", "cpu"], {"SPECDEC_TARGET_DEVICE": "cuda"})
