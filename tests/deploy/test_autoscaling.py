"""deploy/k8s/components/autoscaling: each worker pool scales on its own load (KEDA ScaledObjects).

- the ScaledObjects validate against KEDA's vendored CRD schema (tests/deploy/schemas), strict,
  plus the CRD's CEL rule and the checks of KEDA's admission webhook that apply;
- each scales the right Deployment (target.yaml, draft.yaml) within sane bounds, and nothing else
  autoscales it;
- every metric and label a query names is one the workers really export: a worker of each role is
  started the way its Deployment starts it (its command parsed by the service's own parser, its
  OTEL_* settings from the manifests), runs a forward pass, and its /metrics is scraped; a query
  naming anything that scrape lacks fails;
- the thresholds sit below the limits the workers enforce (--max-sessions, --max-cached-tokens);
- with promtool installed, each query is evaluated on series carrying the scraped label sets
  (several pods of both pools, some idle) and must give that pool's sum and nothing of the other;
- with kubectl installed, an overlay using the component renders.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.deploy.deployfiles import (
    K8S,
    KEDA_CRD,
    KEDA_CRD_SHA256,
    WORKER_ROLES,
    by_kind,
    check_command,
    container_env,
    crd_schemas,
    k8s_docs,
    k8s_manifest_files,
    validate_custom_resource,
)

AUTOSCALING = K8S / "components" / "autoscaling"
DEPLOYMENTS = {role: f"specdec-{role}" for role in WORKER_ROLES}
MAX_REPLICAS = 16  # each worker replica holds a GPU: a larger bound is a typo, not a plan

# Labels Prometheus itself puts on every series it scrapes (whatever the scrape job's relabelling):
# the only labels a query may use besides those the workers export.
TARGET_LABELS = {"job", "instance"}
PROMQL_FUNCTIONS = {"sum", "avg", "min", "max", "count", "rate", "irate", "increase", "avg_over_time",
                    "max_over_time", "min_over_time", "clamp_min", "clamp_max", "vector", "scalar", "abs"}
PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
                   "unless", "offset"}
# the trigger metadata KEDA's prometheus scaler reads (pkg/scalers/prometheus_scaler.go, v2.18.3)
PROMETHEUS_SCALER_KEYS = {"serverAddress", "query", "queryParameters", "threshold", "activationThreshold",
                          "namespace", "customHeaders", "ignoreNullValues", "unsafeSsl", "awsRegion", "timeout",
                          "identityOwner", "authModes"}
# which worker flag bounds the quantity a gauge query sums (past it the worker answers RESOURCE_EXHAUSTED)
GAUGE_LIMITS = {"specdec_worker_sessions": "max_sessions", "specdec_worker_cached_tokens": "max_cached_tokens"}
BUSY_METRIC = "specdec_worker_forward_duration_seconds_sum"


def _component_docs() -> list[dict]:
    return k8s_docs([p for p in k8s_manifest_files() if AUTOSCALING in p.parents])


@pytest.fixture(scope="module")
def scaled_objects() -> dict[str, dict]:
    objects = by_kind(_component_docs(), "ScaledObject")
    assert objects, "no ScaledObject in deploy/k8s/components/autoscaling"
    return objects


@pytest.fixture(scope="module")
def base_docs() -> list[dict]:
    return k8s_docs([K8S / name for name in yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]])


def _pool(so: dict) -> str:
    """The worker role whose Deployment this ScaledObject scales."""
    name = so["spec"]["scaleTargetRef"]["name"]
    roles = [role for role, dep in DEPLOYMENTS.items() if dep == name]
    assert roles, f"ScaledObject/{so['metadata']['name']} scales {name!r}, not a worker Deployment"
    return roles[0]


def _container(dep: dict) -> dict:
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    return container


def _worker_config(role: str, docs: list[dict]):
    """The WorkerConfig the role's pod runs with: its command, parsed with its environment."""
    dep = by_kind(docs, "Deployment")[DEPLOYMENTS[role]]
    container = _container(dep)
    env = container_env(container, by_kind(docs, "ConfigMap"))
    return check_command(container["command"] + container.get("args", []), env), env


# ------------------------------------------------------------------------------------ schema --

def test_vendored_crd_is_the_release():
    assert hashlib.sha256(KEDA_CRD.read_bytes()).hexdigest() == KEDA_CRD_SHA256, \
        "tests/deploy/schemas/keda.sh_scaledobjects.yaml differs from the release it names (see its README.md)"
    assert ("keda.sh/v1alpha1", "ScaledObject") in crd_schemas()


