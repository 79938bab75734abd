"""The served head at fixed gammas (the gamma policy off): eight of specdec bench's fresh prompts,
greedy, 48 tokens, gamma 0, 4, 2 and again, through the three services on one machine; checks
every output against gamma 0's. .venv/bin/python docs/benchmarks/trained-head/fixed_gamma.py HEAD"""
import sys
import time
from orchestrator.client import Client
from specdec.model_store import resolve_model
from specdec_tools.stack import ProcessStack
from specdec_tools.bench import FRESH
target = str(resolve_model("qwen2.5-coder-1.5b-instruct"))
out = {}
with ProcessStack(target, sys.argv[1], orchestrator_args=("--gamma-policy", "fixed")) as s:
    s.wait_until_ready(900)
    with Client(s.address, timeout_s=900) as c:
        c.generate(messages=[{"role": "user", "content": "warm up"}], max_new_tokens=4, gamma=0)
        for gamma in (0, 4, 2, 0, 4, 2):
            acc = dr = rounds = toks = 0; t0 = time.perf_counter(); same = True
            for p in FRESH[:8]:
                r = c.generate(messages=[{"role": "user", "content": p}], max_new_tokens=48, temperature=0, gamma=gamma)
                acc += r.stats["accepted_tokens"]; dr += r.stats["drafted_tokens"]; rounds += r.stats["rounds"]; toks += len(r.token_ids)
                if gamma == 0: out.setdefault(p, r.token_ids)
                else: same &= out.get(p) == r.token_ids
            el = time.perf_counter() - t0
            print(f"gamma {gamma}: {toks/el:.2f} tok/s, acceptance {acc/max(dr,1):.3f}, tokens a round {toks/max(rounds,1):.2f}, identical {same}", flush=True)
