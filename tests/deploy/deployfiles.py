"""Reading the deployment files the way Docker Compose and Kubernetes would, for offline checks.

- compose: load a compose file, resolve ${VAR:-default} interpolation, merge an override file;
- kubernetes: load every manifest under deploy/k8s;
- Dockerfile: its instructions as Docker reads them, and whether .dockerignore keeps a path out;
- commands: check that an argv is a real entry point of this repo and that its flags parse with
  the very parsers the services use (so renaming a flag breaks a test, not a deployment).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import os
import re
import tomllib
from pathlib import Path
from typing import Any, Iterator, Mapping
from unittest import mock

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
COMPOSE_GPU = ROOT / "docker-compose.gpu.yml"
K8S = ROOT / "deploy" / "k8s"
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"

ROLES = ("target", "draft", "orchestrator")
WORKER_ROLES = ("target", "draft")
METRICS_PORT = 9464
STARTUP_BUDGET_S = 30 * 60  # a first start downloads and converts the model


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


# ---------------------------------------------------------------------------------- compose --

_VAR = re.compile(r"\$(?:(\$)|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


def interpolate(value: str, env: Mapping[str, str]) -> str:
    """Compose's variable substitution: $$, $VAR, ${VAR}, ${VAR:-default}, ${VAR-default}."""

    def sub(m: re.Match) -> str:
        if m.group(1):
            return "$"
        name = m.group(2) or m.group(5)
        op, default = m.group(3), m.group(4)
        if op in (":-", ":?"):
            present = bool(env.get(name))
        else:
            present = name in env
        if present:
            return env[name]
        if op in (":-", "-"):
            return default
        raise AssertionError(f"${{{name}}} has no default and is not set: compose would substitute ''")

    return _VAR.sub(sub, value)