def test_scaled_objects_validate_against_the_crd(scaled_objects):
    for so in scaled_objects.values():
        validate_custom_resource(so)
        # the CRD's CEL rule (x-kubernetes-validations), which a JSON schema validator does not run
        spec = so["spec"]
        assert spec.get("minReplicaCount", 0) <= spec.get("maxReplicaCount", 100)


def test_validator_catches_mistakes(scaled_objects):
    so = yaml.safe_load(yaml.safe_dump(scaled_objects["specdec-target"]))
    so["spec"]["minReplicas"] = so["spec"].pop("minReplicaCount")  # the HPA's spelling
    with pytest.raises(AssertionError, match="minReplicas"):
        validate_custom_resource(so)
    so = yaml.safe_load(yaml.safe_dump(scaled_objects["specdec-target"]))
    so["spec"]["triggers"][0]["metadata"]["threshold"] = 0.7  # metadata values are strings
    with pytest.raises(AssertionError, match="threshold"):
        validate_custom_resource(so)


# --------------------------------------------------------------------------------- structure --

def test_one_scaled_object_per_worker_pool(scaled_objects, base_docs):
    deployments = by_kind(base_docs, "Deployment")
    pools = [_pool(so) for so in scaled_objects.values()]
    assert sorted(pools) == sorted(WORKER_ROLES), pools
    for name, so in scaled_objects.items():
        ref = so["spec"]["scaleTargetRef"]
        assert (ref.get("apiVersion", "apps/v1"), ref.get("kind", "Deployment")) == ("apps/v1", "Deployment"), name
        dep = deployments[ref["name"]]  # the Deployment of target.yaml / draft.yaml
        assert so["metadata"]["labels"]["app.kubernetes.io/component"] == \
            dep["metadata"]["labels"]["app.kubernetes.io/component"], name
        assert "replicas" not in dep["spec"], f"{ref['name']}: a re-apply would reset what the autoscaler chose"
        spec = so["spec"]
        assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"] <= MAX_REPLICAS, name
        assert "idleReplicaCount" not in spec, "a pool at zero has no model loaded"
        # KEDA's webhook: the HPA it makes is named keda-hpa-<name>, a label value (63 characters)
        hpa_name = spec.get("advanced", {}).get("horizontalPodAutoscalerConfig", {}).get("name") or f"keda-hpa-{name}"
        assert len(hpa_name) <= 63, hpa_name
    # KEDA's webhook refuses a ScaledObject for a workload another HPA already scales
    for hpa in by_kind(base_docs, "HorizontalPodAutoscaler").values():
        assert hpa["spec"]["scaleTargetRef"]["name"] not in DEPLOYMENTS.values(), hpa["metadata"]["name"]


def test_scaling_behaviour(scaled_objects):
    for name, so in scaled_objects.items():
        behavior = so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        up, down = behavior["scaleUp"], behavior["scaleDown"]
        # a worker takes minutes to start and its sessions move when it goes: remove slowly
        assert down["stabilizationWindowSeconds"] >= 300, name
        assert down["stabilizationWindowSeconds"] > up.get("stabilizationWindowSeconds", 0), name
        fallback = so["spec"].get("fallback")
        if fallback:
            assert fallback["replicas"] >= so["spec"]["minReplicaCount"], name


def test_triggers(scaled_objects):
    addresses = set()
    for name, so in scaled_objects.items():
        triggers = so["spec"]["triggers"]
        names = [t.get("name") for t in triggers]
        assert all(names) and len(set(names)) == len(names), f"{name}: trigger names must be set and unique"
        for trigger in triggers:
            assert trigger["type"] == "prometheus", (name, trigger["type"])
            # per pod: the HPA wants ceil(query / threshold) replicas; and KEDA's fallback works
            # with AverageValue triggers only
            assert trigger["metricType"] == "AverageValue", (name, trigger["name"])
            meta = trigger["metadata"]
            assert {"serverAddress", "query", "threshold"} <= set(meta), (name, trigger["name"])
            assert set(meta) <= PROMETHEUS_SCALER_KEYS, (name, set(meta) - PROMETHEUS_SCALER_KEYS)
            assert float(meta["threshold"]) > 0, (name, trigger["name"])
            assert meta.get("ignoreNullValues", "true") in ("true", "false"), (name, trigger["name"])
            assert re.fullmatch(r"https?://[^\s/]+(:\d+)?/?", meta["serverAddress"]), meta["serverAddress"]
            addresses.add(meta["serverAddress"])
    assert len(addresses) == 1, f"one Prometheus for every trigger, got {addresses}"


