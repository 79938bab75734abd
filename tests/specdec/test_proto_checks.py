"""The gRPC API as a product: buf lint, buf breaking against the kept baseline, a comment on every
element of the protos, and docs/api.md generated from those comments.

buf comes from npm (scripts/buf.py installs the pinned version into tools/buf/node_modules);
without npm or node the buf tests skip, and only then. The comment and docs checks need no buf.
Each check has a negative control: a temporary copy of proto/ broken on purpose must fail it.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"specdec_scripts_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


buf = _load("buf")
api_docs = _load("gen_api_docs")


@pytest.fixture(scope="module")
def buf_installed():
    try:
        buf.install(quiet=True)
    except buf.BufUnavailable as exc:
        pytest.skip(f"buf cannot be installed here: {exc}")


@pytest.fixture
def proto_copy(tmp_path: Path) -> Path:
    """buf.yaml and proto/specdec/ copied to a temporary folder, to be broken on purpose."""
    shutil.copy(ROOT / "buf.yaml", tmp_path / "buf.yaml")
    shutil.copytree(ROOT / "proto" / "specdec", tmp_path / "proto" / "specdec")
    return tmp_path


def edit(root: Path, file: str, old: str, new: str) -> None:
    """Replaces the one occurrence of `old` in proto/specdec/v1/`file` under root."""
    path = root / "proto" / "specdec" / "v1" / file
    text = path.read_text()
    assert text.count(old) == 1, f"{file}: {old!r} occurs {text.count(old)} times; the edit would test nothing"
    path.write_text(text.replace(old, new))


def problems(result: subprocess.CompletedProcess) -> str:
    return f"rc {result.returncode}\n{result.stdout}\n{result.stderr}"


# ---- buf lint ---------------------------------------------------------------------------------


def test_buf_lint_passes(buf_installed):
    result = buf.lint()
    assert result.returncode == 0, problems(result)


def test_buf_lint_fails_on_a_field_without_a_comment(buf_installed, proto_copy):
    edit(proto_copy, "orchestrator.proto", "  // Sessions this orchestrator has placed on it since it started.\n", "")
    result = buf.lint(proto_copy)
    assert result.returncode != 0, problems(result)
    assert buf.rule_ids(result) == ["COMMENT_FIELD"], problems(result)
    assert "placed_sessions" in result.stdout


# ---- buf breaking -----------------------------------------------------------------------------


def test_buf_breaking_passes_against_the_baseline(buf_installed):
    result = buf.breaking()
    assert result.returncode == 0, ("proto/ breaks the API recorded in proto/baseline.txtpb; undo the change, or "
                                    "if it is intended see README.md, The gRPC API\n" + problems(result))


def test_baseline_records_every_field_of_the_protos(buf_installed):
    """The baseline is the current protos' image: a field added since is recorded (and so
    protected) too. Fix: python scripts/buf.py baseline (it refuses a breaking change)."""
    assert buf.baseline_is_current(), "proto/baseline.txtpb lags behind proto/: run python scripts/buf.py baseline"


BREAKING_CHANGES = {
    # name: (file, old text, new text, the rule buf must report)
    "field renumbered": ("orchestrator.proto", "optional uint64 seed = 8;", "optional uint64 seed = 999;",
                         "FIELD_NO_DELETE"),
    "field renumbered, old number reserved": ("orchestrator.proto", "optional uint64 seed = 8;",
                                              "reserved 8;\n  optional uint64 seed = 999;", "FIELD_NO_DELETE"),
    "two fields swap numbers": ("orchestrator.proto",
                                "uint32 drafted_tokens = 4;\n  // Drafts accepted over all rounds.\n"
                                "  uint32 accepted_tokens = 5;",
                                "uint32 drafted_tokens = 5;\n  // Drafts accepted over all rounds.\n"
                                "  uint32 accepted_tokens = 4;", "FIELD_SAME_NAME"),
    "field removed": ("common.proto", "  uint64 held_tokens = 13;\n", "", "FIELD_NO_DELETE"),
    "field retyped": ("target.proto", "uint32 batch_rows = 6;", "uint64 batch_rows = 6;", "FIELD_SAME_TYPE"),
    "message renamed": ("orchestrator.proto", "message WorkerStatus {", "message WorkerState {",
                        "MESSAGE_NO_DELETE"),
    "enum value renumbered": ("orchestrator.proto", "SAMPLING_MODE_COUPLED = 2;", "SAMPLING_MODE_COUPLED = 3;",
                              "ENUM_VALUE_NO_DELETE"),
    "rpc renamed": ("draft.proto", "rpc ProposeBatch(", "rpc ProposeMany(", "RPC_NO_DELETE"),
}


@pytest.mark.parametrize("change", sorted(BREAKING_CHANGES))
def test_buf_breaking_fails_on_a_broken_copy(buf_installed, proto_copy, change):
    file, old, new, rule = BREAKING_CHANGES[change]
    assert buf.breaking(proto_copy).returncode == 0  # the copy itself is fine: only the edit breaks it
    if old.startswith("message WorkerStatus"):  # a renamed message: its uses follow it
        path = proto_copy / "proto" / "specdec" / "v1" / file
        path.write_text(path.read_text().replace("repeated WorkerStatus workers", "repeated WorkerState workers"))
    edit(proto_copy, file, old, new)
    result = buf.breaking(proto_copy)
    assert result.returncode != 0, f"{change}: buf breaking passed\n{problems(result)}"
    assert rule in buf.rule_ids(result), problems(result)


def test_buf_breaking_passes_an_added_field_and_a_changed_comment(buf_installed, proto_copy):
    edit(proto_copy, "orchestrator.proto", "  uint64 seed = 26;\n",
         "  uint64 seed = 26;\n  // A field added later.\n  uint32 added_later = 99;\n")
    edit(proto_copy, "orchestrator.proto", "// Why a generation ended.\n", "// Why a generation stopped.\n")
    result = buf.breaking(proto_copy)
    assert result.returncode == 0, problems(result)


# ---- a comment on every element ---------------------------------------------------------------


def test_every_element_of_the_protos_has_a_comment():
    found = api_docs.elements(api_docs.descriptor_set())
    # the walk reaches every kind of element (an empty walk would pass any check)
    assert {e.kind for e in found} == {"file", "service", "rpc", "message", "field", "oneof", "enum", "enum value"}
    assert sum(e.kind == "field" for e in found) > 130
    assert api_docs.undocumented(api_docs.descriptor_set()) == []


MISSING_COMMENTS = {
    # name: (file, the comment to remove or move, what it becomes, the element reported)
    "field": ("target.proto", "  // Tokens of all sessions in the forward pass this verify ran in.\n", "",
              "field specdec.v1.VerifyResponse.batch_rows"),
    "field with a trailing comment only": (
        "common.proto", "  // Server-side seconds the prefill took.\n  double compute_s = 2;",
        "  double compute_s = 2;  // Server-side seconds the prefill took.",
        "field specdec.v1.OpenSessionResponse.compute_s"),
    "message": ("common.proto", "// The session's length after a Truncate.\n", "",
                "message specdec.v1.TruncateResponse"),
    "rpc": ("draft.proto", "  // Frees a session.\n", "", "rpc specdec.v1.DraftWorker.CloseSession"),
    "enum": ("orchestrator.proto", "// Why a generation ended.\n", "", "enum specdec.v1.FinishReason"),
    "enum value": ("orchestrator.proto", "  // max_new_tokens reached.\n", "",
                   "enum value specdec.v1.FinishReason.FINISH_REASON_LENGTH"),
    "oneof": ("common.proto", "  // Exactly one form is set; a Probs with neither is refused (INVALID_ARGUMENT).\n",
              "", "oneof specdec.v1.Probs.form"),
}


@pytest.mark.parametrize("kind", sorted(MISSING_COMMENTS))
def test_a_missing_comment_is_reported(proto_copy, kind):
    file, old, new, element = MISSING_COMMENTS[kind]
    edit(proto_copy, file, old, new)
    reported = api_docs.undocumented(api_docs.descriptor_set(proto_copy / "proto"))
    assert len(reported) == 1 and reported[0].endswith(f": {element} has no comment above it"), reported


def test_a_service_without_a_comment_is_reported(proto_copy):
    path = proto_copy / "proto" / "specdec" / "v1" / "target.proto"
    lines = path.read_text().splitlines(keepends=True)
    at = lines.index("service TargetWorker {\n")
    while lines[at - 1].startswith("//"):  # the service's comment block
        del lines[at - 1]
        at -= 1
    path.write_text("".join(lines))
    reported = api_docs.undocumented(api_docs.descriptor_set(proto_copy / "proto"))
    assert [r.split(": ", 1)[1] for r in reported] == ["service specdec.v1.TargetWorker has no comment above it"]


# ---- docs/api.md ------------------------------------------------------------------------------


def test_api_reference_is_up_to_date():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_api_docs.py"), "--check"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_api_reference_goes_stale_when_a_comment_changes(proto_copy):
    assert api_docs.check(proto_copy / "proto") == []  # the copy matches docs/api.md ...
    edit(proto_copy, "orchestrator.proto", "  // Tokens generated (the length of token_ids).\n",
         "  // Tokens generated.\n")
    stale = api_docs.check(proto_copy / "proto")  # ... until a comment changes
    assert len(stale) == 1 and "is stale" in stale[0], stale


def test_api_reference_lists_every_element():
    page = (ROOT / "docs" / "api.md").read_text()
    for e in api_docs.elements(api_docs.descriptor_set()):
        short = e.name.rsplit(".", 1)[-1] if e.kind != "file" else e.name
        if e.kind in ("service", "message", "enum"):
            assert f"### {e.kind} {short}\n" in page, e.name
        elif e.kind in ("field", "rpc", "enum value"):
            assert f"| `{short}` |" in page, e.name
        elif e.kind == "oneof":
            assert f"oneof `{short}`:" in page, e.name
