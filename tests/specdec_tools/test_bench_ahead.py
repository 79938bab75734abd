"""bench-ahead's pieces: the split stack's pinned commands and the summary's ratios."""

from __future__ import annotations

from specdec_tools.bench_ahead import format_table, summarize
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


def test_summary_ratios_are_against_each_sets_first_configuration():
    def rec(s, prompt, config, tokens, seconds, rounds):
        return {"set": s, "prompt": prompt, "config": config, "token_ids": tokens, "seconds": seconds,
                "stats": {"rounds": rounds, "drafted_tokens": rounds * 3}}

    records = [rec("fresh", 0, "base", [1, 2, 3, 4], 4.0, 4), rec("fresh", 0, "fast", [1, 2, 3, 4], 2.0, 1),
               rec("edit", 0, "base", [5, 6], 2.0, 2), rec("edit", 0, "fast", [5, 7], 0.5, 1)]
    rows = summarize(records, ["base", "fast"], greedy=True)
    by = {(r["set"], r["config"]): r for r in rows}
    assert by["fresh", "fast"]["vs_baseline"] == 2.0 and by["fresh", "fast"]["same_tokens"] == "1/1"
    assert by["edit", "fast"]["vs_baseline"] == 4.0 and by["edit", "fast"]["same_tokens"] == "0/1"
    assert by["fresh", "fast"]["tokens_per_round"] == 4.0 and by["fresh", "fast"]["drafts_per_round"] == 3.0
    assert format_table(rows).count("\n") == len(rows) + 1