def test_thresholds_sit_below_the_workers_limits(scaled_objects, base_docs):
    for name, so in scaled_objects.items():
        role = _pool(so)
        config, _ = _worker_config(role, base_docs)
        found = set()
        for trigger in so["spec"]["triggers"]:
            query, threshold = trigger["metadata"]["query"], float(trigger["metadata"]["threshold"])
            for metric, field in GAUGE_LIMITS.items():
                if re.search(rf"\b{metric}\b", query):
                    limit = getattr(config, field)
                    assert threshold < limit, f"{name}/{trigger['name']}: {threshold} >= --{field} {limit}"
                    found.add(metric)
            if BUSY_METRIC in query:
                assert 0 < threshold < 1, f"{name}/{trigger['name']}: a busy fraction's threshold is below 1"
                found.add(BUSY_METRIC)
        assert found == {*GAUGE_LIMITS, BUSY_METRIC}, (name, found)


# ------------------------------------------------------------------ what the workers export --

@pytest.fixture(scope="module")
def exported(model_dirs, base_docs) -> dict[str, dict[str, list[dict[str, str]]]]:
    """{role: {sample name: [label sets]}} scraped from a worker of each role, started as its
    Deployment starts it (same parsed command, same OTEL_* settings; a free local port for the
    metrics, no trace export) with a tiny model, after one forward pass."""
    from prometheus_client.parser import text_string_to_metric_families

    from draft_service.engine import DraftEngine
    from draft_service.role import DRAFT
    from specdec.modeling import load_model
    from specdec.telemetry import Telemetry
    from specdec.worker.server import create_server
    from target_service.engine import TargetEngine
    from target_service.role import TARGET

    kinds = {"target": (TARGET, TargetEngine), "draft": (DRAFT, DraftEngine)}
    out = {}
    for role in WORKER_ROLES:
        config, env = _worker_config(role, base_docs)
        config = dataclasses.replace(config, host="127.0.0.1", port=0)
        otel = {k: v for k, v in env.items() if k.startswith("OTEL_")}
        otel.update(OTEL_EXPORTER_PROMETHEUS_HOST="127.0.0.1", OTEL_EXPORTER_PROMETHEUS_PORT="0",
                    OTEL_TRACES_EXPORTER="none")
        telemetry = Telemetry.from_env(DEPLOYMENTS[role], otel)  # as the service's main() does
        assert telemetry.prometheus_port, f"{role}: the manifests' OTEL_* settings serve no /metrics"
        service, engine_class = kinds[role]
        # an engine of its own: instrumenting the session-wide ones would reroute other tests' metrics
        engine = engine_class(load_model(str(model_dirs[role]), dtype="float32"))
        parts, _ = create_server(service, config, engine, telemetry)
        try:
            engine.open_session("autoscaling-check", [1, 2, 3, 4, 5])  # a prefill: one forward pass
            with urllib.request.urlopen(f"http://127.0.0.1:{telemetry.prometheus_port}/metrics", timeout=10) as r:
                body = r.read().decode()
        finally:
            parts.stop(None)
            engine.close()
        samples: dict[str, list[dict[str, str]]] = {}
        for family in text_string_to_metric_families(body):
            for sample in family.samples:
                samples.setdefault(sample.name, []).append(dict(sample.labels))
        out[role] = samples
    return out


def query_terms(query: str) -> tuple[list[tuple[str, list[tuple[str, str, str]]]], set[str]]:
    """([(metric, [(label, op, value)])], grouping labels) of a PromQL query; an unknown function
    fails. Enough PromQL for these queries: selectors, by/on/ignoring lists, ranges, arithmetic."""
    grouping: set[str] = set()

    def take_grouping(m: re.Match) -> str:
        grouping.update(x.strip() for x in m.group(2).split(",") if x.strip())
        return " "

    rest = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", take_grouping, query)
    selectors = []

    def take_selector(m: re.Match) -> str:
        matchers = re.findall(r'([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"([^"]*)"', m.group(2))
        selectors.append((m.group(1), matchers))
        return " "

    rest = re.sub(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*\{([^}]*)\}", take_selector, rest)
    assert "{" not in rest and "}" not in rest, f"a selector without a metric name: {query}"
    rest = re.sub(r"\[[^\]]*\]", " ", rest)  # range durations
    for m in re.finditer(r"(?<![\w.])[A-Za-z_:][A-Za-z0-9_:]*", rest):
        word = m.group(0)
        if rest[m.end():].lstrip().startswith("("):
            assert word in PROMQL_FUNCTIONS, f"{word}(): not a PromQL function these checks know: {query}"
        elif word not in PROMQL_KEYWORDS:
            selectors.append((word, []))
    return selectors, grouping


