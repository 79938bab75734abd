"""What the step policy costs the orchestrator per step: GammaPolicy.choose_step with its outcome,
the cost model's search it skips where the level's measured arm is plain (best_step_gammas), and
the suffix-draft lookups of every request (orchestrator/proposers/suffix.py), at several request counts.

    .venv/bin/python scripts/bench_policy_cost.py [--requests 1,8,16,32] [--steps 2000]

The policy is warmed as a server's would be (pass lines, acceptance, a level whose measured arms
run plain); the suffix index holds 60 ended requests of 600 tokens, and each request 150 tokens of
its own, one more each step. A step of the default pair on the 2-core VM takes 50-140 ms; the
orchestrator shares those cores with both workers, so what it spends here a step is taken from the
passes.
"""

from __future__ import annotations

import argparse
import random
import time

from orchestrator.gamma import GammaPolicy, StepRequest, best_step_gammas
from orchestrator.proposers.suffix import RequestIndex, SuffixIndex

TARGET, DRAFT = "target:1", "draft:1"


def warmed_policy(requests: int) -> tuple[GammaPolicy, list[StepRequest]]:
    rng = random.Random(0)
    policy = GammaPolicy()
    for rows in (1, 2, 4, 8, 9, 16, 20, 40, 64):
        for _ in range(20):
            policy.observe_pass(TARGET, rows, 0.040 + 0.006 * rows)
            policy.observe_pass(DRAFT, rows, 0.012 + 0.002 * rows)
    for _ in range(50):
        policy.observe_round(TARGET, DRAFT, 4, rng.randint(0, 4))
        policy.observe_step(TARGET, 0.006, {DRAFT: (requests, 0.02, 0.003)})
    step = [StepRequest(4, DRAFT, 30, None, 100) for _ in range(requests)]
    for _ in range(200):  # plain steps measure better: the level runs plain, exploring within its budget
        gammas = policy.choose_step(TARGET, step, load=requests)
        policy.observe_outcome(TARGET, requests if not any(gammas) else requests + 1, 0.1 if not any(gammas) else 0.3)
    return policy, step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", default="1,8,16,32")
    p.add_argument("--steps", type=int, default=2000)
    a = p.parse_args()
    rng = random.Random(1)
    index = SuffixIndex()
    for _ in range(60):
        index.add("", [rng.randint(0, 3000) for _ in range(600)])
    print("| requests | choose_step + observe_outcome ms | the model's search alone ms (skipped where plain runs) "
          "| suffix lookups ms | running arm |")
    print("|---|---|---|---|---|")
    for n in (int(x) for x in a.requests.split(",")):
        policy, step = warmed_policy(n)
        started = time.perf_counter()
        for _ in range(a.steps):
            gammas = policy.choose_step(TARGET, step, load=n)
            policy.observe_outcome(TARGET, n if not any(gammas) else n + 1, 0.1 if not any(gammas) else 0.3)
        choose_ms = (time.perf_counter() - started) / a.steps * 1e3
        costs = policy._step_costs(TARGET, step)
        started = time.perf_counter()
        for _ in range(a.steps):
            best_step_gammas(step, costs)
        search_ms = (time.perf_counter() - started) / a.steps * 1e3
        tokens = [[rng.randint(0, 3000) for _ in range(150)] for _ in range(n)]
        own = [RequestIndex() for _ in range(n)]
        for t, o in zip(tokens, own):
            index.draft("", t, o, 16)  # the first lookup indexes the request's prompt
        lookups = max(a.steps // 10, 1)
        started = time.perf_counter()
        for _ in range(lookups):
            for t, o in zip(tokens, own):
                t.append(rng.randint(0, 3000))
                index.draft("", t, o, 16)
        lookup_ms = (time.perf_counter() - started) / lookups * 1e3
        print(f"| {n} | {choose_ms:.3f} | {search_ms:.3f} | {lookup_ms:.3f} | {policy.arms.level(TARGET, n).running} |")


if __name__ == "__main__":
    main()
