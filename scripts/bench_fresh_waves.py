"""New users on a new server: waves of distinct prompts at once, the default against gamma 0.

    .venv/bin/python scripts/bench_fresh_waves.py [--clients 8] [--waves 2] [--max-new-tokens 48]
                                                  [--first on|off] [--orchestrator-args "..."] [--out FILE]

Starts the default pair as `specdec serve` does (target, draft and orchestrator on this host's
cores, the caches on), then sends waves of --clients requests at once, every request a prompt
never sent before (specdec_tools/head_data/prompts.py's code tasks, in order) from a client never
seen before (its own bearer token): what a deployment's first users cost. The waves alternate
the default (the server's gamma) and gamma 0, --first first; each wave's tokens per second
(all its tokens over its wall time), and their ratio per pair of waves, are printed and written
to --out as JSON. A fresh orchestrator has measured nothing yet: its first wave is where a
policy that drafts before it knows the costs loses (docs/benchmarks/fresh-users).
"""

from __future__ import annotations

import argparse
import itertools
import json
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from orchestrator.client import Client  # noqa: E402
from specdec_tools.bench_serve import _model_dirs  # noqa: E402
from specdec_tools.head_data.prompts import CODE  # noqa: E402
from specdec_tools.stack import ProcessStack  # noqa: E402


def wave(client: Client, prompts: list[str], gamma: int | None, max_new_tokens: int, users) -> dict:
    """The prompts at once, each from a new client; tokens, wall time and per-request figures."""
    out: list[dict | None] = [None] * len(prompts)

    def one(i: int) -> None:
        t0, ttft, tokens = time.perf_counter(), None, 0
        for chunk in client.stream(token=next(users), messages=[{"role": "user", "content": prompts[i]}],
                                   max_new_tokens=max_new_tokens, temperature=0.0, gamma=gamma):
            tokens += len(chunk.token_ids)
            if ttft is None and chunk.token_ids:
                ttft = time.perf_counter() - t0
            if chunk.stats is not None:
                out[i] = {"tokens": tokens, "ttft_s": round(ttft, 3), "latency_s": round(time.perf_counter() - t0, 3),
                          "drafted": chunk.stats.get("drafted_tokens", 0),
                          "draft_prefill_tokens": chunk.stats.get("draft_prefill_tokens", 0)}

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    tokens = sum(o["tokens"] for o in out)
    return {"tok_s": round(tokens / wall, 3), "wall_s": round(wall, 3), "tokens": tokens, "requests": out}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=8, help="requests in a wave (default 8)")
    p.add_argument("--waves", type=int, default=2, help="waves of each mode (default 2)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--first", choices=["on", "off"], default="on", help="the mode of the first wave (default on)")
    p.add_argument("--orchestrator-args", default="", help="more orchestrator flags, e.g. '--log-level debug'")
    p.add_argument("--warm-up", action="store_true",
                   help="one request of the default (4 tokens) before the waves: the services' one-time costs paid")
    p.add_argument("--out", default=None, help="JSON file for the waves (default: print only)")
    a = p.parse_args()
    if 2 * a.waves * a.clients > len(CODE):
        p.error(f"at most {len(CODE)} distinct prompts: lower --waves or --clients")
    models = argparse.Namespace(tiny=False, random=None, target="qwen2.5-coder-1.5b-instruct",
                                draft="qwen2.5-coder-0.5b-instruct", device="cpu", dtype="auto")
    users = (f"fresh-{time.time_ns()}-{n}" for n in itertools.count())
    prompts = iter(CODE)
    result = {"clients": a.clients, "max_new_tokens": a.max_new_tokens, "first": a.first,
              "orchestrator_args": a.orchestrator_args, "warm_up": a.warm_up, "waves": []}
    with tempfile.TemporaryDirectory() as tmp:
        target, draft, vocab, _ = _model_dirs(models, tmp)
        stack = ProcessStack(target, draft, draft_vocab=vocab, prefix_cache=True, suffix_cache=True,
                             orchestrator_args=tuple(shlex.split(a.orchestrator_args)))
        try:
            stack.start(stdout=subprocess.DEVNULL)
            stack.wait_until_ready(1800)
            with Client(stack.address, timeout_s=600) as client:
                if a.warm_up:
                    client.generate(messages=[{"role": "user", "content": "warm up"}], max_new_tokens=4, temperature=0.0)
                for w in range(a.waves):
                    first = a.first if w % 2 == 0 else ("off" if a.first == "on" else "on")
                    for mode in (first, "off" if first == "on" else "on"):
                        batch = [next(prompts) for _ in range(a.clients)]
                        r = wave(client, batch, None if mode == "on" else 0, a.max_new_tokens, users)
                        result["waves"].append({"wave": w, "mode": mode, **r})
                        print(f"wave {w} {mode:>3}: {r['tokens']} tokens in {r['wall_s']:.2f} s = {r['tok_s']:.2f} "
                              f"tok/s; drafted {sum(q['drafted'] for q in r['requests'])} tokens", flush=True)
        finally:
            stack.stop()
    on = [x["tok_s"] for x in result["waves"] if x["mode"] == "on"]
    off = [x["tok_s"] for x in result["waves"] if x["mode"] == "off"]
    result["ratios"] = [round(x / y, 3) for x, y in zip(on, off)]
    print("default / gamma 0 by wave:", ", ".join(f"{r:.3f}x" for r in result["ratios"]))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