def check_query(query: str, samples: dict[str, list[dict[str, str]]], role: str) -> None:
    """Every metric the query names is a sample name the role's worker exports; every label it
    matches is on that metric with (for =) that value; every label it groups or joins by is on
    all its metrics or one Prometheus puts on every target (job, instance)."""
    selectors, grouping = query_terms(query)
    assert selectors, f"no metric in {query!r}"
    common = None
    for metric, matchers in selectors:
        assert metric in samples, (f"{metric} is not exported by the {role} worker "
                                   f"(exported: {sorted(n for n in samples if n.startswith('specdec_'))})")
        labels = {k for s in samples[metric] for k in s}
        common = labels if common is None else common & labels
        for label, op, value in matchers:
            assert label in labels, f"{metric} has no label {label!r} (has {sorted(labels)})"
            if op == "=":
                values = {s.get(label) for s in samples[metric]}
                assert value in values, f'{metric}{{{label}="{value}"}}: the {role} worker exports {label} in {values}'
    extra = grouping - common - TARGET_LABELS
    assert not extra, f"{query!r} groups or joins by {extra}: neither exported by the workers nor set by Prometheus"


@pytest.mark.parametrize("role", WORKER_ROLES)
def test_queries_name_what_the_pool_exports(role, scaled_objects, exported):
    (so,) = [so for so in scaled_objects.values() if _pool(so) == role]
    assert exported[role], role
    for trigger in so["spec"]["triggers"]:
        query = trigger["metadata"]["query"]
        check_query(query, exported[role], role)
        # the pool's own pods: the role label the worker sets on itself
        selectors, _ = query_terms(query)
        assert any(("specdec_role", "=", role) in matchers for _, matchers in selectors), (trigger["name"], query)


@pytest.mark.parametrize("mistake, fix, error", [
    ("specdec_worker_forward_duration_seconds_sum", "specdec_worker_forward_duration_sum", "not exported"),  # no unit
    ("specdec_worker_batch_sessions_count", "specdec_worker_batch_sessions_total", "not exported"),  # not a counter
    ('specdec_role="target"', 'role="target"', "has no label"),  # the compose Prometheus' label, not the workers'
    ('specdec_role="target"', 'specdec_role="specdec-target"', "exports specdec_role in"),  # not the worker's value
    ("by (instance)", "by (pod)", "groups or joins by"),  # a label only some scrape configs add
    ("rate(", "rte(", "not a PromQL function"),
])
def test_query_check_catches_mistakes(mistake, fix, error, scaled_objects, exported):
    busy = next(t for t in scaled_objects["specdec-target"]["spec"]["triggers"]
                if BUSY_METRIC in t["metadata"]["query"])["metadata"]["query"]
    assert mistake in busy
    with pytest.raises(AssertionError, match=error):
        check_query(busy.replace(mistake, fix), exported["target"], "target")


# ------------------------------------------------------------------------------- promtool --

# Pods of both pools: (role, instance, passes per second, sessions per pass, seconds per pass,
# open sessions, cached tokens). Dyadic rates, so that Prometheus' arithmetic is exact.
PODS = [
    ("target", "10.0.0.1:9464", 2, 2, 0.125, 3, 1000),
    ("target", "10.0.0.2:9464", 1, 1, 0.5, 5, 24),
    ("target", "10.0.0.3:9464", 0, 0, 0.0, 0, 0),  # idle: must not turn the sum into NaN
    ("draft", "10.0.1.1:9464", 4, 2, 0.1875, 7, 4096),
    ("draft", "10.0.1.2:9464", 2, 1, 0.125, 2, 0),
]
KINDS = {"target": ("prefill", "verify"), "draft": ("prefill", "propose")}


