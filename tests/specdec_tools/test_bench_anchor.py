"""specdec_tools.bench_anchor without llama-server: its arguments, llama-server's command and
answers, and the summary and agreement as pure functions on fixed inputs."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from specdec_tools import bench_anchor as ba
from specdec_tools.bench_anchor import CONCURRENT, SEQUENTIAL, Output, Run


@pytest.fixture
def fake_server(tmp_path):
    path = tmp_path / "llama-server"
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def parse(argv):
    p = argparse.ArgumentParser(prog="specdec bench anchor")
    ba.add_arguments(p)
    return p.parse_args(argv)


def test_arguments_and_defaults(fake_server):
    a = parse(["--llama-server", str(fake_server)])
    assert a.llama_server == str(fake_server.resolve())
    assert (a.max_new_tokens, a.prompts, a.concurrency, a.spec_n_max) == (48, 4, 4, 8)
    assert a.threads == os.cpu_count() and a.out == ba.DEFAULT_OUT
    assert a.target_gguf is None and a.draft_gguf is None
    a = parse(["--llama-server", str(fake_server), "--threads", "1", "--max-new-tokens", "128",
               "--target-gguf", "/t.gguf", "--draft-gguf", "/d.gguf"])
    assert (a.threads, a.max_new_tokens, a.target_gguf, a.draft_gguf) == (1, 128, "/t.gguf", "/d.gguf")


@pytest.mark.parametrize("argv", [[], ["--llama-server", "/no/such/llama-server"]])
def test_a_missing_llama_server_is_a_clear_error(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        parse(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--llama-server" in err
    if argv:
        assert "does not exist" in err and "build llama-server first" in err


def test_a_file_that_is_not_executable_is_refused(tmp_path, capsys):
    path = tmp_path / "llama-server"
    path.write_text("")
    with pytest.raises(SystemExit):
        parse(["--llama-server", str(path)])
    assert "not executable" in capsys.readouterr().err


def test_llama_command_with_and_without_the_draft(fake_server):
    a = parse(["--llama-server", str(fake_server), "--threads", "2"])
    alone = ba.llama_command(a, "/t.gguf", None, 8081)
    assert alone[:3] == [a.llama_server, "-m", "/t.gguf"]
    assert alone[alone.index("-t") + 1] == "2" and alone[alone.index("--parallel") + 1] == "4"
    assert "-md" not in alone and "--spec-type" not in alone
    spec = ba.llama_command(a, "/t.gguf", "/d.gguf", 8081)
    assert spec[spec.index("-md") + 1] == "/d.gguf"
    assert spec[spec.index("--spec-type") + 1] == "draft-simple"  # -md alone loads the draft and never uses it
    assert spec[spec.index("--spec-draft-n-max") + 1] == "8"


def test_parse_completion_reads_tokens_and_drafts():
    body = {"content": "def f", "tokens": [1, 2, 3], "tokens_predicted": 3,
            "timings": {"predicted_n": 3, "draft_n": 8, "draft_n_accepted": 5}}
    out = ba.parse_completion(body, prompt=2, seconds=0.5)
    assert (out.prompt, out.token_ids, out.text, out.drafted, out.accepted) == (2, [1, 2, 3], "def f", 8, 5)
    plain = ba.parse_completion({"content": "x", "tokens": [7], "timings": {"predicted_n": 1}}, 0, 0.1)
    assert (plain.drafted, plain.accepted) == (0, 0)
    with pytest.raises(ValueError, match="return_tokens"):
        ba.parse_completion({"content": "x", "tokens": [], "tokens_predicted": 4}, 0, 0.1)


def test_common_prefix():
    assert ba.common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert ba.common_prefix([1, 2], [1, 2, 3]) == 2
    assert ba.common_prefix([], [1]) == 0
    assert ba.common_prefix([5], [6]) == 0


def _runs():
    def outs(seqs, drafted=0, accepted=0):
        return [Output(i, list(s), 1.0, drafted=drafted, accepted=accepted) for i, s in enumerate(seqs)]

    anchor, ours = [[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 9, 9], [5, 6, 7, 8]]
    return [
        Run("llama", SEQUENTIAL, 4.0, outs(anchor)),  # 8 tokens / 4 s = 2 tok/s
        Run("llama", CONCURRENT, 2.0, outs([[1, 2, 3, 4], [5, 6, 0, 0]])),  # 4 tok/s; prompt 1 differs
        Run("llama-draft", SEQUENTIAL, 8.0, outs(anchor, drafted=8, accepted=4)),
        Run("llama-draft", CONCURRENT, 4.0, outs(anchor, drafted=8, accepted=2)),
        Run("ours", SEQUENTIAL, 2.0, outs(ours, drafted=4, accepted=3)),  # 4 tok/s
        Run("ours", CONCURRENT, 1.0, outs(ours, drafted=4, accepted=3)),  # 8 tok/s
        Run("ours-g0", SEQUENTIAL, 4.0, outs([[1, 2, 9, 9], [5, 6, 7, 0]])),
        Run("ours-g0", CONCURRENT, 2.0, outs([[1, 2, 9, 9], [5, 6, 7, 0]])),
    ]


def test_summary_ratios_are_against_llama_target_alone_in_each_column():
    rows = {r["row"]: r for r in ba.summarize(_runs())}
    assert list(rows) == ["llama", "llama-draft", "ours", "ours-g0"]
    assert rows["llama"]["one_tok_s"] == 2.0 and rows["llama"]["all_tok_s"] == 4.0
    assert rows["llama"]["one_vs_anchor"] == 1.0 and rows["llama"]["acceptance"] is None
    assert rows["llama"]["concurrent_same_as_sequential"] == "1/2"
    assert rows["llama-draft"]["one_vs_anchor"] == 0.5 and rows["llama-draft"]["acceptance"] == 0.375  # 12 / 32
    assert rows["ours"]["one_vs_anchor"] == 2.0 and rows["ours"]["all_vs_anchor"] == 2.0
    assert rows["ours"]["acceptance"] == 0.75 and rows["ours"]["concurrent_same_as_sequential"] == "2/2"
    table = ba.format_table(list(rows.values()), 4)
    assert table.count("\n") == len(rows) + 1 and "| 2.00x |" in table and "4 at once" in table
    assert "| 0.375 (12/32) |" in table and "| 0.750 (12/16) |" in table
    off = ba.summarize([Run("ours", SEQUENTIAL, 1.0, [Output(0, [1], 1.0, gamma=0.0)])])
    assert ba._drafts(off[0]) == "none drafted" and off[0]["one_mean_gamma"] == 0.0  # the policy kept drafting off


def test_agreement_per_prompt():
    rows = ba.agreement(_runs())
    assert [r["prompt"] for r in rows] == [0, 1]
    assert rows[0]["shared_prefix"] == 2 and rows[0]["identical"] is False
    assert rows[1]["shared_prefix"] == 4 and rows[1]["identical"] is True
    assert rows[0]["ours_equals_gamma0"] is True and rows[1]["ours_equals_gamma0"] is False
    assert rows[1]["ours_gamma0_shared_prefix"] == 3
    assert rows[0]["anchor_draft_equals_anchor"] is True and rows[1]["anchor_draft_equals_anchor"] is True
    table = ba.format_agreement(rows)
    assert "| 0 | 4 / 4 | 2 | no | yes | yes |" in table and "| 1 | 4 / 4 | 4 | yes | no | yes |" in table


def test_source_gguf_follows_the_model_stores_record(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(12))
    converted = tmp_path / "converted"
    converted.mkdir()
    (converted / "source.json").write_text(json.dumps({"source_gguf": str(gguf), "source_size": 16}))
    assert ba.source_gguf(str(converted)) == str(gguf)
    gguf.write_bytes(b"GGUF")  # changed since the conversion
    with pytest.raises(FileNotFoundError, match="--target-gguf"):
        ba.source_gguf(str(converted))
    with pytest.raises(FileNotFoundError, match="source.json"):
        ba.source_gguf(str(tmp_path))


def test_other_llama_builds_are_labelled_rows(fake_server, capsys):
    a = parse(["--llama-server", str(fake_server), "--also-llama-server", f"avx512={fake_server}"])
    assert a.also_llama_server == [("avx512", str(fake_server.resolve()))]
    assert ba.llama_command(a, "/t.gguf", None, 9, a.also_llama_server[0][1])[0] == str(fake_server.resolve())
    for bad in ("nolabel", f"a b={fake_server}", "x=/no/such/llama-server"):
        with pytest.raises(SystemExit):
            parse(["--llama-server", str(fake_server), "--also-llama-server", bad])
    runs = [Run("llama", SEQUENTIAL, 1.0, [Output(0, [1, 2], 1.0)]), Run("llama-avx512", SEQUENTIAL, 1.0,
                                                                         [Output(0, [1, 2, 3, 4], 1.0)])]
    rows = ba.summarize(runs, titles={"llama-avx512": "llama.cpp server (avx512 build), target alone"})
    assert rows[1]["title"] == "llama.cpp server (avx512 build), target alone" and rows[1]["one_vs_anchor"] == 2.0
    assert rows[0]["title"] == ba.ROWS["llama"]
