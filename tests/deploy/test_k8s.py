"""deploy/k8s: every manifest validated offline against the Kubernetes API schemas
(kubernetes-validate, strict: unknown fields fail too), structural checks of what the manifests
promise, and `kubectl kustomize` when kubectl is installed (it renders offline)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.deploy.deployfiles import (
    DOCKERFILE,
    K8S,
    METRICS_PORT,
    ROLES,
    STARTUP_BUDGET_S,
    WORKER_ROLES,
    by_kind,
    container_env,
    is_custom_resource,
    k8s_docs,
    k8s_manifest_files,
    otel_variable_names,
    validate_custom_resource,
)

# the oldest Kubernetes still widely run, and the brief's target version
K8S_VERSIONS = ("1.28", "1.31")
DEPLOYMENTS = {role: f"specdec-{role}" for role in ROLES}


def _validate(doc: dict, version: str) -> None:
    if is_custom_resource(doc):  # KEDA's ScaledObject: its vendored CRD schema (tests/deploy/schemas)
        validate_custom_resource(doc)
        return
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = ".".join(str(p) for p in exc.path)
        raise AssertionError(f"{doc['kind']}/{doc['metadata']['name']} at {path}: {exc.message}") from None


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("path", k8s_manifest_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_manifest_validates(path, version):
    docs = k8s_docs([path])
    assert docs, path
    for doc in docs:
        _validate(doc, version)


def test_validator_catches_mistakes():
    doc = by_kind(k8s_docs(), "Deployment")["specdec-target"]
    container = doc["spec"]["template"]["spec"]["containers"][0]
    container["startupProbes"] = container.pop("startupProbe")  # misspelt field
    with pytest.raises(AssertionError, match="startupProbes"):
        _validate(doc, "1.31")


# ---------------------------------------------------------------------------- kustomization --

def _kustomization(directory: Path) -> dict:
    return yaml.safe_load((directory / "kustomization.yaml").read_text())


def test_kustomization_lists_every_manifest():
    listed = _kustomization(K8S)["resources"]
    for name in listed:
        assert (K8S / name).is_file(), name
    top_level = sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(listed) == top_level, "a manifest kustomize would not apply, or a missing one"
    for component in (K8S / "components").iterdir():
        for name in _kustomization(component)["resources"]:
            assert (component / name).is_file(), (component, name)


def test_namespace_agnostic():
    for doc in k8s_docs():
        assert "namespace" not in doc["metadata"], f"{doc['kind']}/{doc['metadata']['name']}"
    assert "namespace" not in _kustomization(K8S)


# ------------------------------------------------------------------------------- structure --

@pytest.fixture(scope="module")
def docs():
    return k8s_docs()


def _pod(dep: dict) -> dict:
    return dep["spec"]["template"]["spec"]


def _container(dep: dict) -> dict:
    containers = _pod(dep)["containers"]
    assert len(containers) == 1
    return containers[0]


def _grpc_port(container: dict) -> dict:
    return next(p for p in container["ports"] if p["name"] == "grpc")


def test_deployments_and_services_match(docs):
    deployments, services = by_kind(docs, "Deployment"), by_kind(docs, "Service")
    assert set(deployments) == set(DEPLOYMENTS.values())
    for role, name in DEPLOYMENTS.items():
        dep = deployments[name]
        match = dep["spec"]["selector"]["matchLabels"]
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert match.items() <= labels.items(), name
        svc = services[name]
        selector = svc["spec"]["selector"]
        # the Service selects this Deployment's pods and no other's
        selecting = [d for d, dd in deployments.items()
                     if selector.items() <= dd["spec"]["template"]["metadata"]["labels"].items()]
        assert selecting == [name], (name, selecting)
        container = _container(dep)
        port_names = {p["name"]: p["containerPort"] for p in container["ports"]}
        for port in svc["spec"]["ports"]:
            target = port["targetPort"]
            assert target in port_names or target in port_names.values(), (name, port)
        grpc = next(p for p in svc["spec"]["ports"] if p["name"] == "grpc")
        assert grpc["port"] == _grpc_port(container)["containerPort"]
        flags = container.get("args", [])
        if "--http-port" in flags:  # the orchestrator's OpenAI-compatible API: exposed where it listens
            http = int(flags[flags.index("--http-port") + 1])
            assert port_names.get("http") == http, (name, port_names)
            assert any(p["targetPort"] == "http" for p in svc["spec"]["ports"]), name
    assert "--http-port" in _container(deployments[DEPLOYMENTS["orchestrator"]])["args"]


def test_worker_services_are_headless(docs):
    services = by_kind(docs, "Service")
    for role in WORKER_ROLES:
        spec = services[DEPLOYMENTS[role]]["spec"]
        # headless: the name resolves to every ready pod, which the orchestrator spreads over
        assert spec.get("clusterIP") == "None", role
        assert not spec.get("publishNotReadyAddresses"), "pods still loading must stay out of DNS"
    orch = services[DEPLOYMENTS["orchestrator"]]["spec"]
    assert orch.get("type", "ClusterIP") == "ClusterIP" and orch.get("clusterIP") != "None"


def test_probes(docs):
    deployments = by_kind(docs, "Deployment")
    for role, name in DEPLOYMENTS.items():
        container = _container(deployments[name])
        port = _grpc_port(container)["containerPort"]
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container[kind]
            assert probe["grpc"]["port"] == port, (name, kind)  # native gRPC health probe
        startup = container["startupProbe"]
        budget = startup.get("initialDelaySeconds", 0) + startup["failureThreshold"] * startup.get("periodSeconds", 10)
        assert budget >= STARTUP_BUDGET_S, f"{name}: startup budget {budget} s < {STARTUP_BUDGET_S} s"
        grace = _pod(deployments[name]).get("terminationGracePeriodSeconds")
        prestop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        pause = int(prestop[1]) if prestop[:1] == ["sleep"] else 0
        # after the preStop pause and SIGTERM, the servers drain (--drain-timeout, 20 s by
        # default) and then give calls in flight 5 s
        assert grace is not None and grace >= pause + 20 + 5, (name, grace, pause)


def test_resources(docs):
    deployments = by_kind(docs, "Deployment")
    for role, name in DEPLOYMENTS.items():
        res = _container(deployments[name])["resources"]
        assert {"cpu", "memory"} <= set(res["requests"]), name
        assert "memory" in res["limits"], name
        if role in WORKER_ROLES:
            # extended resources: request and limit must be equal
            assert str(res["requests"]["nvidia.com/gpu"]) == str(res["limits"]["nvidia.com/gpu"]) == "1", name
        else:
            assert "nvidia.com/gpu" not in {**res["requests"], **res["limits"]}, "the orchestrator runs no model"


def test_model_cache_volume(docs):
    deployments = by_kind(docs, "Deployment")
    cache = re.search(r"SPECDEC_CACHE=(\S+)", DOCKERFILE.read_text()).group(1)
    for role in WORKER_ROLES:
        dep = deployments[DEPLOYMENTS[role]]
        mounts = {m["name"]: m["mountPath"] for m in _container(dep)["volumeMounts"]}
        volumes = {v["name"]: v for v in _pod(dep)["volumes"]}
        assert mounts.get("models") == cache, role
        assert "emptyDir" in volumes["models"] and volumes["models"]["emptyDir"].get("sizeLimit"), role
        assert _pod(dep)["volumes"][0]["name"] == "models", "the shared-cache component patches volumes/0"


def test_hpa_targets_the_orchestrator(docs):
    hpas = by_kind(docs, "HorizontalPodAutoscaler")
    assert len(hpas) == 1
    hpa = next(iter(hpas.values()))
    assert hpa["apiVersion"] == "autoscaling/v2"
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"], ref["name"]) == ("apps/v1", "Deployment", DEPLOYMENTS["orchestrator"])
    dep = by_kind(docs, "Deployment")[ref["name"]]
    assert "replicas" not in dep["spec"], "the autoscaler owns the count; a re-apply would reset it"
    for metric in hpa["spec"]["metrics"]:
        if metric["type"] == "Resource":
            # utilization is measured against the request
            assert metric["resource"]["name"] in _container(dep)["resources"]["requests"]
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]


def test_every_pool_has_a_disruption_budget(docs):
    """A node drain takes at most one pod of each pool at a time."""
    budgets = by_kind(docs, "PodDisruptionBudget")
    deployments = by_kind(docs, "Deployment")
    covered = set()
    for pdb in budgets.values():
        assert pdb["apiVersion"] == "policy/v1" and pdb["spec"]["maxUnavailable"] == 1
        match = pdb["spec"]["selector"]["matchLabels"]
        covered |= {name for name, dep in deployments.items() if dep["spec"]["selector"]["matchLabels"] == match}
    assert covered == set(deployments)


def test_the_orchestrator_takes_its_bearer_tokens_from_a_secret(docs):
    """The OpenAI and gRPC ports are published: clients must send a token, read from a Secret."""
    dep = by_kind(docs, "Deployment")[DEPLOYMENTS["orchestrator"]]
    args = _container(dep)["args"]
    path = args[args.index("--auth-token-file") + 1]
    mount = next(m for m in _container(dep)["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    volume = next(v for v in _pod(dep)["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["secretName"] == "specdec-api-tokens" and mount.get("readOnly")
    assert not volume["secret"].get("optional"), "without tokens the API would be open: the pod must wait"


def test_metrics_and_telemetry(docs):
    deployments, configmaps = by_kind(docs, "Deployment"), by_kind(docs, "ConfigMap")
    known = otel_variable_names()
    for role, name in DEPLOYMENTS.items():
        dep = deployments[name]
        annotations = dep["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert int(annotations["prometheus.io/port"]) == METRICS_PORT
        container = _container(dep)
        assert {"name": "metrics", "containerPort": METRICS_PORT} in container["ports"]
        env = container_env(container, configmaps)
        otel = {k for k in env if k.startswith("OTEL_")}
        assert otel <= known, f"{name}: unknown OTEL variables {otel - known}"
        assert env["OTEL_SERVICE_NAME"] == name
        assert "prometheus" in env["OTEL_METRICS_EXPORTER"].split(",")
        assert env["OTEL_EXPORTER_PROMETHEUS_HOST"] == "0.0.0.0"
        assert int(env["OTEL_EXPORTER_PROMETHEUS_PORT"]) == METRICS_PORT
        assert env["OTEL_TRACES_EXPORTER"] in ("otlp", "console", "none")


def test_security_context_matches_the_image(docs):
    uid = int(re.search(r"^ARG UID=(\d+)$", DOCKERFILE.read_text(), re.M).group(1))
    for name, dep in by_kind(docs, "Deployment").items():
        pod = _pod(dep)["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] == uid, name
        assert _container(dep)["securityContext"]["allowPrivilegeEscalation"] is False, name
        # a read-only root filesystem, writable scratch (and the model cache, on workers) only
        assert _container(dep)["securityContext"]["readOnlyRootFilesystem"] is True, name
        assert _pod(dep)["automountServiceAccountToken"] is False, name
        mounts = {m["mountPath"]: m["name"] for m in _container(dep)["volumeMounts"]}
        volumes = {v["name"] for v in _pod(dep)["volumes"]}
        assert {"/tmp", "/home/specdec"} <= set(mounts) and set(mounts.values()) <= volumes, name
        if name != DEPLOYMENTS["orchestrator"]:
            assert "/models" in mounts, name


def test_images(docs):
    """GPU workers run the CUDA image, the orchestrator the CPU one (see kustomization.yaml)."""
    for role, name in DEPLOYMENTS.items():
        image = _container(by_kind(docs, "Deployment")[name])["image"].rsplit(":", 1)[0]
        assert image == ("specdec-cuda" if role in WORKER_ROLES else "specdec"), (name, image)


# ---------------------------------------------------------------------------------- kubectl --

def _kustomize(directory: Path) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: `kubectl kustomize` not run (the manifests are validated above)")
    proc = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def test_kubectl_kustomize():
    rendered = _kustomize(K8S)
    expected = {(d["kind"], d["metadata"]["name"]) for d in k8s_docs([K8S / n for n in _kustomization(K8S)["resources"]])}
    assert {(d["kind"], d["metadata"]["name"]) for d in rendered} == expected
    for doc in rendered:
        _validate(doc, "1.31")
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "specdec"


def test_shared_model_cache_component(tmp_path):
    """The optional component swaps the workers' emptyDir for one ReadWriteMany claim."""
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    rel = Path(os.path.relpath(K8S, overlay))  # kustomize refuses absolute paths
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [str(rel)], "components": [str(rel / "components" / "shared-model-cache")]}))
    rendered = _kustomize(overlay)
    claims = by_kind(rendered, "PersistentVolumeClaim")
    assert list(claims) == ["specdec-models"] and claims["specdec-models"]["spec"]["accessModes"] == ["ReadWriteMany"]
    for name, dep in by_kind(rendered, "Deployment").items():
        _validate(dep, "1.31")
        volumes = {v["name"]: v for v in _pod(dep).get("volumes", [])}
        if name == DEPLOYMENTS["orchestrator"]:
            assert "models" not in volumes
        else:
            assert volumes["models"] == {"name": "models", "persistentVolumeClaim": {"claimName": "specdec-models"}}


