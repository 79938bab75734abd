"""docker-compose.yml (CPU) and docker-compose.gpu.yml (override): checked by Debian's
docker-compose 1.29 (`config` validates and merges offline, no Docker engine needed) and by
structural checks of what the files say."""

from __future__ import annotations

import json

import os
import re
import shutil
import subprocess

import pytest
import yaml

from tests.deploy.deployfiles import (
    COMPOSE,
    COMPOSE_GPU,
    DOCKERFILE,
    METRICS_PORT,
    PROMETHEUS,
    ROLES,
    ROOT,
    STARTUP_BUDGET_S,
    WORKER_ROLES,
    compose_services,
    healthcheck_argv,
    load_compose,
    otel_variable_names,
    service_env,
)

SERVICES = {*ROLES, "jaeger", "prometheus", "grafana"}
# variables the compose files read; unset for `config`, so it shows the defaults
COMPOSE_VARIABLES = ("TARGET_MODEL", "DRAFT_MODEL", "ORCHESTRATOR_PORTS", "TORCH_CUDA_INDEX_URL", "TARGET_GPU",
                     "DRAFT_GPU")


def duration_s(value: str) -> float:
    """Compose durations: 30m, 1h30m, 90s, 500ms."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|ns|h|m|s)", value)
    assert parts and "".join(n + u for n, u in parts) == value, f"not a duration: {value!r}"
    return sum(float(n) * units[u] for n, u in parts)


def _devices(service: dict) -> list[dict]:
    return service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])


def _published_container_ports(service: dict) -> list[int]:
    out = []
    for p in service.get("ports", []):
        out.append(int(p["target"]) if isinstance(p, dict) else int(str(p).split(":")[-1].split("/")[0]))
    return out


def check_merged(services: dict, gpu: bool) -> None:
    """What must hold of the merged configuration, from our loader or from docker-compose."""
    assert set(services) == SERVICES
    for role in ROLES:
        svc = services[role]
        assert healthcheck_argv(svc)[:3] == ["python", "-m", "specdec.healthcheck"], role
        assert svc["build"]["context"] in (".", str(ROOT)), role
        devices = _devices(svc)
        if gpu and role in WORKER_ROLES:
            assert len(devices) == 1 and devices[0]["driver"] == "nvidia", (role, devices)
            assert "gpu" in devices[0]["capabilities"], devices
            assert "/whl/cu" in svc["build"]["args"]["TORCH_INDEX_URL"], "a CUDA build of torch"
        else:
            assert devices == [], f"{role}: GPU devices only on workers, only in the GPU override"
            assert "TORCH_INDEX_URL" not in (svc["build"].get("args") or {}), "the base build is the CPU one"
    for name in ("jaeger", "prometheus", "grafana"):
        assert _devices(services[name]) == []


# ---------------------------------------------------------------------------- docker-compose --

def _docker_compose_config(*files) -> dict:
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip("docker-compose is not installed (`make test` installs Debian's package when run as root)")
    env = {k: v for k, v in os.environ.items() if k not in COMPOSE_VARIABLES and not k.startswith("COMPOSE_")}
    args = [exe]
    for f in files:
        args += ["-f", str(f)]
    proc = subprocess.run([*args, "config"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"docker-compose config failed:\n{proc.stderr}"
    assert "WARNING" not in proc.stderr, proc.stderr
    return yaml.safe_load(proc.stdout)


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu"])
def test_docker_compose_config(gpu):
    files = (COMPOSE, COMPOSE_GPU) if gpu else (COMPOSE,)
    merged = _docker_compose_config(*files)
    services = merged["services"]
    check_merged(services, gpu)
    assert "models" in merged["volumes"]
    # our own reading of the files (used by the other tests) agrees with docker-compose's
    ours = compose_services(*files)
    for role in ROLES:
        assert [str(a) for a in services[role]["command"]] == [str(a) for a in ours[role]["command"]], role
        assert service_env(services[role]) == service_env(ours[role]), role


# ------------------------------------------------------------------- structure, no tool needed --

def test_merged_structure():
    check_merged(compose_services(COMPOSE), gpu=False)
    check_merged(compose_services(COMPOSE, COMPOSE_GPU), gpu=True)


def test_on_cpu_the_workers_share_one_pass_lock_and_prefill_one_after_the_other():
    """Both workers share the host's cores: one lock file in one shared volume, so their passes
    take turns (every replica's too), and the orchestrator prefills them in turn."""
    services = compose_services(COMPOSE)
    locks = {service_env(services[r])[f"SPECDEC_{r.upper()}_PASS_LOCK"] for r in WORKER_ROLES}
    assert len(locks) == 1 and locks.pop().startswith("/locks/")
    for role in WORKER_ROLES:
        assert "locks:/locks" in services[role]["volumes"], role
    assert service_env(services["orchestrator"])["SPECDEC_ORCHESTRATOR_PREFILL"] == "sequential"
    assert "--prefill" not in services["orchestrator"]["command"]  # else the variable would not count


def test_with_gpus_each_worker_has_its_own_and_no_pass_lock():
    services = compose_services(COMPOSE, COMPOSE_GPU)
    gpus = [_devices(services[r])[0]["device_ids"] for r in WORKER_ROLES]
    assert gpus[0] != gpus[1], gpus
    for role in WORKER_ROLES:
        assert service_env(services[role])[f"SPECDEC_{role.upper()}_PASS_LOCK"] == ""
    assert service_env(services["orchestrator"])["SPECDEC_ORCHESTRATOR_PREFILL"] == "parallel"


def test_services_scale():
    """`--scale ROLE=N` needs no fixed container name and, for workers, no published host port."""
    services = compose_services(COMPOSE)
    for name, svc in services.items():
        assert "container_name" not in svc, name
    for role in WORKER_ROLES:
        assert "ports" not in services[role], f"{role}: workers are reached over the compose network"
    assert _published_container_ports(services["orchestrator"]) == [50050, 8000]  # gRPC, OpenAI-compatible HTTP
    # one image tag per built service: parallel builds exporting one tag collide in Compose v2
    images = [services[r]["image"] for r in ROLES]
    assert len(set(images)) == len(images), images


def test_healthchecks():
    services = compose_services(COMPOSE)
    for role in ROLES:
        hc = services[role]["healthcheck"]
        for key in ("interval", "timeout", "retries", "start_period"):
            assert key in hc, (role, key)
        if role in WORKER_ROLES:
            assert duration_s(hc["start_period"]) >= STARTUP_BUDGET_S, "a first start downloads and converts"
    deps = services["orchestrator"]["depends_on"]
    assert {r: deps[r]["condition"] for r in WORKER_ROLES} == {r: "service_healthy" for r in WORKER_ROLES}


def test_model_cache_volume():
    data = load_compose(COMPOSE)
    assert "models" in data["volumes"]
    cache = re.search(r"SPECDEC_CACHE=(\S+)", DOCKERFILE.read_text()).group(1)
    for role in WORKER_ROLES:
        assert f"models:{cache}" in data["services"][role]["volumes"], role


def test_telemetry_env():
    services = compose_services(COMPOSE)
    known = otel_variable_names()
    for role in ROLES:
        env = service_env(services[role])
        otel = {k: v for k, v in env.items() if k.startswith("OTEL_")}
        assert set(otel) <= known, f"{role}: unknown OTEL variables {set(otel) - known}"
        assert env["OTEL_SERVICE_NAME"] == f"specdec-{role}"
        assert env["OTEL_TRACES_EXPORTER"] == "otlp"
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"
        assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "grpc"
        assert "prometheus" in env["OTEL_METRICS_EXPORTER"].split(",")
        assert env["OTEL_EXPORTER_PROMETHEUS_HOST"] == "0.0.0.0", "reachable from the Prometheus container"
        assert int(env["OTEL_EXPORTER_PROMETHEUS_PORT"]) == METRICS_PORT


def test_jaeger_and_prometheus():
    services = compose_services(COMPOSE)
    assert 16686 in _published_container_ports(services["jaeger"]), "Jaeger UI"
    assert {4317, 4318} <= set(_published_container_ports(services["jaeger"])) | {
        int(p) for p in services["jaeger"].get("expose", [])}, "OTLP gRPC and HTTP"
    assert 9090 in _published_container_ports(services["prometheus"])
    mounts = services["prometheus"]["volumes"]
    assert "./deploy/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in mounts


def test_only_the_orchestrator_is_published_beyond_this_host():
    """Traces, metrics and dashboards show prompts' timings and internal addresses: loopback only."""
    for name, svc in compose_services(COMPOSE).items():
        for port in svc.get("ports", []):
            if name == "orchestrator":
                continue
            assert isinstance(port, str) and port.startswith("127.0.0.1:"), (name, port)


def test_grafana_is_provisioned_with_prometheus_and_the_dashboard():
    grafana = compose_services(COMPOSE)["grafana"]
    assert grafana["ports"] == ["127.0.0.1:3000:3000"], "the dashboard is reachable from this host only"
    mounts = dict(m.rsplit(":", 1)[0].split(":", 1) for m in grafana["volumes"])
    assert mounts == {"./deploy/grafana/provisioning": "/etc/grafana/provisioning",
                      "./deploy/grafana/dashboards": "/var/lib/grafana/dashboards"}
    assert all(m.endswith(":ro") for m in grafana["volumes"])
    datasources = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    providers = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/specdec.yml").read_text())
    assert providers["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/specdec.json").read_text())
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == source["uid"], panel["title"]
        assert panel["targets"] and all(t["expr"] for t in panel["targets"]), panel["title"]


def test_prometheus_scrapes_every_replica():
    config = yaml.safe_load(PROMETHEUS.read_text())
    sds = [sd for job in config["scrape_configs"] for sd in job.get("dns_sd_configs", [])]
    assert len(sds) == 1
    sd = sds[0]
    # type A: one record per container of the service, so every replica of a scaled role
    assert sd["type"] == "A" and sd["port"] == METRICS_PORT
    assert sorted(sd["names"]) == sorted(ROLES)


def test_promtool_check_config():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    proc = subprocess.run([promtool, "check", "config", str(PROMETHEUS)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