def _interpolate_tree(node: Any, env: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [_interpolate_tree(v, env) for v in node]
    if isinstance(node, dict):
        return {k: _interpolate_tree(v, env) for k, v in node.items()}
    return node


def load_compose(path: Path, env: Mapping[str, str] | None = None) -> dict:
    """The file with interpolation resolved (defaults only, unless env is given); x-* keys dropped."""
    raw = yaml.safe_load(path.read_text())
    data = _interpolate_tree(raw, env or {})
    return {k: v for k, v in data.items() if not str(k).startswith("x-")}


def _env_dict(environment: Any) -> dict[str, str]:
    if environment is None:
        return {}
    if isinstance(environment, list):  # ["KEY=value", ...]
        return dict(item.split("=", 1) for item in environment)
    return {k: "" if v is None else str(v) for k, v in environment.items()}


def merge_compose(base: dict, override: dict) -> dict:
    """Enough of Compose's merge rules for these files: mappings merge, scalars and lists replace
    (environment merges by key, like Compose does)."""

    def merge(a: Any, b: Any, key: str = "") -> Any:
        if key == "environment":
            return {**_env_dict(a), **_env_dict(b)}
        if isinstance(a, dict) and isinstance(b, dict):
            out = dict(a)
            for k, v in b.items():
                out[k] = merge(a[k], v, k) if k in a else v
            return out
        return b

    return merge(base, override)


def compose_services(*paths: Path) -> dict[str, dict]:
    data = load_compose(paths[0])
    for path in paths[1:]:
        data = merge_compose(data, load_compose(path))
    return data["services"]


def service_env(service: dict) -> dict[str, str]:
    return _env_dict(service.get("environment"))


def healthcheck_argv(service: dict) -> list[str]:
    test = service["healthcheck"]["test"]
    assert isinstance(test, list) and test[0] in ("CMD", "CMD-SHELL"), test
    return test[1:] if test[0] == "CMD" else test[1].split()


# ------------------------------------------------------------------------------- kubernetes --

def k8s_manifest_files() -> list[Path]:
    """Every resource file under deploy/k8s (kustomization files are not resources)."""
    return sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")


def k8s_docs(paths: list[Path] | None = None) -> list[dict]:
    docs = []
    for path in paths or k8s_manifest_files():
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


# Custom resources (KEDA's ScaledObject) are validated against their CRD's openAPIV3Schema,
# vendored under tests/deploy/schemas (see its README.md for the source and version).
SCHEMAS = Path(__file__).resolve().parent / "schemas"
KEDA_CRD = SCHEMAS / "keda.sh_scaledobjects.yaml"
KEDA_VERSION = "v2.18.3"
KEDA_CRD_SHA256 = "44e8d3444bb884ed5c8dc4f1b118944a54fe9c81534048793c20b9394ae1de2c"


def _closed(schema: Any) -> Any:
    """The schema with every object that lists its properties closed to others, as the API server
    does for a custom resource under strict field validation (kubectl's default)."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@functools.lru_cache(maxsize=None)
def crd_schemas(path: Path = KEDA_CRD) -> dict[tuple[str, str], dict]:
    """{(apiVersion, kind): strict JSON schema} for every served version of the CRD in path."""
    crd = yaml.safe_load(path.read_text())
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    return {(f"{group}/{v['name']}", kind): _closed(v["schema"]["openAPIV3Schema"])
            for v in crd["spec"]["versions"] if v.get("served")}


def is_custom_resource(doc: dict) -> bool:
    return (doc.get("apiVersion"), doc.get("kind")) in crd_schemas()


def validate_custom_resource(doc: dict) -> None:
    """Validates doc against its vendored CRD schema (unknown fields fail); its metadata against
    the Kubernetes ObjectMeta schema. Raises AssertionError naming the path."""
    import jsonschema
    import kubernetes_validate

    schemas = crd_schemas()
    key = (doc.get("apiVersion"), doc.get("kind"))
    assert key in schemas, f"no vendored CRD schema for {key}"
    name = f"{doc['kind']}/{doc.get('metadata', {}).get('name')}"
    errors = sorted(jsonschema.Draft7Validator(schemas[key]).iter_errors(doc),
                    key=lambda e: [str(p) for p in e.absolute_path])
    if errors:
        err = errors[0]
        path = ".".join(str(p) for p in err.absolute_path)
        raise AssertionError(f"{name} at {path}: {err.message}")
    # metadata is a plain object in a CRD schema: the API server checks it as ObjectMeta
    try:
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc["metadata"]},
                                     "1.31", strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = ".".join(str(p) for p in exc.path)
        raise AssertionError(f"{name} at {path}: {exc.message}") from None


def container_env(container: dict, configmaps: Mapping[str, dict]) -> dict[str, str]:
    """env as the container sees it: envFrom ConfigMaps first, then env entries on top."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        ref = source["configMapRef"]["name"]
        assert ref in configmaps, f"envFrom names ConfigMap {ref!r}, which no manifest defines"
        env.update(configmaps[ref]["data"])
    for item in container.get("env", []):
        env[item["name"]] = item["value"]
    return env


# ---------------------------------------------------------------- Dockerfile, .dockerignore --

def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, current = [], ""
    for line in text.splitlines():
        if line.strip().startswith("#") or not line.strip():
            continue  # Docker drops comment lines, even inside a continued instruction
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        word, _, rest = current.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        current = ""
    assert not current, "the Dockerfile ends inside a continued line"
    return out


def _ignore_patterns() -> list[tuple[bool, re.Pattern]]:
    patterns = []
    for line in DOCKERIGNORE.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        glob = line.lstrip("!").strip("/")
        regex = re.escape(glob).replace(r"\*\*/", "(?:.*/)?").replace(r"\*\*", ".*")
        regex = regex.replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        patterns.append((negate, re.compile(regex)))
    return patterns


def ignored(path: str) -> bool:
    """Docker's rule: the last pattern that matches the path (or a parent of it) decides."""
    parts = path.strip("/").split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    result = False
    for negate, pattern in _ignore_patterns():
        if any(pattern.fullmatch(c) for c in candidates):
            result = not negate
    return result


# -------------------------------------------------------------------------- entry points ----

def _module_runs_as_main(module: str) -> bool:
    """`python -m module` runs: a package with __main__.py, or a module with a __main__ guard."""
    path = ROOT.joinpath(*module.split("."))
    if (path / "__main__.py").is_file():
        return True
    file = path.with_suffix(".py")
    return file.is_file() and re.search(r"""^if __name__ == ["']__main__["']:""", file.read_text(), re.M) is not None


@contextlib.contextmanager
def _environment(env: Mapping[str, str]) -> Iterator[None]:
    """Only the variables the deployment sets: the parsers read SPECDEC_* defaults from os.environ."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SPECDEC_")}
    with mock.patch.dict(os.environ, {**clean, **env}, clear=True):
        yield


def _parse(module: str, args: list[str]) -> Any:
    """The module's own parser on args; SystemExit (a bad flag) becomes an AssertionError."""
    from orchestrator.config import OrchestratorConfig
    from specdec import healthcheck
    from specdec.worker.config import WorkerConfig

    parsers = {
        "target_service": lambda a: WorkerConfig.from_args("target", a),
        "draft_service": lambda a: WorkerConfig.from_args("draft", a),
        "orchestrator": lambda a: OrchestratorConfig.from_args(a),
        "specdec.healthcheck": lambda a: healthcheck.build_parser().parse_args(a),
    }
    assert module in parsers, f"no parser check for `python -m {module}`: add it to tests/deploy/deployfiles.py"
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parsers[module](args)
    except SystemExit as exc:
        raise AssertionError(f"`python -m {module} {' '.join(args)}` does not parse: {err.getvalue().strip().splitlines()[-1]}") from exc


def check_command(argv: list[str], env: Mapping[str, str] | None = None) -> Any:
    """Asserts argv is an entry point of this repo whose flags parse (with env, as a container
    would see it); returns the parsed configuration."""
    assert argv, "empty command"
    env = dict(env or {})
    if argv[0] in ("python", "python3"):
        assert len(argv) >= 3 and argv[1] == "-m", f"expected `python -m MODULE ...`, got {argv}"
        module, args = argv[2], [str(a) for a in argv[3:]]
        assert _module_runs_as_main(module), f"`python -m {module}`: no such runnable module in this repo"
        with _environment(env):
            return _parse(module, args)
    scripts = pyproject()["project"].get("scripts", {})
    assert argv[0] in scripts, f"{argv[0]!r} is neither `python -m ...` nor a console script of pyproject.toml"
    module_name, func_name = scripts[argv[0]].split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    assert argv[1:] == ["--help"], f"no parser check for `{' '.join(argv)}`: add one to tests/deploy/deployfiles.py"
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            func(["--help"])
    except SystemExit as exc:
        assert exc.code == 0, f"`{argv[0]} --help` exited {exc.code}"
    else:
        raise AssertionError(f"`{argv[0]} --help` did not exit")
    return None


def check_specdec_env(argv: list[str], env: Mapping[str, str], base: Mapping[str, str] | None = None) -> None:
    """Every SPECDEC_* variable must change what the command parses to: a renamed flag (or a
    misspelt variable) would otherwise be ignored without a word. base: the environment an
    override file merged into; a variable it sets differently must change the parse from its
    value there (an override may set a flag back to its default)."""
    base = base or {}
    specdec_vars = [k for k in env if k.startswith("SPECDEC_") and k != "SPECDEC_CACHE"]
    if not specdec_vars:
        return
    with_all = check_command(argv, env)
    for name in specdec_vars:
        instead = {k: v for k, v in env.items() if k != name}
        if name in base and base[name] != env[name]:
            instead[name] = base[name]
        without = check_command(argv, instead)
        assert with_all != without, f"{name}={env[name]!r} has no effect on `{' '.join(argv[:3])}`"


def otel_variable_names() -> set[str]:
    """The OTEL_* variables the OpenTelemetry SDK defines (to catch misspelt names)."""
    import opentelemetry.environment_variables as api_vars
    import opentelemetry.sdk.environment_variables as sdk_vars

    return {v for m in (api_vars, sdk_vars) for k, v in vars(m).items() if k.startswith("OTEL_") and isinstance(v, str)}


def flag_value(args: list[str], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None