def _selects(selector: dict, labels: dict) -> bool:
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In", expr
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


def test_network_policies_let_only_orchestrators_reach_workers_and_only_prometheus_scrape(docs):
    policies = by_kind(docs, "NetworkPolicy")
    deployments = by_kind(docs, "Deployment")
    pods = {role: deployments[name]["spec"]["template"]["metadata"]["labels"] for role, name in DEPLOYMENTS.items()}
    for role, labels in pods.items():
        covering = [p for p in policies.values() if _selects(p["spec"]["podSelector"], labels)]
        assert len(covering) == 1, (role, [p["metadata"]["name"] for p in covering])
        spec = covering[0]["spec"]
        assert spec["policyTypes"] == ["Ingress"]
        ports = {p["name"] for p in _container(deployments[DEPLOYMENTS[role]])["ports"]}
        for rule in spec["ingress"]:
            named = {p["port"] for p in rule["ports"]}
            assert named <= ports, (role, named - ports)  # named ports that exist on the container
            if "metrics" in named:
                assert named == {"metrics"}
                (peer,) = rule["from"]
                assert peer["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}
            elif role in WORKER_ROLES:
                assert named == {"grpc"}
                (peer,) = rule["from"]  # from orchestrator pods, and no one else
                assert _selects(peer["podSelector"], pods["orchestrator"]) and "namespaceSelector" not in peer
                assert not any(_selects(peer["podSelector"], pods[r]) for r in WORKER_ROLES)
            else:
                assert named == {"grpc", "http"} and "from" not in rule  # clients, from anywhere
