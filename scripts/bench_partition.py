"""What a cut link costs a request in flight, with each way of finding it off and on (root only).

Two target workers and a draft, each in a network namespace of its own (specdec_tools/netns.py),
tiny float64 models, an orchestrator in this process. For every variant: two greedy requests
streamed on target A, then A's link is cut (packets vanish, nothing resets); reported per
variant, the longest wait between two chunks of each request (its stall), whether its output
equals the undisturbed run's, and its failovers.

Variants (the orchestrator's defaults are "all"):
  none       one flat deadline per call (--worker-timeout, here 120 s); no keepalive; polls only mark
  deadlines  per-call deadlines from the measured pace (floor 10 s)
  keepalive  keepalive pings every 2 s (cut off after 4 s without an answer)
  poll       the pool's 1 s poll (2 s deadline) cancels the calls of a worker that stops answering
  all        the three together
  new        (not in the default list) a new request sent the moment the target it would be placed on
             is cut, against the same request undisturbed just before: its whole latency as "stall"

  .venv/bin/python scripts/bench_partition.py [--variants none,deadlines,keepalive,poll,all] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LONG = 300


def run_variant(name: str, model_dirs: dict, prompt: list[int], expected: list[int]) -> list[dict]:
    import orchestrator.pool as pool
    import orchestrator.remote as remote
    from orchestrator.client import Client
    from specdec_tools.netns import Netns
    from tests.support.processes import WorkerProcess
    from tests.support.servers import ADMIN_TOKEN, Streamed, start_orchestrator, wait_for

    saved = pool.WorkerPool._abandon_calls, remote.PassClock.deadline
    if name not in ("poll", "all"):
        pool.WorkerPool._abandon_calls = lambda self, m: None
    if name not in ("deadlines", "all"):
        remote.PassClock.deadline = lambda self, rows: self.ceiling_s
    keepalive = 2.0 if name in ("keepalive", "all") else 0.0
    made = []
    try:
        for role in ("target", "target", "draft"):
            ns = Netns()
            made.append((WorkerProcess(role, model_dirs[role], netns=ns), ns))
        (victim, link), (spare, _), (draft, _) = made
        for w, _ in made:
            w.wait_serving()
        parts, address = start_orchestrator([victim.address], [draft.address], worker_keepalive_s=keepalive)
        client = Client(address, timeout_s=600, token=ADMIN_TOKEN)
        try:
            streams = [Streamed(client, prompt, LONG), Streamed(client, prompt[:-1], LONG)]
            for s in streams:
                s.start()
                s.first.wait(60)
            client.add_workers(target=[spare.address])
            wait_for(lambda: any(w["address"] == spare.address and w["state"] == "serving"
                                 for w in client.workers()), 30)
            link.cut()
            out = []
            for i, s in enumerate(streams):
                s.join(600)
                out.append(dict(variant=name, request=i, stall_s=round(max(s.gaps, default=0.0), 2),
                                equal=(s.tokens == expected) if i == 0 else None,
                                target_failovers=s.stats.get("target_failovers"), error=repr(s.error) if s.error else None))
            return out
        finally:
            client.close()
            parts.stop(None)
    finally:
        pool.WorkerPool._abandon_calls, remote.PassClock.deadline = saved
        for w, ns in made:
            w.stop()
            ns.close()


def new_request_after_a_cut(model_dirs: dict, trials: int = 4) -> list[dict]:
    """A new request sent the moment the target it would be placed on is cut (the defaults: the
    pool has not seen the cut yet), against the same request undisturbed just before."""
    from orchestrator.client import Client
    from specdec_tools.netns import Netns
    from tests.support.processes import WorkerProcess
    from tests.support.servers import ADMIN_TOKEN, start_orchestrator

    made = []
    try:
        for role in ("target", "target", "draft"):
            ns = Netns()
            made.append((WorkerProcess(role, model_dirs[role], netns=ns), ns))
        for w, _ in made:
            w.wait_serving()
        links = {w.address: ns for w, ns in made}
        parts, address = start_orchestrator([made[0][0].address, made[1][0].address], [made[2][0].address])
        client = Client(address, timeout_s=300, token=ADMIN_TOKEN)
        ids, rows = list(range(5, 25)), []
        try:
            for trial in range(trials):
                started = time.monotonic()
                client.generate(token_ids=ids, max_new_tokens=40, temperature=0, gamma=3)
                undisturbed = time.monotonic() - started
                chosen = min(parts.slot.pools[0].members(), key=lambda m: (m.load, m.placed)).address
                links[chosen].cut()
                started = time.monotonic()
                r = client.generate(token_ids=ids, max_new_tokens=40, temperature=0, gamma=3)
                rows.append(dict(variant="new request at the cut", request=trial, undisturbed_s=round(undisturbed, 2),
                                 stall_s=round(time.monotonic() - started, 2), equal=None,
                                 target_failovers=r.stats["target_failovers"], error=None))
                links[chosen].heal()
                time.sleep(6)  # back in its pool
        finally:
            client.close()
            parts.stop(None)
        return rows
    finally:
        for w, ns in made:
            w.stop()
            ns.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default="none,deadlines,keepalive,poll,all")
    p.add_argument("--out", default="bench_results/partition")
    a = p.parse_args()
    from specdec.modeling import load_model
    from specdec_tools.netns import unavailable
    from specdec_tools.testing.tiny_models import build_model_dir, build_perturbed_copy
    from target_service.engine import TargetEngine
    from tests.orchestrator.test_greedy_equivalence import reference

    if unavailable():
        print(f"bench_partition: {unavailable()}", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="specdec-partition-"))
    target = build_model_dir(root / "tiny-target", seed=1, layers=2)
    model_dirs = {"target": target, "draft": build_perturbed_copy(target, root / "tiny-draft", seed=2, noise=0.05)}
    engine = TargetEngine(load_model(str(target), dtype="float64"))
    prompt = engine.tokenizer("The quick brown fox").input_ids
    expected = reference(engine, prompt, LONG)
    rows = []
    for name in a.variants.split(","):
        started = time.monotonic()
        rows += new_request_after_a_cut(model_dirs) if name == "new" else run_variant(name, model_dirs, prompt, expected)
        print(f"{name}: {rows[-2:]} ({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rows.json").write_text(json.dumps(rows, indent=1))
    lines = ["| variant | request | stall s | output equal | target failovers | error |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['variant']} | {r['request']} | {r['stall_s']} | {r['equal'] if r['equal'] is not None else ''} | "
              f"{r['target_failovers']} | {r['error'] or ''} |" for r in rows]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
