"""`specdec bench-ahead`: drafting ahead measured where it can help, each worker on cores of its own.

Drafting ahead (--draft-ahead N, draft_service/engine.py) lets the draft keep drafting while the
target verifies. It can only pay where the two have their own hardware, so this benchmark runs
two stacks side by side, loaded at once (an idle worker costs no CPU), and sends every prompt to
each configuration in turn, so the ratios come from one run on the same prompts:

  shared  both workers on all cores, their passes taking turns (what `specdec run` starts):
          gamma 0 (the target alone on the whole machine: the baseline) and speculative;
  split   target on the first CPU set, draft on the second (taskset, one OpenMP thread per CPU,
          no pass lock), one request at a time through two orchestrators on the same two workers:
          drafting ahead off, and on.

Greedy by default: every configuration's tokens are compared with the baseline's.
Output: a table on stdout, and results.md + records.jsonl in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    from specdec.model_store import DEFAULT_DRAFT, DEFAULT_TARGET

    p.add_argument("--target", default=DEFAULT_TARGET, help=f"target model (default {DEFAULT_TARGET})")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help=f"draft model (default {DEFAULT_DRAFT})")
    p.add_argument("--tiny", action="store_true", help="tiny random models (a smoke run of the tool itself)")
    p.add_argument("--target-cpus", default="0", help="taskset CPU list of the split stack's target (default 0)")
    p.add_argument("--draft-cpus", default="1", help="taskset CPU list of the split stack's draft (default 1)")
    p.add_argument("--ahead", type=int, default=4, help="--draft-ahead of the split stack's second orchestrator")
    p.add_argument("--sets", default="fresh,edit", help="prompt sets of specdec_tools/bench.py (default fresh,edit)")
    p.add_argument("--prompts", type=int, default=3, help="prompts per set (default 3)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (outputs are compared)")
    p.add_argument("--out", default="bench_results/ahead", help="output directory (default bench_results/ahead)")
    p.add_argument("--startup-timeout", type=float, default=1800.0)


def _request(address: str, prompt: str, gamma: int | None, a: argparse.Namespace, seed: int) -> dict:
    from orchestrator.client import Client

    kwargs = dict(messages=[{"role": "user", "content": prompt}], max_new_tokens=a.max_new_tokens,
                  temperature=a.temperature, gamma=gamma, seed=seed)
    with Client(address, timeout_s=3600.0) as client:
        t0 = time.perf_counter()
        r = client.generate(**kwargs)
        seconds = time.perf_counter() - t0
    return {"token_ids": r.token_ids, "seconds": seconds, "stats": r.stats}


def cmd_bench_ahead(a: argparse.Namespace) -> int:
    from specdec_tools.bench import PROMPT_SETS
    from specdec_tools.bench_serve import _model_dirs
    from specdec_tools.stack import ProcessStack

    log = lambda msg: print(f"[bench-ahead] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    prompts = [(name, i, PROMPT_SETS[name][i]) for name in a.sets.split(",") for i in range(a.prompts)]
    records = []
    with tempfile.TemporaryDirectory(prefix="specdec-bench-ahead-") as tmp:
        target_dir, draft_dir, draft_vocab, models = _model_dirs(a, tmp)
        shared = ProcessStack(target_dir, draft_dir, draft_vocab=draft_vocab)
        split = ProcessStack(target_dir, draft_dir, draft_vocab=draft_vocab,
                             cores={"target": a.target_cpus, "draft": a.draft_cpus})
        ahead_address = split.add_orchestrator("--draft-ahead", str(a.ahead))
        configs = [  # (name, address, request gamma)
            ("shared, gamma 0 (target alone)", shared.address, 0),
            ("shared, speculative", shared.address, None),
            (f"split {a.target_cpus}/{a.draft_cpus}, speculative", split.address, None),
            (f"split {a.target_cpus}/{a.draft_cpus}, + draft ahead {a.ahead}", ahead_address, None),
        ]
        try:
            t0 = time.monotonic()
            log(f"starting two stacks ({models['target']} + {models['draft']}) ...")
            for stack in (shared, split):  # one after the other: loading both at once doubles peak RAM
                stack.start(stdout=subprocess.DEVNULL)
                stack.wait_until_ready(a.startup_timeout)
            log(f"all SERVING after {time.monotonic() - t0:.1f} s")
            for _, address, gamma in configs:  # warm-up
                _request(address, "warm up", gamma, argparse.Namespace(**{**vars(a), "max_new_tokens": 4}), 0)
            for set_name, i, prompt in prompts:
                for name, address, gamma in configs:
                    r = _request(address, prompt, gamma, a, 1000 + i)
                    records.append({"set": set_name, "prompt": i, "config": name, **r})
                    log(f"{set_name} {i} {name}: {len(r['token_ids'])} tokens in {r['seconds']:.2f} s")
        except KeyboardInterrupt:
            log("interrupted; stopping the services")
            return 130
        finally:
            for stack in (split, shared):
                stack.stop()

    rows = summarize(records, [c[0] for c in configs], a.temperature == 0)
    table = format_table(rows)
    print(table)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    header = (f"{a.prompts} prompts per set ({a.sets}), {a.max_new_tokens} new tokens, temperature "
              f"{a.temperature}; models {models['target']} + {models['draft']}; {os.cpu_count()} CPUs, "
              f"{platform.platform()}; split: target on CPUs {a.target_cpus}, draft on {a.draft_cpus}\n\n"
              f"Reproduce: `specdec bench-ahead --sets {a.sets} --prompts {a.prompts} "
              f"--max-new-tokens {a.max_new_tokens} --ahead {a.ahead}`\n\n")
    (out / "results.md").write_text(header + table + "\n")
    with open(out / "records.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    log(f"results in {out}/")
    return 0


def summarize(records: list[dict], configs: list[str], greedy: bool) -> list[dict]:
    """One row per (prompt set, configuration): tok/s over the set, the ratio to the set's first
    configuration (the baseline), rounds, and how many outputs equal the baseline's."""
    rows = []
    for set_name in dict.fromkeys(r["set"] for r in records):
        base_tps, reference = None, {}
        for config in configs:
            rs = [r for r in records if r["set"] == set_name and r["config"] == config]
            tokens, seconds = sum(len(r["token_ids"]) for r in rs), sum(r["seconds"] for r in rs)
            tps = tokens / seconds if seconds else 0.0
            if base_tps is None:
                base_tps, reference = tps, {r["prompt"]: r["token_ids"] for r in rs}
            rounds = sum(r["stats"].get("rounds", 0) for r in rs)
            drafted = sum(r["stats"].get("drafted_tokens", 0) for r in rs)
            rows.append({"set": set_name, "config": config, "tokens_per_s": round(tps, 2),
                         "vs_baseline": round(tps / base_tps, 3) if base_tps else 0.0,
                         "tokens_per_round": round(tokens / rounds, 2) if rounds else None,
                         "drafts_per_round": round(drafted / rounds, 2) if rounds else None,
                         "same_tokens": f"{sum(r['token_ids'] == reference.get(r['prompt']) for r in rs)}/{len(rs)}"
                         if greedy else ""})
    return rows


def format_table(rows: list[dict]) -> str:
    lines = ["| prompts | configuration | tok/s | vs target alone | tokens/round | drafts/round | same tokens |",
             "|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['set']} | {r['config']} | {r['tokens_per_s']:.2f} | {r['vs_baseline']:.2f}x | "
                     f"{r['tokens_per_round'] or '-'} | {r['drafts_per_round'] or '-'} | {r['same_tokens']} |")
    return "\n".join(lines)