def _expected(role: str, metric: str, pods) -> float | None:
    mine = [p for p in pods if p[0] == role]
    if metric == "busy":  # passes per second x seconds per pass, over the pods that ran any
        busy = [passes * seconds for _, _, passes, _, seconds, _, _ in mine if passes]
        return sum(busy) if busy else None  # no pod ran a pass: an empty result (KEDA reads 0)
    return float(sum(p[5] if metric == "specdec_worker_sessions" else p[6] for p in mine))


def _input_series(exported, pods) -> list[dict]:
    """Series as Prometheus would store them: the scraped label sets, plus job and instance."""
    def name(metric: str, role: str, instance: str, **labels) -> str:
        scraped = next(s for s in exported[role][metric])
        labels = {**{k: v for k, v in scraped.items() if k != "le"}, **labels,
                  "job": "kubernetes-pods", "instance": instance}
        return metric + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"

    series = []
    for role, instance, passes, per_pass, seconds, sessions, cached in pods:
        def counter(metric: str, per_s: float, **labels) -> None:
            series.append({"series": name(metric, role, instance, **labels), "values": f"0+{per_s * 60:g}x15"})

        counter("specdec_worker_batch_sessions_count", passes)
        counter("specdec_worker_batch_sessions_sum", passes * per_pass)
        for kind in KINDS[role]:  # the forward histogram has one series per kind, no role
            counter("specdec_worker_forward_duration_seconds_count", passes * per_pass / 2, specdec_forward_kind=kind)
            counter("specdec_worker_forward_duration_seconds_sum", passes * per_pass * seconds / 2,
                    specdec_forward_kind=kind)
        for metric, value in (("specdec_worker_sessions", sessions), ("specdec_worker_cached_tokens", cached)):
            series.append({"series": name(metric, role, instance), "values": f"{value}+0x15"})
    return series


def test_queries_compute_each_pools_own_load(scaled_objects, exported, tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus): the queries were not "
                    "evaluated (their names and labels are checked above)")
    idle = [(role, instance, 0, 0, 0.0, 0, 0) for role, instance, *_ in PODS]
    tests = []
    for pods in (PODS, idle):
        cases = []
        for so in scaled_objects.values():
            role = _pool(so)
            for trigger in so["spec"]["triggers"]:
                query = trigger["metadata"]["query"]
                metric = "busy" if BUSY_METRIC in query else next(m for m in GAUGE_LIMITS if m in query)
                value = _expected(role, metric, pods)
                cases.append({"expr": query, "eval_time": "10m",
                              "exp_samples": [] if value is None else [{"labels": "{}", "value": value}]})
        tests.append({"interval": "1m", "input_series": _input_series(exported, pods), "promql_expr_test": cases})
    assert _expected("target", "busy", PODS) != _expected("draft", "busy", PODS)  # the pools tell apart
    path = tmp_path / "queries.test.yml"
    path.write_text(yaml.safe_dump({"rule_files": [], "evaluation_interval": "1m", "tests": tests}, sort_keys=False))
    proc = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---------------------------------------------------------------------------------- kubectl --

def test_component_renders_in_an_overlay(scaled_objects, tmp_path):
    """An overlay with the component (and a patch moving every trigger to another Prometheus, as
    README.md shows) renders: the base plus one ScaledObject per pool, all valid."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: `kubectl kustomize` not run (the manifests are validated above)")
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    rel = Path(os.path.relpath(K8S, overlay))  # kustomize refuses absolute paths
    address = "http://prometheus-operated.monitoring.svc:9090"
    (count,) = {len(so["spec"]["triggers"]) for so in scaled_objects.values()}  # one patch fits both
    ops = [{"op": "replace", "path": f"/spec/triggers/{i}/metadata/serverAddress", "value": address}
           for i in range(count)]
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [str(rel)], "components": [str(rel / "components" / "autoscaling")],
        "patches": [{"target": {"kind": "ScaledObject"}, "patch": yaml.safe_dump(ops)}]}))
    proc = subprocess.run([kubectl, "kustomize", str(overlay)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rendered = [d for d in yaml.safe_load_all(proc.stdout) if d]
    scaled = by_kind(rendered, "ScaledObject")
    assert sorted(scaled) == sorted(DEPLOYMENTS.values())
    deployments = by_kind(rendered, "Deployment")
    for name, so in scaled.items():
        validate_custom_resource(so)
        assert so["spec"]["scaleTargetRef"]["name"] in deployments
        assert {t["metadata"]["serverAddress"] for t in so["spec"]["triggers"]} == {address}, name
    for name in DEPLOYMENTS.values():
        assert "replicas" not in deployments[name]["spec"], name
