"""specdec.flags: each flag is defined once, and argparse, config defaults and SPECDEC_* come from it."""

from __future__ import annotations

import contextlib
import io
import os
from dataclasses import fields
from unittest import mock

import pytest

from orchestrator.config import FLAGS as ORCHESTRATOR_FLAGS
from orchestrator.config import OrchestratorConfig
from specdec.worker.config import FLAGS as WORKER_FLAGS
from specdec.worker.config import WorkerConfig

REQUIRED = {"--model": "m", "--target": "t:1"}
SAMPLE = {int: "7", float: "2.5", str: "x"}  # a value of each type that no default has


def _parse(role: str, argv: list[str], env: dict) -> object:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SPECDEC_")}
    with mock.patch.dict(os.environ, {**clean, **env}, clear=True):
        if role == "orchestrator":
            return OrchestratorConfig.from_args(argv)
        return WorkerConfig.from_args(role, argv, default_port=5)


def _cases() -> list:
    return [pytest.param(role, table, flag, id=f"{role}{flag.name}")
            for role, table in (("target", WORKER_FLAGS), ("draft", WORKER_FLAGS), ("orchestrator", ORCHESTRATOR_FLAGS))
            for flag in table.for_role(role)]


def _value_for(flag) -> str:
    """A value the flag accepts that differs from its default."""
    if flag.choices:
        return next(c for c in flag.choices if c != flag.default)
    if flag.name in ("--target", "--draft"):
        return "host:9"
    if flag.name == "--draft-p-min":  # a probability
        return "0.5"
    if flag.name == "--draft-ahead":  # auto or a count
        return "3"
    return SAMPLE[flag.type]


@pytest.mark.parametrize("role,table,flag", _cases())
def test_every_flag_has_a_variable_that_changes_the_config(role, table, flag):
    others = [a for f in table.for_role(role) if f.required and f is not flag for a in (f.name, REQUIRED[f.name])]
    env, value = table.env_name(flag, role), _value_for(flag)
    from_env = _parse(role, others, {env: value})
    if not flag.required:
        assert getattr(from_env, flag.key) != getattr(_parse(role, others, {}), flag.key), f"{env} is ignored"
    from_argv = _parse(role, [*others, flag.name, value], {})
    assert getattr(from_env, flag.key) == getattr(from_argv, flag.key)
    # the command line wins over the variable
    assert getattr(_parse(role, [*others, flag.name, value], {env: "1" if flag.type is not str else "y"}),
                   flag.key) == getattr(from_argv, flag.key)


@pytest.mark.parametrize("role,table", [("target", WORKER_FLAGS), ("draft", WORKER_FLAGS),
                                        ("orchestrator", ORCHESTRATOR_FLAGS)])
def test_help_names_each_variable_and_defaults_match_the_config(role, table):
    out = io.StringIO()
    parser = table.parser("prog", "description", role)
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    text = " ".join(out.getvalue().split()).replace("- ", "-")
    for flag in table.for_role(role):
        assert table.env_name(flag, role) in text and f"{flag.name} " in text
    config = OrchestratorConfig if role == "orchestrator" else WorkerConfig
    for f in fields(config):
        if f.name in {flag.key for flag in table.flags} and f.name not in ("port", "target", "model"):
            assert f.default == table.default(f.name), f.name


def test_draft_only_flag_is_refused_by_the_target():
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
        _parse("target", ["--model", "m", "--draft-vocab", "5"], {})
    assert _parse("draft", ["--model", "m", "--draft-vocab", "5"], {}).draft_vocab == 5


def test_port_defaults_to_the_role_port_and_zero_means_any():
    assert _parse("target", ["--model", "m"], {}).port == 5
    assert _parse("target", ["--model", "m", "--port", "0"], {}).port == 0
    assert _parse("orchestrator", ["--target", "t:1"], {}).port == 50050


def test_connection_flags_become_grpc_server_options():
    from orchestrator.config import OrchestratorConfig

    config = OrchestratorConfig.from_args(["--target", "t:1", "--keepalive", "30", "--max-connection-age", "600",
                                           "--max-connection-age-grace", "60"])
    options = dict(config.connection)
    assert options["grpc.keepalive_time_ms"] == 30_000 and options["grpc.keepalive_timeout_ms"] == 20_000
    assert options["grpc.max_connection_age_ms"] == 600_000 and options["grpc.max_connection_age_grace_ms"] == 60_000
    off = dict(OrchestratorConfig.from_args(["--target", "t:1", "--keepalive", "0", "--max-connection-age", "0"])
               .connection)
    assert "grpc.keepalive_time_ms" not in off and "grpc.max_connection_age_ms" not in off
    # the orchestrator pings its workers every 2 s: every server accepts pings that often, either way
    assert off["grpc.http2.min_recv_ping_interval_without_data_ms"] <= 1000
    assert off["grpc.keepalive_permit_without_calls"] == 1 and off["grpc.http2.max_ping_strikes"] == 0
    default = dict(OrchestratorConfig(target="t:1").connection)
    assert default["grpc.keepalive_time_ms"] == 60_000 and default["grpc.max_connection_age_ms"] == 1_800_000


def test_help_shows_the_flags_by_group_and_every_flag_has_one():
    from specdec.flags import Flag, FlagTable

    text = ORCHESTRATOR_FLAGS.parser("python -m orchestrator", "").format_help()
    positions = [text.index(f"\n{title}:\n") for title, _ in ORCHESTRATOR_FLAGS.groups]
    assert positions == sorted(positions), "the groups in their table's order"
    timeouts = text[text.index("\ntimeouts and failover:\n"):]
    assert timeouts.index("--worker-keepalive") < timeouts.index("\n\n", 2)
    assert text.startswith("usage: python -m orchestrator --target TARGET [options]")
    with pytest.raises(ValueError, match="in no group .'--b'"):
        FlagTable("X", [Flag("--a"), Flag("--b")], groups=[("one", ["--a"])])
