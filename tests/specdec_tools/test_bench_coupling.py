"""specdec_tools.bench_coupling on tiny random models: acceptance per position on the same
contexts, the target's greedy answer or (--contexts sampled) an answer it samples under each
setting."""

from __future__ import annotations

import csv

import pytest


@pytest.mark.parametrize("contexts", ["greedy", "sampled"])
def test_bench_coupling_measures_every_position_of_its_contexts(model_dirs, tmp_path, capsys, contexts):
    from orchestrator.cli import main
    from specdec_tools.bench_coupling import SETTINGS

    out = tmp_path / contexts
    assert main(["bench", "coupling", "--target", str(model_dirs["target"]), "--draft", str(model_dirs["draft"]),
                 "--prompts", "2", "--max-new-tokens", "6", "--seeds", "20", "--quantize", "none",
                 "--draft-vocab", "0", "--contexts", contexts, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    with open(out / "positions.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["setting"] for r in rows} == set(SETTINGS)
    for r in rows:
        rejection, coupled, bound = float(r["rejection"]), float(r["coupled"]), float(r["bound"])
        assert 0 <= bound <= rejection <= 1 and 0 <= coupled <= 1, r
    # every position of each prompt's answer, under each setting (an answer may end at EOS early)
    for setting in SETTINGS:
        positions = [(r["prompt"], r["position"]) for r in rows if r["setting"] == setting]
        assert 0 < len(positions) <= 2 * 6 and len(set(positions)) == len(positions)
    answers = "tokens the target samples, one per setting" if contexts == "sampled" else "greedy answer"
    assert answers in (out / "table.md").read_text() and "| T 1.0 |" in printed
