"""Every documented benchmark scenario (`specdec bench SCENARIO`) runs, on the tiny models, end to
end: a smoke run each, with the smallest settings, that checks it exits 0 and writes its results
(serve, coupling, anchor, timeline and train-head have tests of their own beside this file); the
old command names still run their scenario."""

from __future__ import annotations

import json

import pytest


def run(*argv: str) -> int:
    from orchestrator.cli import main

    return main(list(argv))


def test_bench_kernels(model_dirs, tmp_path):
    out = tmp_path / "kernels"
    assert run("bench", "kernels", "--model", str(model_dirs["target"]), "--modes", "fp16", "--reference", "none",
               "--repeats", "2", "--prompts", "1", "--new-tokens", "4", "--cached", "16", "--draft-vocab", "0",
               "--out", str(out)) == 0
    assert any(out.iterdir())


def test_bench_head(model_dirs, tmp_path):
    out = tmp_path / "head"
    assert run("bench", "head", "--target", str(model_dirs["target"]), "--modes", "none", "--sessions", "1",
               "--cached", "16", "--repeats", "2", "--rounds", "1", "--draft-vocab", "0", "--out", str(out)) == 0
    assert any(out.iterdir())


def test_bench_structured(model_dirs, tmp_path):
    out = tmp_path / "structured"
    assert run("bench", "structured", "--target", str(model_dirs["target"]), "--draft", str(model_dirs["draft"]),
               "--max-new-tokens", "8", "--out", str(out)) == 0
    assert json.loads((out / "results.json").read_text())


def test_bench_tracing(tmp_path, capsys):
    assert run("bench", "tracing", "--tiny", "--requests", "2", "--max-new-tokens", "8", "--repeats", "1") == 0
    assert capsys.readouterr().out


def test_bench_methods(model_dirs, tmp_path):
    out = tmp_path / "methods"
    assert run("bench", "methods", "--target", str(model_dirs["target"]), "--draft", str(model_dirs["draft"]),
               "--prompts", "1", "--max-new-tokens", "8", "--methods", "a,c", "--modes", "greedy", "--quantize", "none",
               "--draft-vocab", "0", "--sweep", "", "--out", str(out)) == 0
    assert any(out.iterdir())


@pytest.mark.timeout(300)
def test_loadtest(tmp_path):
    out = tmp_path / "loadtest"
    assert run("bench", "load", "--duration", "5", "--clients", "2", "--no-faults", "--prompts", "3",
               "--leak-wait", "3", "--out", str(out)) == 0
    assert any(out.iterdir())


def test_an_old_command_name_runs_its_scenario_and_names_the_new_form(model_dirs, tmp_path, capsys):
    out = tmp_path / "kernels"
    assert run("bench-kernels", "--model", str(model_dirs["target"]), "--modes", "fp16", "--reference", "none",
               "--repeats", "1", "--rows", "1", "--sessions", "1", "--cached", "16", "--draft-vocab", "0",
               "--out", str(out)) == 0
    assert (out / "table.md").is_file()
    assert "specdec bench-kernels is now `specdec bench kernels`" in capsys.readouterr().err


def test_the_old_names_map_to_the_scenarios(capsys):
    from specdec_tools.cli import COMMANDS, OLD_NAMES, SCENARIOS

    assert set(OLD_NAMES.values()) <= set(SCENARIOS) and set(OLD_NAMES) < set(COMMANDS)
    for old, scenario in {**OLD_NAMES, "bench": "methods"}.items():
        flags = ["--methods", "a", "--help"] if old == "bench" else ["--help"]
        with pytest.raises(SystemExit) as done:
            run(old, *flags)
        assert done.value.code == 0
        captured = capsys.readouterr()
        assert f"usage: specdec bench {scenario} " in captured.out and f"`specdec bench {scenario}" in captured.err
    with pytest.raises(SystemExit):
        run("bench", "--help")
    listed = capsys.readouterr().out
    assert all(name in listed for name in SCENARIOS)
