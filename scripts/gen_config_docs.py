"""Generates docs/configuration.md, the reference of every service flag, from the flag tables.

The tables are the one place a flag is defined (specdec/flags.py): orchestrator.config.FLAGS
(role "orchestrator") and specdec.worker.config.FLAGS (roles "target" and "draft"; `Flag.roles`
says which roles have a flag). For each flag the page gives its name, default, environment
variable (`FlagTable.env_name`) and help, under the headings of the table's groups. `specdec serve`'s own flags are read from
orchestrator.serve.add_arguments (how it routes the rest is written here), the environment
variables that are no flag's from specdec/envs.py.

    .venv/bin/python scripts/gen_config_docs.py           # writes docs/configuration.md
    .venv/bin/python scripts/gen_config_docs.py --check   # exit 1 when docs/configuration.md is stale

tests/docs/test_configuration_docs.py fails when the page is not what this script generates now,
so a flag added, removed or changed without regenerating the page fails the tests.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "configuration.md"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

WORKER_ROLES = ("target", "draft")

# What a flag whose table gives no help does (the table's help wins once it has some).
UNSAID = {
    "--host": "address the gRPC server listens on",
    "--port": "gRPC port",
    "--max-sessions": "sessions the worker holds at once; beyond them RESOURCE_EXHAUSTED",
}


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _default(flag) -> str:
    if flag.required:
        return "required"
    if flag.default is None:
        return "unset"
    return f"`{flag.default}`"


def _description(flag) -> str:
    text = _cell(flag.help) or UNSAID.get(flag.name, "")
    if flag.choices:
        if text and not text.endswith("."):
            text += "."
        text += (" " if text else "") + "Choices: " + ", ".join(f"`{c}`" for c in flag.choices) + "."
    return text


def _rows(table, flags, roles: tuple[str, ...]) -> list[str]:
    rows = []
    for flag in flags:
        has = [r for r in roles if flag.roles is None or r in flag.roles]
        if not has:
            continue
        env = ", ".join(f"`{table.env_name(flag, r)}`" for r in has)
        if len(roles) > 1:
            rows.append(f"| `{flag.name}` | {', '.join(has)} | {_default(flag)} | {env} | {_description(flag)} |")
        else:
            rows.append(f"| `{flag.name}` | {_default(flag)} | {env} | {_description(flag)} |")
    return rows


def _table_section(title: str, intro: list[str], table, roles: tuple[str, ...]) -> list[str]:
    """The table's flags under a heading per group (as `--help` groups them)."""
    if len(roles) > 1:
        header = ["| flag | roles | default | environment variable | description |", "|---|---|---|---|---|"]
    else:
        header = ["| flag | default | environment variable | description |", "|---|---|---|---|"]
    by_name = {f.name: f for f in table.flags}
    groups = [(name, [by_name[n] for n in names if n in by_name]) for name, names in table.groups]
    grouped = {f.name for _, flags in groups for f in flags}
    rest = [f for f in table.flags if f.name not in grouped]  # FlagTable refuses these
    if rest or not groups:
        groups.append(("other" if groups else "", rest))
    out = ["", f"## {title}", "", *intro]
    for name, flags in groups:
        out += ["", f"### {title}: {name}" if name else "", "", *header, *_rows(table, flags, roles)]
    return out


