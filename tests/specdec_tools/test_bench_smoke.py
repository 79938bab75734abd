"""Every documented benchmark command runs, on the tiny models, end to end: a smoke run each, with
the smallest settings, that checks it exits 0 and writes its results (bench-serve, bench-coupling,
bench-anchor, timeline and train-head have tests of their own beside this file)."""

from __future__ import annotations

import json

import pytest


def run(*argv: str) -> int:
    from orchestrator.cli import main

    return main(list(argv))


def test_bench_kernels(model_dirs, tmp_path):
    out = tmp_path / "kernels"
    assert run("bench-kernels", "--model", str(model_dirs["target"]), "--modes", "fp16", "--reference", "none",
               "--repeats", "2", "--prompts", "1", "--new-tokens", "4", "--cached", "16", "--draft-vocab", "0",
               "--out", str(out)) == 0
    assert any(out.iterdir())


def test_bench_head(model_dirs, tmp_path):
    out = tmp_path / "head"
    assert run("bench-head", "--target", str(model_dirs["target"]), "--modes", "none", "--sessions", "1",
               "--cached", "16", "--repeats", "2", "--rounds", "1", "--draft-vocab", "0", "--out", str(out)) == 0
    assert any(out.iterdir())


def test_bench_structured(model_dirs, tmp_path):
    out = tmp_path / "structured"
    assert run("bench-structured", "--target", str(model_dirs["target"]), "--draft", str(model_dirs["draft"]),
               "--max-new-tokens", "8", "--out", str(out)) == 0
    assert json.loads((out / "results.json").read_text())


def test_bench_tracing(tmp_path, capsys):
    assert run("bench-tracing", "--tiny", "--requests", "2", "--max-new-tokens", "8", "--repeats", "1") == 0
    assert capsys.readouterr().out


def test_bench(model_dirs, tmp_path):
    out = tmp_path / "bench"
    assert run("bench", "--target", str(model_dirs["target"]), "--draft", str(model_dirs["draft"]), "--prompts", "1",
               "--max-new-tokens", "8", "--methods", "a,c", "--modes", "greedy", "--quantize", "none",
               "--draft-vocab", "0", "--sweep", "", "--out", str(out)) == 0
    assert any(out.iterdir())


@pytest.mark.timeout(300)
def test_loadtest(tmp_path):
    out = tmp_path / "loadtest"
    assert run("loadtest", "--duration", "10", "--clients", "2", "--no-faults", "--prompts", "3",
               "--leak-wait", "3", "--out", str(out)) == 0
    assert any(out.iterdir())
