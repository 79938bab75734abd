"""Command-line flags defined once: name, type, default, help and environment variable.

Each service keeps one table of `Flag`s. Its argparse parser, its frozen config dataclass's
defaults and its `SPECDEC_<PREFIX>_<NAME>` environment variables all come from that table, so a
default is written in exactly one place and `--help` names the variable of every flag.
A flag given on the command line wins over its variable, which wins over the default.
Benchmarks and ablations keep their switches on their own side (specdec_tools/), not here.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence


@dataclass(frozen=True)
class Flag:
    name: str  # "--max-sessions"
    type: Callable[[str], Any] = str
    default: Any = None
    help: str = ""
    field: str | None = None  # the config field it fills; default: the name with dashes as underscores
    choices: Sequence[str] | None = None
    required: bool = False  # required unless its environment variable is set
    roles: Sequence[str] | None = None  # only these roles have the flag (None: every role)
    to_config: Callable[[Any], Any] | None = None  # parsed value -> config value (e.g. a choice -> bool)

    @property
    def key(self) -> str:
        return self.field or self.name.removeprefix("--").replace("-", "_")

    @property
    def env_suffix(self) -> str:
        return self.name.removeprefix("--").replace("-", "_").upper()


class FlagTable:
    def __init__(self, env_prefix: str, flags: Sequence[Flag], groups: Sequence[tuple[str, Sequence[str]]] = ()):
        """env_prefix: e.g. "SPECDEC_ORCHESTRATOR"; a worker table's "{role}" is filled per role.
        groups: (title, flag names) in the order `--help` and docs/configuration.md show them (as
        vLLM groups its engine arguments); every flag is in exactly one."""
        self.env_prefix = env_prefix
        self.flags = tuple(flags)
        self._by_key = {f.key: f for f in self.flags}
        self.groups = tuple((title, tuple(names)) for title, names in groups)
        if self.groups:
            placed = [name for _, names in self.groups for name in names]
            names = {f.name for f in self.flags}
            twice = {n for n in placed if placed.count(n) > 1}
            if set(placed) != names or twice:
                raise ValueError(f"{env_prefix}: flags in no group {sorted(names - set(placed))}, in a group but "
                                 f"no flag {sorted(set(placed) - names)}, in two groups {sorted(twice)}")

    def grouped(self, role: str = "") -> list[tuple[str, list[Flag]]]:
        """The role's flags by group, in order (one untitled group when the table has none)."""
        mine = {f.name: f for f in self.for_role(role)}
        if not self.groups:
            return [("", list(mine.values()))]
        return [(title, [mine[n] for n in names if n in mine]) for title, names in self.groups
                if any(n in mine for n in names)]

    def default(self, key: str) -> Any:
        """The config default of a field (the default converted the way a parsed value is)."""
        flag = self._by_key[key]
        return flag.to_config(flag.default) if flag.to_config else flag.default

    def env_name(self, flag: Flag, role: str = "") -> str:
        return f"{self.env_prefix.format(role=role.upper())}_{flag.env_suffix}"

    def for_role(self, role: str) -> list[Flag]:
        return [f for f in self.flags if f.roles is None or role in f.roles]

    def parser(self, prog: str, description: str, role: str = "") -> argparse.ArgumentParser:
        from specdec import __version__

        needed = " ".join(f"{f.name} {f.key.upper()}" for f in self.for_role(role) if f.required)
        p = argparse.ArgumentParser(prog=prog, description=description,
                                    usage=f"%(prog)s {needed + ' ' if needed else ''}[options]")
        p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
        sections = {}
        for title, flags in self.grouped(role):
            section = p.add_argument_group(title) if title else p
            sections.update((f.name, section) for f in flags)
        for flag in self.for_role(role):
            env = self.env_name(flag, role)
            value = os.environ.get(env)
            default = flag.type(value) if value is not None else flag.default
            shown = "" if flag.default is None else f"; default {flag.default}"
            text = f"{flag.help} (env {env}{shown})".lstrip()
            sections.get(flag.name, p).add_argument(
                flag.name, type=flag.type, default=default, choices=flag.choices,
                required=flag.required and value is None, dest=flag.key, help=text)
        return p

    def parse(self, argv: list[str] | None, prog: str, description: str, role: str = "") -> dict[str, Any]:
        """The config fields of this role, from argv over the environment over the defaults."""
        parsed = vars(self.parser(prog, description, role).parse_args(argv))
        return {f.key: f.to_config(parsed[f.key]) if f.to_config else parsed[f.key] for f in self.for_role(role)}


class ServedConfig:
    """What every server's config derives from its host, port and tls_* fields."""

    host: str
    port: int
    tls_cert: str | None
    tls_key: str | None
    tls_client_ca: str | None

    @property
    def tls(self):
        from specdec.security import ServerTls

        return ServerTls(self.tls_cert, self.tls_key, self.tls_client_ca)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def connection(self) -> list[tuple[str, int]]:
        from specdec.grpc_server import connection_options

        return connection_options(self.keepalive_s, self.max_connection_age_s, self.max_connection_age_grace_s)


def log_level_flag() -> Flag:
    return Flag("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                help="debug adds a line per forward pass (workers) and per gamma choice (orchestrator)")


def reflection_flag() -> Flag:
    return Flag("--reflection", default="on", choices=["on", "off"], to_config=lambda v: v == "on",
                help="gRPC server reflection (grpcurl's `list` and `describe`); off in production hides the API's shape")


def connection_flags() -> list[Flag]:
    """How long a server keeps a client's connection (specdec.grpc_server.connection_options)."""
    return [
        Flag("--keepalive", float, 60.0, "seconds between the server's pings of a connection; a peer that does not "
             "answer within 20 s is dropped, with its calls (0: off)", field="keepalive_s"),
        Flag("--max-connection-age", float, 1800.0, "seconds after which the server asks a client to reconnect "
             "(GOAWAY; calls in flight get --max-connection-age-grace more), so load spreads over new "
             "replicas (0: never)", field="max_connection_age_s"),
        Flag("--max-connection-age-grace", float, 600.0, "seconds calls in flight get after that GOAWAY",
             field="max_connection_age_grace_s"),
    ]


def tls_flags() -> list[Flag]:
    """The server-side TLS flags every service takes."""
    return [
        Flag("--tls-cert", help="serve TLS: PEM certificate chain"),
        Flag("--tls-key", help="serve TLS: PEM private key"),
        Flag("--tls-client-ca", help="mutual TLS: accept only clients whose certificate this PEM CA signed"),
    ]