def _serve_section() -> list[str]:
    from orchestrator import serve

    parser = argparse.ArgumentParser(prog="specdec serve", add_help=False)
    serve.add_arguments(parser)
    rows = []
    for action in parser._actions:
        help_text = re.sub(r"\s*\(default [^()]*\)$", "", action.help or "")
        default = "unset" if action.default in (None, "") else f"`{action.default}`"
        rows.append(f"| `{', '.join(action.option_strings)}` | {default} | {_cell(help_text)} |")
    return [
        "",
        "## `specdec serve`",
        "",
        "`specdec serve` runs the target worker, the draft worker and the orchestrator as supervised child",
        "processes until it is stopped (`orchestrator/serve.py`). Its own flags:",
        "",
        "| flag | default | description |",
        "|---|---|---|",
        *rows,
        "",
        "Every other flag must be one of the services' flags below, given as `--name VALUE` or",
        "`--name=VALUE`: an orchestrator flag goes to the orchestrator, a worker flag to both workers (a",
        "draft-only flag to the draft), `--log-level` to all three; a flag no service takes is refused.",
        f"The workers listen on free ports of 127.0.0.1. The draft gets `--draft-vocab {serve.DEFAULT_DRAFT_VOCAB}`",
        "unless one is given. Whether the workers share cores is theirs to find out, as when the services",
        "are started by hand (`--pass-lock auto`, `--prefill auto`, `--draft-ahead auto`).",
        "A child that exits is restarted after 1 s, doubling to 30 s (back to 1 s once it has run",
        "a minute); SIGINT or SIGTERM stops the orchestrator first, then the workers.",
    ]


def _env_section() -> list[str]:
    from specdec import envs

    def rows(reader):
        return [f"| `{v.name}` | {v.shown} | {_cell(v.help)} |" for v in envs.VARIABLES if v.reader == reader]

    return [
        "",
        "## Environment switches of the workers",
        "",
        "These have no flag (`specdec/envs.py` declares them); a worker reads them when it loads its",
        "model. The defaults are what production wants; the values shown turn a technique off, for",
        "comparisons.",
        "",
        "| variable | value | effect |",
        "|---|---|---|",
        *rows("worker"),
        "",
        "The client commands (`specdec generate`, `specdec workers`) read these where their flag is not given:",
        "",
        "| variable | value | effect |",
        "|---|---|---|",
        *rows("client"),
    ]


def render() -> str:
    """docs/configuration.md as the flag tables define it now."""
    from orchestrator.config import FLAGS as ORCHESTRATOR_FLAGS
    from specdec.worker.config import FLAGS as WORKER_FLAGS

    out = [
        "# Configuration reference",
        "",
        "<!-- Generated by scripts/gen_config_docs.py from the flag tables. Do not edit: change the flags",
        "     and run `.venv/bin/python scripts/gen_config_docs.py`. -->",
        "",
        "Generated by `scripts/gen_config_docs.py` from the services' flag tables",
        "(`orchestrator/config.py`, `specdec/worker/config.py`); a test fails when this page is stale.",
        "Every flag can also be set by its environment variable; a flag on the command line wins over",
        "its variable, which wins over the default. `--help` lists a service's flags with their",
        "variables.",
        "",
        "- [`specdec serve`](#specdec-serve)",
        "- [Orchestrator](#orchestrator)",
        "- [Workers](#workers)",
        "- [Environment switches of the workers](#environment-switches-of-the-workers)",
    ]
    out += _serve_section()
    out += _table_section("Orchestrator", ["`python -m orchestrator`: the client-facing gRPC service (and the "
                                           "OpenAI-compatible HTTP API with `--http-port`)."],
                          ORCHESTRATOR_FLAGS, ("orchestrator",))
    out += _table_section("Workers", ["`python -m target_service` and `python -m draft_service`: one flag table "
                                      "for both roles; `roles` says which role has a flag, and each role reads its "
                                      "own variable."],
                          WORKER_FLAGS, WORKER_ROLES)
    out += _env_section()
    return "\n".join(out) + "\n"


def check(doc: Path = DOC) -> list[str]:
    """What is wrong: empty when docs/configuration.md is what render() makes."""
    if not doc.exists() or doc.read_text() != render():
        return [f"{doc.relative_to(ROOT) if doc.is_relative_to(ROOT) else doc} is stale: "
                "run .venv/bin/python scripts/gen_config_docs.py"]
    return []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail if docs/configuration.md is stale; write nothing")
    args = parser.parse_args()
    if args.check:
        problems = check()
        if problems:
            print(*problems, sep="\n", file=sys.stderr)
            raise SystemExit(1)
        print("docs/configuration.md is up to date")
        return
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text(render())
    print(DOC.relative_to(ROOT))


if __name__ == "__main__":
    main()
