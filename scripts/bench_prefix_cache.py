"""Time to first token with and without a cached prompt prefix, through the three services.

    .venv/bin/python scripts/bench_prefix_cache.py [--pairs 4] [--out DIR]
    SPECDEC_TARGET_PREFIX_CACHE_TOKENS=0 SPECDEC_DRAFT_PREFIX_CACHE_TOKENS=0 .venv/bin/python ...  # the ablation

One stack on the default pair (prefix caching on, its default size). Each pair of requests shares
a long system prompt of its own (a tool description, ~300 tokens, unique to the pair so that
nothing before it was cached): the first request prefills it (cold), the second finds it cached
(warm). Then an agent's second turn: its prompt is the first turn's prompt and answer and a new
question; then the first request again (a retry, a batch job's repeat: its whole prompt cached).
Greedy, 16 new tokens, default gamma (--orchestrator-args for others); the requests of a pair run
back to back, so drift weighs on them alike. Prints a table and writes DIR/table.md, DIR/runs.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

SYSTEM = ("You are tool-runner #{i}. You can call these tools: read_file(path) returns a file's text; "
          "write_file(path, text) replaces it; list_dir(path) lists a folder; run_tests(pattern) runs the "
          "matching tests and returns their report; search(query) finds symbols in the repository. "
          "Rules: never write outside the repository; run the tests after each change; explain each "
          "change in one sentence; prefer small diffs; keep the style of the surrounding code; ask "
          "before deleting a file; report failures verbatim. ") * 3
QUESTIONS = ["Which tool lists a folder?", "How do I run only the parser tests?"]


def _stream(client, messages):
    t0, ttft, ids, stats = time.perf_counter(), None, [], {}
    for chunk in client.stream(messages=messages, max_new_tokens=16, temperature=0.0):
        if chunk.token_ids and ttft is None:
            ttft = time.perf_counter() - t0
        ids += chunk.token_ids
        if chunk.stats is not None:
            stats = chunk.stats
    latency = time.perf_counter() - t0
    return {"ttft_s": ttft, "latency_s": latency, "prompt_tokens": stats.get("prompt_tokens"),
            "cached_tokens": stats.get("cached_tokens"), "token_ids": ids,
            "ms_per_token_after_first": (latency - ttft) / max(len(ids) - 1, 1) * 1e3,
            "drafted": stats.get("drafted_tokens"), "accepted": stats.get("accepted_tokens"),
            "rounds": stats.get("rounds")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--out", default="bench_results/prefix-cache")
    p.add_argument("--orchestrator-args", default="", help="more orchestrator flags, e.g. '--gamma-policy fixed'")
    a = p.parse_args(argv)

    from orchestrator.client import Client
    from specdec.model_store import DEFAULT_DRAFT, DEFAULT_TARGET, resolve_model
    from specdec_tools.stack import DEFAULT_DRAFT_VOCAB, ProcessStack

    stack = ProcessStack(str(resolve_model(DEFAULT_TARGET)), str(resolve_model(DEFAULT_DRAFT)),
                         draft_vocab=DEFAULT_DRAFT_VOCAB, orchestrator_args=tuple(a.orchestrator_args.split()),
                         prefix_cache=True)  # the workers' default size; the environment can set it
    runs = []
    try:
        stack.start()
        stack.wait_until_ready(1800)
        with Client(stack.address, timeout_s=600) as client:
            _stream(client, [{"role": "user", "content": "warm up"}])
            for i in range(a.pairs):
                system = {"role": "system", "content": SYSTEM.format(i=i)}
                for kind, question in zip(("cold", "warm"), QUESTIONS):
                    runs.append({"kind": kind, "pair": i, **_stream(client, [system, {"role": "user", "content": question}])})
                # an agent's next turn: the last turn's prompt, an answer and a new question
                turn = [system, {"role": "user", "content": QUESTIONS[1]},
                        {"role": "assistant", "content": "Call run_tests('parser')."},
                        {"role": "user", "content": "And the lexer tests?"}]
                runs.append({"kind": "next turn", "pair": i, **_stream(client, turn)})
                # the first request once more (a retry, a batch job's repeat)
                runs.append({"kind": "again", "pair": i, **_stream(client, [system, {"role": "user",
                                                                                     "content": QUESTIONS[0]}])})
    finally:
        stack.stop()
    table = ["| request | TTFT p50 s | TTFT min-max s | prompt tokens | cached tokens | ms/token after the first p50 "
             "| drafts kept / drafted |", "|---|---|---|---|---|---|---|"]
    for kind in ("cold", "warm", "next turn", "again"):
        rs = [r for r in runs if r["kind"] == kind]
        ttfts = [r["ttft_s"] for r in rs]
        table.append(f"| {kind} | {statistics.median(ttfts):.3f} | {min(ttfts):.3f}-{max(ttfts):.3f} | "
                     f"{statistics.median(r['prompt_tokens'] for r in rs):.0f} | "
                     f"{statistics.median(r['cached_tokens'] for r in rs):.0f} | "
                     f"{statistics.median(r['ms_per_token_after_first'] for r in rs):.1f} | "
                     f"{sum(r['accepted'] or 0 for r in rs)} / {sum(r['drafted'] or 0 for r in rs)} |")
    cold = statistics.median(r["ttft_s"] for r in runs if r["kind"] == "cold")
    warm = statistics.median(r["ttft_s"] for r in runs if r["kind"] == "warm")
    table.append("")
    table.append(f"warm TTFT / cold TTFT: {warm / cold:.2f} ({a.pairs} pairs)")
    print("\n".join(table))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text("\n".join(table) + "\n")
    (out / "runs.json").write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
