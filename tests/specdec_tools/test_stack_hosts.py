"""The benchmark stacks as two hosts on one machine (specdec bench serve --hosts): each worker pinned."""

from __future__ import annotations

from specdec_tools.stack import ProcessStack


def test_split_stack_pins_each_worker_and_drops_the_pass_lock():
    stack = ProcessStack("/t", "/d", cores={"target": "0", "draft": "1-2"})
    second = stack.add_orchestrator("--draft-ahead", "4")
    argv = {cmd[0]: stack._argv(cmd) for cmd in stack.commands[:3]}
    target_argv, target_env = argv["target_service"]
    assert target_argv[:3] == ["taskset", "-c", "0"] and target_env["OMP_NUM_THREADS"] == "1"
    assert argv["draft_service"][0][:3] == ["taskset", "-c", "1-2"] and argv["draft_service"][1]["OMP_NUM_THREADS"] == "2"
    assert argv["orchestrator"][0][0] != "taskset"  # the orchestrator is not pinned
    assert "--pass-lock" not in " ".join(" ".join(c) for c in stack.commands)  # auto: their CPUs do not overlap
    extra = stack.commands[3]
    assert extra[:2] == ["orchestrator", "--host"] and extra[-2:] == ["--draft-ahead", "4"]
    assert second.endswith(extra[4]) and "--target" in extra and "--draft" in extra


def test_shared_stack_runs_unpinned():
    stack = ProcessStack("/t", "/d")
    assert all(stack._argv(cmd)[0][0] != "taskset" for cmd in stack.commands)


def test_bench_serve_hosts_pins_the_orchestrator_beside_the_draft():
    import argparse

    import pytest

    from specdec_tools.bench_serve import busy_shares, parse_hosts

    assert parse_hosts("one") is None
    assert parse_hosts("0/1") == {"target": "0", "draft": "1", "orchestrator": "1"}
    for bad in ("0", "a/b", "0/"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_hosts(bad)
    # CPU seconds over wall seconds and the host's CPUs
    assert busy_shares({"target": 5.0, "draft": 3.0}, 10.0, {"target": "0", "draft": "1-2"}) == \
        {"busy_target": 0.5, "busy_draft": 0.15}
    assert busy_shares({"target": 5.0}, 10.0, None) == {}
