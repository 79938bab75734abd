"""specdec_tools.bench_serve: the per-level statistics (percentiles, aggregate, ratios, the
identical-output check) as pure functions, and one smoke run of `specdec bench serve --tiny`
through the three real services, concurrency 1 and 2, both modes."""

from __future__ import annotations

import argparse
import csv
import json
import os

import numpy as np
import pytest

from specdec_tools import bench_serve as bs
from specdec_tools.bench_serve import RequestRecord


@pytest.fixture(scope="module", autouse=True)
def reused_stacks(tmp_path_factory):
    """The smoke runs below that ask for the same stack share one (tests/support/stacks.py)."""
    from tests.support.stacks import ReusedStacks

    stacks = ReusedStacks(tmp_path_factory.mktemp("stacks"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("specdec_tools.stack.ProcessStack", stacks)
        yield stacks
    stacks.stop_all()


def rec(mode="on", c=1, request=0, prompt=0, latency=1.0, ttft=0.1, tokens=10, drafted=0, accepted=0, gamma=None,
        ids=(), error=""):
    return RequestRecord(mode, c, request, prompt, 0, 0.0, latency, ttft, tokens, tokens / latency,
                         drafted_tokens=drafted, accepted_tokens=accepted, gamma=gamma, error=error,
                         token_ids=list(ids))


@pytest.mark.parametrize("values", [[3.0], [1.0, 2.0], [5.0, 1.0, 4.0, 2.0, 3.0], list(np.linspace(0, 1, 37) ** 2)])
@pytest.mark.parametrize("q", [0, 50, 95, 100])
def test_percentile_matches_numpy(values, q):
    assert bs.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_of_nothing_is_none():
    assert bs.percentile([], 50) is None


def test_summarize_level():
    records = [
        rec(request=0, latency=1.0, ttft=0.1, tokens=10, drafted=8, accepted=6, gamma=4),
        rec(request=1, latency=2.0, ttft=0.3, tokens=20, drafted=12, accepted=3, gamma=4),
        rec(request=2, latency=4.0, ttft=0.2, tokens=40, drafted=0, accepted=0, gamma=2),
        rec(request=3, latency=9.0, ttft=None, tokens=0, error="UNAVAILABLE: gone"),  # not counted
    ]
    row = bs.summarize_level(records, wall_s=5.0)
    assert row["requests"] == 4 and row["errors"] == 1
    assert row["generated_tokens"] == 70
    assert row["aggregate_tok_s"] == pytest.approx(14.0)  # 70 tokens / 5 s of wall time
    assert row["mean_request_tok_s"] == pytest.approx(10.0)  # every request ran at 10 tok/s
    assert row["latency_p50_s"] == pytest.approx(2.0)
    assert row["latency_p95_s"] == pytest.approx(float(np.percentile([1.0, 2.0, 4.0], 95)), abs=1e-4)
    assert row["ttft_p50_s"] == pytest.approx(0.2)
    assert row["ttft_p95_s"] == pytest.approx(float(np.percentile([0.1, 0.3, 0.2], 95)), abs=1e-4)
    assert row["acceptance_rate"] == pytest.approx(9 / 20, abs=1e-4)  # sum accepted / sum drafted
    assert row["mean_gamma"] == pytest.approx(10 / 3, abs=1e-3)


def test_summarize_level_without_drafts_or_successes():
    row = bs.summarize_level([rec(mode="off", gamma=0)], wall_s=2.0)
    assert row["acceptance_rate"] is None and row["mean_gamma"] == 0
    row = bs.summarize_level([rec(error="DEADLINE_EXCEEDED: late")], wall_s=2.0)
    assert row["errors"] == 1 and row["aggregate_tok_s"] == 0 and row["latency_p95_s"] is None
    assert row["mean_request_tok_s"] is None


def test_a_rounds_time_splits_into_calls_passes_orchestrator_and_client():
    records = [rec(latency=1.0, tokens=30), rec(request=1, latency=0.5, tokens=10)]
    for r, (rounds, total, prefill, draft, dpass, verify, vpass) in zip(records, [
            (10, 0.9, 0.1, 0.3, 0.2, 0.4, 0.3), (10, 0.45, 0.05, 0.15, 0.1, 0.2, 0.15)]):
        r.rounds, r.server_total_s, r.server_prefill_s = rounds, total, prefill
        r.server_draft_s, r.server_draft_compute_s, r.server_verify_s, r.server_verify_compute_s = draft, dpass, verify, vpass
    split = bs.summarize_level(records, wall_s=1.0)
    assert split["split_tokens"] == 2.0  # 40 tokens in 20 rounds
    assert split["split_draft_ms"] == pytest.approx(22.5) and split["split_draft_pass_ms"] == pytest.approx(15.0)
    assert split["split_verify_ms"] == pytest.approx(30.0) and split["split_verify_pass_ms"] == pytest.approx(22.5)
    assert split["split_orchestrator_ms"] == pytest.approx(7.5)  # (0.1 + 0.05) s beside prefill and calls
    assert split["split_client_ms"] == pytest.approx(7.5)  # latency past the server's total
    assert split["split_round_ms"] == pytest.approx(67.5)  # the round; the prefill's 7.5 ms a round left out
    table = bs.format_split([{"mode": "on", "concurrency": 1, **split}])
    assert table.splitlines()[2].startswith("| on | 1 | 2.00 | 22.50 | 15.00 |")
    assert "split_tokens" not in bs.summarize_level([rec(mode="off")], wall_s=1.0)  # no rounds: no split


def test_add_ratios():
    rows = [{"mode": m, "concurrency": c, "aggregate_tok_s": v}
            for m, c, v in [("on", 1, 10.0), ("on", 4, 30.0), ("off", 1, 8.0), ("off", 4, 20.0), ("gamma2", 4, 25.0)]]
    by = {(r["mode"], r["concurrency"]): r for r in bs.add_ratios(rows)}
    assert by["on", 1]["vs_c1"] == 1.0 and by["on", 4]["vs_c1"] == 3.0
    assert by["off", 4]["vs_c1"] == 2.5
    assert by["on", 1]["vs_off"] == 1.25 and by["on", 4]["vs_off"] == 1.5
    assert by["off", 1]["vs_off"] is None
    assert by["gamma2", 4]["vs_c1"] is None  # no concurrency-1 row for that mode
    assert by["gamma2", 4]["vs_off"] == 1.25


def test_compare_outputs():
    records = [
        rec("on", 1, 0, prompt=0, ids=[1, 2, 3]),
        rec("on", 1, 1, prompt=1, ids=[4, 5]),
        rec("on", 1, 2, prompt=0, ids=[9, 9, 9]),  # a second c=1 run of prompt 0: the first is the reference
        rec("off", 1, 0, prompt=0, ids=[7, 7]),
        rec("on", 2, 0, prompt=0, ids=[1, 2, 3]),
        rec("on", 2, 1, prompt=1, ids=[4, 6]),  # differs
        rec("on", 2, 2, prompt=2, ids=[1]),  # no c=1 output of prompt 2
        rec("off", 2, 0, prompt=0, ids=[1, 2, 3]),  # compared with off's reference, not on's: differs
        rec("on", 4, 0, prompt=0, ids=[], error="UNAVAILABLE: x"),  # failed: not compared
    ]
    result = bs.compare_outputs(records)
    assert result["checked"] == 3 and result["unchecked"] == 1
    assert result["differ"] == [{"mode": "on", "concurrency": 2, "request": 1, "prompt": 1},
                                {"mode": "off", "concurrency": 2, "request": 0, "prompt": 0}]
    assert [r.same_as_c1 for r in records] == [None, None, None, None, True, False, None, False, None]
    assert bs.level_differences(records, "on", 2) == "1/2"
    assert bs.level_differences(records, "off", 2) == "1/1"
    assert bs.level_differences(records, "on", 1) == ""


def test_parsers():
    assert bs.parse_modes("on,off") == [bs.Mode("on", None), bs.Mode("off", 0)]
    # a mode named twice runs twice: the ratio of identical modes is the run's noise
    assert bs.parse_modes("off, 3, 0") == [bs.Mode("off", 0), bs.Mode("gamma3", 3), bs.Mode("off-again", 0)]
    with pytest.raises(argparse.ArgumentTypeError):
        bs.parse_modes("fast")
    assert bs.parse_levels("16,1,4,4") == [1, 4, 16]
    with pytest.raises(argparse.ArgumentTypeError):
        bs.parse_levels("0,2")
    assert bs.parse_prompts("3", 10) == [0, 1, 2]
    assert bs.parse_prompts("5,", 10) == [5]
    with pytest.raises(argparse.ArgumentTypeError):
        bs.parse_prompts("2,10", 10)
    assert bs.requests_for_level(1, None) == 8 and bs.requests_for_level(16, None) == 32
    assert bs.requests_for_level(16, 3) == 3


def test_format_table():
    row = {"mode": "on", "concurrency": 2, "requests": 4, "aggregate_tok_s": 12.345, "vs_c1": 1.5, "vs_off": None,
           "mean_request_tok_s": 6.0, "ttft_p50_s": 0.1, "ttft_p95_s": 0.2, "latency_p50_s": 1.0,
           "latency_p95_s": 2.0, "acceptance_rate": 0.75, "mean_gamma": 4.0, "outputs_differ": "0/4", "errors": 0}
    lines = bs.format_table([row]).splitlines()
    assert len(lines) == 3 and lines[0].count("|") == lines[1].count("|") == lines[2].count("|")
    assert "| on | 2 | 4 | 12.35 | 1.50x |  | 6.00 |" in lines[2] and "| 0/4 | 0 |" in lines[2]


def test_smoke_tiny_stack(tmp_path, capsys):
    """The real services on loopback, tiny models: both modes, concurrency 1 and 2."""
    from orchestrator.cli import main

    out = tmp_path / "serve"
    rc = main(["bench", "serve", "--tiny", "--concurrency", "1,2", "--requests-per-level", "2", "--max-new-tokens", "4",
               "--out", str(out), "--startup-timeout", "240"])
    printed = capsys.readouterr().out
    for name in ("runs.csv", "summary.csv", "summary.json", "table.md", "serve.png"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "serve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "summary.json").read_text())
    assert {(r["mode"], r["concurrency"]) for r in summary["levels"]} == {("on", 1), ("on", 2), ("off", 1), ("off", 2)}
    assert all(r["errors"] == 0 and r["generated_tokens"] > 0 for r in summary["levels"])
    assert summary["machine"]["cpu_count"] and summary["models"]["draft_vocab"] == 0
    assert summary["outputs"]["checked"] == 4  # 2 requests x 2 modes at concurrency 2
    with open(out / "runs.csv") as f:
        runs = list(csv.DictReader(f))
    assert len(runs) == 8 and all(float(r["ttft_s"]) <= float(r["latency_s"]) for r in runs)
    assert "| on | 1 | 2 |" in printed and "| off | 2 | 2 |" in printed
    # batching across sessions must not change a greedy output
    assert summary["outputs"]["identical"], summary["outputs"]["differ"]
    assert rc == 0


def test_a_full_warm_up_runs_each_level_once_untimed(tmp_path, capsys, monkeypatch):
    """--warm-up full: every mode's level runs whole once before its timed run; only the timed one is recorded."""
    from specdec_tools import bench_serve
    from orchestrator.cli import main

    runs = []
    real = bench_serve.run_level

    def counted(address, mode, level, prompt_ids, a, log, api="grpc"):
        runs.append((mode.name, level, a.max_new_tokens, a.requests_per_level))
        return real(address, mode, level, prompt_ids, a, log, api)

    monkeypatch.setattr(bench_serve, "run_level", counted)
    out = tmp_path / "serve"
    assert main(["bench", "serve", "--tiny", "--concurrency", "2", "--requests-per-level", "2", "--max-new-tokens", "4",
                 "--warm-up", "full", "--out", str(out), "--startup-timeout", "240"]) == 0
    assert sorted(runs) == sorted([("on", 2, 4, 2), ("off", 2, 4, 2)] * 2)  # each whole, twice
    with open(out / "runs.csv") as f:
        assert len(list(csv.DictReader(f))) == 4  # 2 requests x 2 modes: the warm-up runs are not records
    capsys.readouterr()


def test_rounds_alternate_the_modes_and_pair_their_ratios(tmp_path, capsys, monkeypatch):
    """--rounds 3: each level runs its modes three times, first and last in turn (a drifting machine
    weighs on both alike); a row sums its rounds, and each round's ratio pairs with the off mode's same round."""
    from specdec_tools import bench_serve
    from orchestrator.cli import main

    runs = []
    real = bench_serve.run_level

    def counted(address, mode, level, prompt_ids, a, log, api="grpc"):
        runs.append((level, mode.name))
        return real(address, mode, level, prompt_ids, a, log, api)

    monkeypatch.setattr(bench_serve, "run_level", counted)
    out = tmp_path / "serve"
    assert main(["bench", "serve", "--tiny", "--concurrency", "1,2", "--requests-per-level", "2",
                 "--max-new-tokens", "3", "--rounds", "3", "--out", str(out), "--startup-timeout", "240"]) == 0
    assert runs == [(1, "on"), (1, "off"), (1, "off"), (1, "on"), (1, "on"), (1, "off"),
                    (2, "off"), (2, "on"), (2, "on"), (2, "off"), (2, "off"), (2, "on")]
    summary = json.loads((out / "summary.json").read_text())
    for row in summary["levels"]:
        assert row["requests"] == 6 and len(row["round_tok_s"]) == 3
        if row["mode"] == "on":
            assert row["vs_off_rounds"]["ratios"] == [round(m / o, 3) for m, o in zip(
                row["round_tok_s"], next(r for r in summary["levels"] if (r["mode"], r["concurrency"]) == (
                    "off", row["concurrency"]))["round_tok_s"])]
        else:
            assert row["vs_off_rounds"] is None
    with open(out / "runs.csv") as f:
        assert sorted(int(r["round"]) for r in csv.DictReader(f)) == [0] * 8 + [1] * 8 + [2] * 8
    assert "vs off by round" in capsys.readouterr().out


def test_a_similar_batch_asks_for_another_name_every_request(tmp_path, capsys, monkeypatch):
    """--prompt-set similar: the four kinds of code, each request of the run for another name (the
    warm-up's included), so suffix drafts can only come from similar requests, never identical ones."""
    from specdec_tools import bench_serve
    from specdec_tools.bench import SIMILAR, fill_similar, similar_names
    from orchestrator.cli import main

    names = similar_names()
    first = [next(names) for _ in range(40)]
    assert len(set(first)) == 40 and first[0] == "invoice" and first[16] == "invoice_2"
    assert fill_similar(SIMILAR[0], "voucher_2").startswith("Write a Python dataclass named Voucher2 ")
    sent = []
    real = bench_serve._one_request

    def recorded(client, mode, prompt, a, seed, progress=None, token=None):
        sent.append(prompt)
        return real(client, mode, prompt, a, seed, progress, token)

    monkeypatch.setattr(bench_serve, "_one_request", recorded)
    out = tmp_path / "serve"
    assert main(["bench", "serve", "--tiny", "--prompt-set", "similar", "--concurrency", "1,2", "--requests-per-level",
                 "4", "--max-new-tokens", "3", "--out", str(out), "--startup-timeout", "240"]) == 0
    assert len(sent) == 16 and len(set(sent)) == 16 and all("{" not in p for p in sent)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["outputs"] == "not compared (no prompt is sent twice)"
    capsys.readouterr()


def test_round_ratios_interval():
    value = bs.round_ratios([10.0, 12.0, 11.0], [10.0, 10.0, 10.0])
    assert value["ratios"] == [1.0, 1.2, 1.1] and value["geomean"] == round((1.0 * 1.2 * 1.1) ** (1 / 3), 3)
    low, high = value["ci95"]
    assert low < 1.0 < value["geomean"] < high  # three rounds that spread 20% do not tell 1.1x from 1.0x
    tight = bs.round_ratios([11.0, 11.1, 10.9, 11.0], [10.0] * 4)
    assert 1.08 < tight["ci95"][0] < 1.1 < tight["ci95"][1] < 1.12
    assert bs.round_ratios([10.0], [9.0]) is None and bs.round_ratios(None, [1.0, 2.0]) is None
    assert bs.format_rounds(value) == f"1.00-1.20x (95%: {low:.2f}-{high:.2f}x)"


def test_smoke_setups_and_links(tmp_path, capsys):
    """--setups runs more orchestrators on the same workers and --link-rtt-ms routes them through
    the delaying proxy, whose RPC and byte counts reach the table; every output stays exact."""
    from orchestrator.cli import main

    out = tmp_path / "serve"
    rc = main(["bench", "serve", "--tiny", "--concurrency", "1,2", "--requests-per-level", "2", "--max-new-tokens", "4",
               "--gamma", "on", "--setups", "default,fixed-gamma", "--link-rtt-ms", "0", "--out", str(out),
               "--startup-timeout", "240"])
    printed = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert {(r["setup"], r["link_rtt_ms"], r["concurrency"]) for r in summary["levels"]} == {
        ("default", 0.0, 1), ("default", 0.0, 2), ("fixed-gamma", 0.0, 1), ("fixed-gamma", 0.0, 2)}
    for row in summary["levels"]:
        assert row["errors"] == 0 and row["link_rpcs"] > 0 and row["rpcs_per_token"] > 0 and row["bytes_per_token"] > 0
    assert "RPCs/token" in printed and "| fixed-gamma | 0 | on | 2 |" in printed
    assert summary["outputs"]["identical"], summary["outputs"]["differ"]
    assert rc == 0


def test_setups_are_names_or_orchestrator_flags():
    assert bs.setup_flags("fixed-gamma") == ("--gamma-policy", "fixed")
    assert bs.setup_flags("gamma-policy=fixed+draft-lookup=0") == ("--gamma-policy", "fixed", "--draft-lookup", "0")
    assert bs.parse_setups("default, fixed-gamma,default") == ["default", "fixed-gamma"]
    for bad in ("nonsense", "draft-lookup", "--draft-lookup=0", "gamma-policy=", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            bs.parse_setups(bad)
    assert bs.parse_rtts("0,1,10") == [0.0, 1.0, 10.0]
    with pytest.raises(argparse.ArgumentTypeError):
        bs.parse_rtts("-1")


def test_smoke_grpc_and_http_side_by_side(tmp_path, capsys):
    """--api grpc,http: the same orchestrator through both doors, with the gap between tokens."""
    from orchestrator.cli import main

    out = tmp_path / "serve"
    rc = main(["bench", "serve", "--tiny", "--concurrency", "1,2", "--requests-per-level", "2", "--max-new-tokens", "4",
               "--gamma", "off", "--api", "grpc,http", "--out", str(out), "--startup-timeout", "240"])
    printed = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert {(r["api"], r["concurrency"]) for r in summary["levels"]} == {("grpc", 1), ("grpc", 2), ("http", 1),
                                                                          ("http", 2)}
    for row in summary["levels"]:
        assert row["errors"] == 0 and row["generated_tokens"] > 0 and row["ms_per_token_p50"] > 0, row
        # each gRPC request streamed its 4 tokens in 4 chunks; over HTTP a random tiny model's token may be
        # an incomplete character, held back until the next one completes it, so a request can stream one event
        assert row["longest_gap_p95_s"] > 0 if row["api"] == "grpc" else row["longest_gap_p95_s"] >= 0, row
    assert "| http | off | 2 |" in printed
    assert summary["outputs"]["identical"] and rc == 0


@pytest.mark.parametrize("arrivals", ["staggered", "together"])
def test_staggered_arrivals_join_one_client_at_a_time(monkeypatch, arrivals):
    """--arrivals staggered: client k's first request starts once the first client's first request has
    k/c of --max-new-tokens (so the clients' requests end and join one at a time); together: at once."""
    import threading
    import time
    import types

    events, lock = [], threading.Lock()

    def fake_request(client, mode, prompt, a, seed, progress=None, token=None):
        with lock:
            events.append(("start", seed))
        for n in range(1, a.max_new_tokens + 1):
            time.sleep(0.002)
            if progress is not None:
                progress(n)
            with lock:
                events.append(("token", seed, n))
        return 0.1, 0.01, [1] * a.max_new_tokens, "length", {"generated_tokens": a.max_new_tokens}, 0.002

    monkeypatch.setattr(bs, "_one_request", fake_request)
    monkeypatch.setattr("orchestrator.client.Client", lambda *args, **kwargs: types.SimpleNamespace(close=lambda: None))
    a = argparse.Namespace(requests_per_level=8, request_timeout=10.0, max_new_tokens=8, temperature=0.0,
                           prompt_set="fresh", arrivals=arrivals)
    records, _ = bs.run_level("unused", bs.Mode("on", None), 4, list(range(8)), a, log=print)
    assert len(records) == 8 and not any(r.error for r in records)
    assert {r.thread for r in records} == {0, 1, 2, 3}
    if arrivals == "together":
        return
    first = {}  # thread -> its first request's seed (bench serve seeds request i with i + 1)
    for r in sorted(records, key=lambda r: r.start_s):
        first.setdefault(r.thread, r.request + 1)
    for k in range(1, 4):
        at = events.index(("start", first[k]))
        lead_tokens = max([e[2] for e in events[:at] if e[0] == "token" and e[1] == first[0]], default=0)
        assert lead_tokens >= 2 * k, (k, lead_tokens)  # 8 tokens / 4 clients: client k joins at 2k


def test_fresh_users_share_no_cache_and_one_user_finds_its_prompts_cached(tmp_path, capsys, monkeypatch):
    """--users: by default every request comes as a client never seen before (its own bearer token),
    so no prompt is found in the workers' prefix caches (on, as served) though every level and mode
    sends the same prompts; `one` sends a mode's requests as one client, whose prompts sent by an
    earlier level are found cached, reported as modes of their own and compared with their own off."""
    from specdec_tools import bench_serve
    from orchestrator.cli import main

    tokens = []
    real = bench_serve._one_request

    def recorded(client, mode, prompt, a, seed, progress=None, token=None):
        tokens.append((mode.name, token))
        return real(client, mode, prompt, a, seed, progress, token)

    monkeypatch.setattr(bench_serve, "_one_request", recorded)
    out = tmp_path / "serve"
    assert main(["bench", "serve", "--tiny", "--users", "fresh,one", "--concurrency", "1,2",
                 "--requests-per-level", "2", "--max-new-tokens", "3", "--out", str(out), "--startup-timeout", "240"]) == 0
    capsys.readouterr()
    fresh = [t for m, t in tokens if not m.endswith("-one-user")]
    assert len(fresh) == 8 and len(set(fresh)) == 8  # on and off, 2 levels x 2 requests: a client each
    assert len({t for m, t in tokens if m.endswith("-one-user")}) == 1
    rows = {(r["mode"], r["concurrency"]): r for r in json.loads((out / "summary.json").read_text())["levels"]}
    assert set(rows) == {(m, c) for m in ("on", "off", "on-one-user", "off-one-user") for c in (1, 2)}
    assert all(rows[m, c]["cached_share"] == 0 for m in ("on", "off") for c in (1, 2))
    assert rows["on-one-user", 2]["cached_share"] > 0 and rows["off-one-user", 2]["cached_share"] > 0
    assert rows["on-one-user", 2]["vs_off"] == round(rows["on-one-user", 2]["aggregate_tok_s"] /
                                                     rows["off-one-user", 2]["aggregate_tok_s"], 3)


def test_temperatures_and_sampling_modes_multiply_the_modes():
    assert bs.parse_temperatures("0,0.7, 1.0,0.7") == [0.0, 0.7, 1.0]
    for bad in ("", "hot", "-1", "inf"):
        with pytest.raises(argparse.ArgumentTypeError):
            bs.parse_temperatures(bad)
    assert bs.parse_sampling_modes("both") == ["coupled", "rejection"]
    assert bs.parse_sampling_modes("default,rejection,coupled,both") == ["default", "rejection", "coupled"]
    with pytest.raises(argparse.ArgumentTypeError):
        bs.parse_sampling_modes("gumbel")
    modes = bs.with_sampling(bs.parse_modes("on,off"), [0.0, 0.7], ["coupled", "rejection"])
    # greedy once (it has one way to draw), each sampled temperature once per sampling mode
    assert [(m.name, m.temperature, m.sampling) for m in modes] == [
        ("on", 0.0, None), ("off", 0.0, None), ("on", 0.7, "coupled"), ("off", 0.7, "coupled"),
        ("on", 0.7, "rejection"), ("off", 0.7, "rejection")]
    assert [bs.mode_label(m) for m in modes[:3]] == ["on", "off", "on T0.7 coupled"]
    assert bs.with_sampling([bs.Mode("on", None)], [1.0], ["default"]) == [bs.Mode("on", None, temperature=1.0)]


def test_wire_bytes_a_round_and_sampled_rows():
    records = [rec(request=0, tokens=10), rec(request=1, tokens=20), rec(request=2, error="UNAVAILABLE: gone")]
    for r, (rounds, wire) in zip(records, [(4, 1000), (6, 2000), (9, 10**6)]):
        r.rounds, r.wire_bytes = rounds, wire
    assert bs.summarize_level(records, wall_s=1.0)["wire_bytes_per_round"] == 300.0  # 3000 B / 10 rounds
    assert bs.summarize_level([rec()], wall_s=1.0)["wire_bytes_per_round"] is None  # no stats (HTTP): none
    base = {"concurrency": 1, "requests": 2, "aggregate_tok_s": 10.0, "acceptance_rate": 0.5}
    greedy = {**base, "mode": "on", "temperature": 0.0, "sampling": "greedy", "wire_bytes_per_round": 250.4}
    lines = bs.format_table([greedy]).splitlines()
    assert "wire B/round" in lines[0] and "temperature" not in lines[0] and "| 250 |" in lines[2]
    assert lines[2].startswith("| on | 1 | 2 |")  # greedy tables keep their columns
    sampled = {**base, "mode": "on", "temperature": 0.7, "sampling": "rejection", "wire_bytes_per_round": 3161254.0}
    lines = bs.format_table([greedy, sampled]).splitlines()
    assert "| temperature | sampling | mode |" in lines[0]
    assert lines[2].startswith("| 0 | greedy | on | 1 |") and lines[3].startswith("| 0.7 | rejection | on | 1 |")
    assert "| 3,161,254 |" in lines[3]
    split = {"split_tokens": 2.0, **{key: 1.0 for key, _, _ in bs.SPLIT_COLUMNS[1:]}}
    lines = bs.format_split([{**greedy, **split}, {**sampled, **split}]).splitlines()
    assert lines[0].startswith("| temperature | sampling | mode | clients |")
    assert lines[3].startswith("| 0.7 | rejection | on | 1 | 2.00 |")
    # ratios stay within a temperature and a sampling mode
    rows = [{"mode": m, "concurrency": 1, "aggregate_tok_s": v, "temperature": t, "sampling_mode": s}
            for m, v, t, s in [("on", 12.0, 0.0, "default"), ("off", 10.0, 0.0, "default"),
                               ("on", 9.0, 0.7, "rejection"), ("off", 6.0, 0.7, "rejection"),
                               ("on", 11.0, 0.7, "coupled"), ("off", 10.0, 0.7, "coupled")]]
    assert [r["vs_off"] for r in bs.add_ratios(rows)] == [1.2, None, 1.5, None, 1.1, None]
    # only greedy outputs are compared
    records = [rec("on", 1, 0, ids=[1, 2]), rec("on", 2, 0, ids=[1, 2]), rec("on", 1, 0, ids=[5]),
               rec("on", 2, 0, ids=[6])]
    records[2].temperature = records[3].temperature = 0.7
    assert bs.compare_outputs(records) == {"checked": 1, "differ": [], "unchecked": 0}
    assert records[3].same_as_c1 is None and bs.level_differences(records, "on", 2) == "0/1"
    assert bs.row_sampling(bs.Mode("on", None), records) == "greedy"
    records[3].sampling = "coupled"
    assert bs.row_sampling(bs.Mode("on", None, temperature=0.7), records[2:]) == "coupled"  # as the server said
    assert bs.row_sampling(bs.Mode("on", None, temperature=0.7, sampling="rejection"), records[:1]) == "rejection"


def test_smoke_temperatures_and_both_sampling_modes(tmp_path, capsys, monkeypatch):
    """--temperature 0,1.0 --sampling-mode both: greedy rows, and at temperature 1 a coupled and a
    rejection row per mode, side by side; each request asks as its row says, the wire bytes a
    round show the difference (token ids against dense distributions) and only greedy outputs are
    compared. The bytes are compared at one client under the fixed policy, where the rows' rounds
    draft alike: under the default policy each row drafted as its steps' timing chose (a stressed
    CI run measured greedy and rejection rows that drafted nothing beside a coupled one that
    drafted: 1.6x the bytes, 3 runs in 9), and at two clients a round that meets the other
    request's prefill drafts nothing."""
    from specdec_tools import bench_serve
    from orchestrator.cli import main

    asked = []
    real = bench_serve._one_request

    def recorded(client, mode, prompt, a, seed, progress=None, token=None):
        out = real(client, mode, prompt, a, seed, progress, token)
        asked.append((mode.temperature, mode.sampling, out[4]["sampling"]))
        return out

    monkeypatch.setattr(bench_serve, "_one_request", recorded)
    out = tmp_path / "serve"
    assert main(["bench", "serve", "--tiny", "--concurrency", "1,2", "--requests-per-level", "2",
                 "--max-new-tokens", "4", "--temperature", "0,1.0", "--sampling-mode", "both", "--out", str(out),
                 "--setups", "fixed-gamma", "--startup-timeout", "240"]) == 0
    printed = capsys.readouterr().out
    assert set(asked) == {(0.0, None, "greedy"), (1.0, "coupled", "coupled"), (1.0, "rejection", "rejection")}
    summary = json.loads((out / "summary.json").read_text())
    rows = {(r["temperature"], r["sampling"], r["mode"], r["concurrency"]): r for r in summary["levels"]}
    assert set(rows) == {(t, s, m, c) for t, s in ((0.0, "greedy"), (1.0, "coupled"), (1.0, "rejection"))
                         for m in ("on", "off") for c in (1, 2)}
    for (t, s, m, c), row in rows.items():
        assert row["errors"] == 0 and row["wire_bytes_per_round"] > 0, row
        assert (row["outputs_differ"] != "") == (t == 0 and c == 2), row
        if m == "on":
            assert row["vs_off"] == round(row["aggregate_tok_s"] / rows[t, s, "off", c]["aggregate_tok_s"], 3)
    greedy, coupled, rejection = (rows[t, s, "on", 1]["wire_bytes_per_round"] for t, s in (
        (0.0, "greedy"), (1.0, "coupled"), (1.0, "rejection")))
    assert coupled < 1.5 * greedy and 10 * coupled < rejection, (greedy, coupled, rejection)
    assert summary["outputs"]["checked"] == 4 and summary["outputs"]["identical"]  # greedy: 2 requests x 2 modes
    assert "| 1 | rejection | on | 2 |" in printed and "| 0 | greedy | off | 1 |" in printed


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two hosts need two CPUs")
def test_smoke_two_hosts_on_this_machine(tmp_path, capsys):
    """--hosts: the target on one CPU, the draft and the orchestrator on the other, default flags:
    the services find out they are apart, so the draft drafts ahead; the table says how often its
    drafts were made in time and how busy each host was."""
    from orchestrator.cli import main

    cpus = sorted(os.sched_getaffinity(0))
    out = tmp_path / "hosts"
    assert main(["bench", "serve", "--tiny", "--hosts", f"{cpus[0]}/{cpus[1]}", "--concurrency", "1",
                 "--requests-per-level", "2", "--max-new-tokens", "12", "--gamma", "3,off",
                 "--setups", "gamma-policy=fixed", "--out", str(out),
                 "--startup-timeout", "240"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    drafting = next(r for r in summary["levels"] if r["mode"] != "off")
    assert drafting["ahead_hit_rate"] is not None and 0 <= drafting["busy_draft"] and 0 < drafting["busy_target"]
    assert summary["settings"]["hosts"] == f"{cpus[0]}/{cpus[1]}"
    assert "drafted ahead in time" in capsys.readouterr().out
