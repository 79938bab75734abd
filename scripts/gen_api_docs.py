"""Generates docs/api.md, the gRPC API reference, from the comments in proto/specdec/v1/.

protoc (grpc_tools, as scripts/gen_protos.py uses) compiles the protos into a FileDescriptorSet
with source info, which holds every element's leading comment; the page lists each file's
services with their RPCs, its messages with their fields and its enums with their values.

Every service, RPC, message, field, oneof, enum and enum value must be documented by a leading
comment (the comment lines right above it, as buf's COMMENT_* lint rules read them; a comment at
the end of the line does not count). `--check` exits 1 when one is not, or when docs/api.md is
not what this script generates (tests/specdec/test_proto_checks.py runs it, so a stale page or a
missing comment fails the tests). Run it without arguments after changing a .proto file.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PACKAGE_DIR = Path("specdec") / "v1"
DOC = ROOT / "docs" / "api.md"
# the client-facing service first, then the workers, then what they share
FILE_ORDER = ["orchestrator.proto", "draft.proto", "target.proto", "common.proto"]

# FileDescriptorProto / DescriptorProto / ... field numbers, as SourceCodeInfo paths use them
FILE_MESSAGE, FILE_ENUM, FILE_SERVICE, FILE_SYNTAX = 4, 5, 6, 12
MESSAGE_FIELD, MESSAGE_NESTED, MESSAGE_ENUM, MESSAGE_ONEOF, MESSAGE_RESERVED = 2, 3, 4, 8, 9
ENUM_VALUE, SERVICE_METHOD = 2, 2


def descriptor_set(proto_root: Path = PROTO_ROOT):
    """The FileDescriptorSet (with source info) of proto_root/specdec/v1/*.proto."""
    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc  # build-time dependency only

    protos = sorted((proto_root / PACKAGE_DIR).glob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "descriptors.binpb"
        args = ["grpc_tools.protoc", f"-I{proto_root}", f"-I{include}", f"--descriptor_set_out={out}",
                "--include_source_info", *[str(p.relative_to(proto_root)) for p in protos]]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        fds = descriptor_pb2.FileDescriptorSet()
        fds.ParseFromString(out.read_bytes())
    return fds


@dataclass
class Element:
    kind: str  # service, rpc, message, field, oneof, enum, enum value, reserved, file
    name: str  # its full name, e.g. specdec.v1.GenerateRequest.seed
    file: str
    line: int  # 1-based; 0 when unknown
    comment: str  # the leading comment, stripped; "" when none


def _comments(file) -> dict[tuple[int, ...], tuple[str, int]]:
    return {tuple(loc.path): (loc.leading_comments.strip(), loc.span[0] + 1 if loc.span else 0)
            for loc in file.source_code_info.location}


def elements(fds) -> list[Element]:
    """Every documentable element of every file, with its leading comment."""
    out: list[Element] = []
    for file in fds.file:
        comments = _comments(file)

        def add(kind: str, name: str, path: tuple[int, ...]) -> None:
            comment, line = comments.get(path, ("", 0))
            out.append(Element(kind, name, file.name, line, comment))

        def enum(e, prefix: str, path: tuple[int, ...]) -> None:
            add("enum", f"{prefix}.{e.name}", path)
            for k, value in enumerate(e.value):
                add("enum value", f"{prefix}.{e.name}.{value.name}", (*path, ENUM_VALUE, k))

        def message(m, prefix: str, path: tuple[int, ...]) -> None:
            name = f"{prefix}.{m.name}"
            add("message", name, path)
            for k, f in enumerate(m.field):
                add("field", f"{name}.{f.name}", (*path, MESSAGE_FIELD, k))
            for k, o in enumerate(m.oneof_decl):
                if not _synthetic(m, k):
                    add("oneof", f"{name}.{o.name}", (*path, MESSAGE_ONEOF, k))
            for k, nested in enumerate(m.nested_type):
                if not nested.options.map_entry:
                    message(nested, name, (*path, MESSAGE_NESTED, k))
            for k, e in enumerate(m.enum_type):
                enum(e, name, (*path, MESSAGE_ENUM, k))

        add("file", file.name, (FILE_SYNTAX,))
        for i, m in enumerate(file.message_type):
            message(m, file.package, (FILE_MESSAGE, i))
        for i, e in enumerate(file.enum_type):
            enum(e, file.package, (FILE_ENUM, i))
        for i, s in enumerate(file.service):
            add("service", f"{file.package}.{s.name}", (FILE_SERVICE, i))
            for k, method in enumerate(s.method):
                add("rpc", f"{file.package}.{s.name}.{method.name}", (FILE_SERVICE, i, SERVICE_METHOD, k))
    return out


def _synthetic(message, oneof_index: int) -> bool:
    """The oneof protoc makes for a proto3 `optional` field: not written in the .proto."""
    members = [f for f in message.field if f.HasField("oneof_index") and f.oneof_index == oneof_index]
    return bool(members) and all(f.proto3_optional for f in members)


def undocumented(fds) -> list[str]:
    """'file:line: kind name' for each element without a leading comment."""
    return [f"proto/{e.file}:{e.line}: {e.kind} {e.name} has no comment above it"
            for e in elements(fds) if not e.comment]


# ---- the page ------------------------------------------------------------------------------

SCALARS = {1: "double", 2: "float", 3: "int64", 4: "uint64", 5: "int32", 6: "fixed64", 7: "fixed32", 8: "bool",
           9: "string", 12: "bytes", 13: "uint32", 15: "sfixed32", 16: "sfixed64", 17: "sint32", 18: "sint64"}
TYPE_MESSAGE, TYPE_ENUM, LABEL_REPEATED = 11, 14, 3


def _escape(text: str) -> str:
    """Comment text as Markdown text: a '<' would open an HTML tag (e.g. "+<quantization>")."""
    return text.replace("<", "&lt;")


def _paragraphs(comment: str) -> str:
    """A comment as Markdown paragraphs: its lines joined, blank comment lines kept as breaks."""
    paras = [" ".join(line.strip() for line in block.splitlines()) for block in comment.split("\n\n")]
    return "\n\n".join(_escape(p) for p in paras if p)


def _cell(comment: str) -> str:
    return _escape(" ".join(line.strip() for line in comment.splitlines() if line.strip())).replace("|", "\\|")


def _anchor(kind: str, name: str) -> str:
    """GitHub's anchor for the heading '{kind} {name}': lower case, punctuation dropped."""
    return re.sub(r"[^\w\- ]", "", f"{kind} {name}".lower()).replace(" ", "-")


def _type_link(type_name: str, kinds: dict[str, str]) -> str:
    full = type_name.lstrip(".")
    short = full.rsplit(".", 1)[-1]
    kind = kinds.get(full)
    return f"[{short}](#{_anchor(kind, short)})" if kind else f"`{full}`"


def _field_type(field, kinds: dict[str, str], maps: dict[str, str] | None = None) -> str:
    if maps and field.type_name.lstrip(".") in maps:  # a map's entry type: map<K, V>, not a repeated message
        return maps[field.type_name.lstrip(".")]
    if field.type in (TYPE_MESSAGE, TYPE_ENUM):
        base = _type_link(field.type_name, kinds)
    else:
        base = f"`{SCALARS.get(field.type, str(field.type))}`"
    if field.label == LABEL_REPEATED:
        return f"repeated {base}"
    if field.proto3_optional:
        return f"optional {base}"
    return base


def render(fds) -> str:
    """docs/api.md for the descriptor set."""
    docs = {(e.kind, e.name): e.comment for e in elements(fds)}
    kinds: dict[str, str] = {}
    for file in fds.file:
        for m in file.message_type:
            kinds[f"{file.package}.{m.name}"] = "message"
        for e in file.enum_type:
            kinds[f"{file.package}.{e.name}"] = "enum"
    files = sorted(fds.file, key=lambda f: (FILE_ORDER.index(Path(f.name).name)
                                            if Path(f.name).name in FILE_ORDER else len(FILE_ORDER), f.name))
    out = [
        "# gRPC API reference",
        "",
        "<!-- Generated by scripts/gen_api_docs.py from the comments in proto/specdec/v1/. Do not edit:",
        "     change the .proto comments and run `python scripts/gen_api_docs.py` (or `make protos`). -->",
        "",
        "Generated from the comments in [`proto/specdec/v1/`](../proto/specdec/v1/) by",
        "`scripts/gen_api_docs.py`; a test fails when this page is stale or an element has no comment.",
        "All files are in package `specdec.v1`. Clients call the `Orchestrator` service; the draft and",
        "target workers' services are what the orchestrator calls. Compatibility is checked by",
        "`buf breaking` against `proto/baseline.txtpb` (see README.md, *The gRPC API*).",
        "",
        "## Contents",
        "",
    ]
    for file in files:
        out.append(f"- [`{file.name}`](#{_anchor('file', file.name)})")
        for s in file.service:
            out.append(f"  - service [{s.name}](#{_anchor('service', s.name)})")
        for m in file.message_type:
            out.append(f"  - message [{m.name}](#{_anchor('message', m.name)})")
        for e in file.enum_type:
            out.append(f"  - enum [{e.name}](#{_anchor('enum', e.name)})")
    for file in files:
        pkg = file.package
        out += ["", f"## file {file.name}", "", _paragraphs(docs[("file", file.name)])]
        for s in file.service:
            out += ["", f"### service {s.name}", "", _paragraphs(docs[("service", f"{pkg}.{s.name}")]), "",
                    "| RPC | request | response | description |", "|---|---|---|---|"]
            for method in s.method:
                request = ("stream " if method.client_streaming else "") + _type_link(method.input_type, kinds)
                response = ("stream " if method.server_streaming else "") + _type_link(method.output_type, kinds)
                out.append(f"| `{method.name}` | {request} | {response} | "
                           f"{_cell(docs[('rpc', f'{pkg}.{s.name}.{method.name}')])} |")
        for i, m in enumerate(file.message_type):
            out += _message(file, m, (FILE_MESSAGE, i), pkg, docs, kinds)
        for e in file.enum_type:
            out += _enum(e, f"{pkg}.{e.name}", docs)
    return "\n".join(out) + "\n"


def _message(file, m, path: tuple[int, ...], prefix: str, docs, kinds) -> list[str]:
    name = f"{prefix}.{m.name}"
    out = ["", f"### message {m.name}", "", _paragraphs(docs[("message", name)])]
    oneofs = {k: o.name for k, o in enumerate(m.oneof_decl) if not _synthetic(m, k)}
    maps = {f"{name}.{e.name}": "map<{}, {}>".format(*(_field_type(f, kinds).strip("`") for f in e.field))
            for e in m.nested_type if e.options.map_entry}
    if m.field:
        out += ["", "| field | number | type | description |", "|---|---|---|---|"]
        for f in m.field:
            note = ""
            if f.HasField("oneof_index") and f.oneof_index in oneofs:
                note = f"(oneof `{oneofs[f.oneof_index]}`) "
            out.append(f"| `{f.name}` | {f.number} | {_field_type(f, kinds, maps)} | {note}{_cell(docs[('field', f'{name}.{f.name}')])} |")
    else:
        out += ["", "No fields."]
    for k, o in oneofs.items():
        out += ["", f"oneof `{o}`: {_cell(docs[('oneof', f'{name}.{o}')])}"]
    # a `reserved` statement's comment is on the statement (path ..., 9), its ranges at (..., 9, k)
    statements, lines = {}, {}
    for loc in file.source_code_info.location:
        where = tuple(loc.path)
        if where == (*path, MESSAGE_RESERVED):
            statements[loc.span[0]] = loc.leading_comments.strip()
        elif len(where) == len(path) + 2 and where[:-1] == (*path, MESSAGE_RESERVED):
            lines[where[-1]] = loc.span[0]
    for k, r in enumerate(m.reserved_range):
        numbers = str(r.start) if r.end == r.start + 1 else f"{r.start} to {r.end - 1}"
        comment = statements.get(lines.get(k, -1), "")
        out += ["", f"Reserved number {numbers}" + (f": {_cell(comment)}" if comment else ".")]
    if m.reserved_name:
        out += ["", "Reserved names: " + ", ".join(f"`{n}`" for n in m.reserved_name) + "."]
    if any(not e.options.map_entry for e in m.nested_type) or m.enum_type:
        raise SystemExit(f"{name}: nested types are not rendered yet (scripts/gen_api_docs.py)")
    return out


def _enum(e, name: str, docs) -> list[str]:
    out = ["", f"### enum {e.name}", "", _paragraphs(docs[("enum", name)]), "",
           "| value | number | description |", "|---|---|---|"]
    for v in e.value:
        out.append(f"| `{v.name}` | {v.number} | {_cell(docs[('enum value', f'{name}.{v.name}')])} |")
    return out


def check(proto_root: Path = PROTO_ROOT, doc: Path = DOC) -> list[str]:
    """What is wrong: undocumented elements, or a stale page. Empty when all is well."""
    fds = descriptor_set(proto_root)
    problems = undocumented(fds)
    if not problems and (not doc.exists() or doc.read_text() != render(fds)):
        problems.append(f"{doc.relative_to(ROOT) if doc.is_relative_to(ROOT) else doc} is stale: "
                        "run python scripts/gen_api_docs.py")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="fail if an element has no comment or docs/api.md is stale; write nothing")
    args = parser.parse_args()
    if args.check:
        problems = check()
        if problems:
            print(*problems, sep="\n", file=sys.stderr)
            raise SystemExit(1)
        print("every element is documented and docs/api.md is up to date")
        return
    fds = descriptor_set()
    missing = undocumented(fds)
    if missing:
        print(*missing, sep="\n", file=sys.stderr)
        raise SystemExit("add the missing comments first")
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text(render(fds))
    print(DOC.relative_to(ROOT))


if __name__ == "__main__":
    main()
