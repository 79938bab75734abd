"""Load test (issue 5): many clients for minutes against the whole stack, with workers killed.

  specdec bench load [--duration 300] [--clients 16] [--no-faults] [--out DIR] [--seed 0]
  python -m specdec_tools.loadtest ...    (the same)

Builds the tiny models of specdec_tools/testing/tiny_models.py, starts 2 targets, 2 drafts (float64, no
quantization: greedy speculative output equals the target's own greedy output exactly) and the
orchestrator as processes (logs in OUT/logs/), computes each prompt's greedy reference in this
process with transformers, then runs --clients threads until --duration: mostly greedy requests
(gamma 0..6), some sampled, some streamed, some cancelled mid-stream, some with a short deadline.
Every request comes from a client of its own (a bearer token never sent before; --users one: all from
one), so no request finds another's prompt cached. Faults (times as fractions of the duration): 25% SIGKILL draft0, 40% restart it; 55% SIGKILL
target0, 70% restart it; 85% SIGTERM draft1 (drain), restart it once it exits. Each step waits for
the previous restart (a worker loads in 10-30 s on a busy 2-core machine): give it >= 120 s.
With --partitions the faults are cut links instead (root only): every worker runs in a network
namespace of its own, reached over a veth link (specdec_tools/netns.py), and the plan is: 20% cut
target0's link, 40% heal it; 55% cut draft0's, 70% heal it; 80% cut target1's and draft1's, 90%
heal both. A cut link resets nothing (packets vanish): only the orchestrator's keepalive pings and
polls find it, in seconds.
Reported (stdout, OUT/report.json, OUT/report.md; RSS every 10 s in OUT/memory.csv): requests by
kind and status (completed, and lost: any status the kind does not expect), greedy outputs equal
to the reference, failovers, latency (p50/p95/p99), the longest stall (the longest wait between
two chunks of a streamed request), tokens/s, sessions left open after the run, RSS of each
process at start and end, the fault timeline with the seconds each healed or restarted worker
took to serve in its pool again.
Exit 0 only if no greedy output differs, no session leaked and every status is an expected one
(OK; CANCELLED/DEADLINE_EXCEEDED for the requests the client cut short).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from specdec_tools import report

KINDS = {"greedy": 45, "stream": 15, "sampled": 15, "cancel": 15, "deadline": 10}  # weights
EXPECTED = {"cancel": {"OK", "CANCELLED"}, "deadline": {"OK", "DEADLINE_EXCEEDED"}}  # others: OK only
MAX_NEW = (16, 48, 96)
WORDS = ("the a of def return import class list string value print for while if else data model token "
         "function loop index key self None True").split()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    p.add_argument("--clients", type=int, default=16, help="concurrent client threads")
    p.add_argument("--faults", action=argparse.BooleanOptionalAction, default=True, help="kill/restart workers")
    p.add_argument("--partitions", action="store_true",
                   help="the faults cut and heal workers' network links instead (each worker in a network namespace "
                        "of its own; needs root)")
    report.add_out_argument(p, "loadtest-")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--users", choices=["fresh", "one"], default="fresh",
                   help="fresh: every request from a client of its own (a bearer token never sent before: nothing "
                        "cached for it); one: all from one client, so repeated prompts are found cached (default fresh)")
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--leak-wait", type=float, default=10.0, help="seconds sessions get to close after the run")


def rss_kb(pid: int | None) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


class Proc:
    """One service process; restartable on the same port, its output appended to a log file."""

    def __init__(self, name: str, args: list[str], log_dir: Path, port: int, host: str = "127.0.0.1", netns=None):
        """netns: the specdec_tools.netns.Netns it runs in (host: its address there)."""
        self.name, self.args, self.port, self.netns = name, args, port, netns
        self.address, self.log_path, self.popen = f"{host}:{port}", log_dir / f"{name}.log", None

    def start(self) -> "Proc":
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        argv = [sys.executable, "-m", *self.args]
        if self.netns is not None:
            argv = self.netns.command(argv)
        with open(self.log_path, "ab") as log:  # own session: Ctrl-C reaches only us
            self.popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        return self

    def remote(self):
        from orchestrator.remote import RemoteDraft, RemoteTarget

        return (RemoteTarget if self.name.startswith("target") else RemoteDraft)(self.address, timeout_s=5)

    def wait_serving(self, timeout_s: float = 300.0) -> None:
        w = self.remote()
        try:
            w.wait_until_serving(timeout_s)
        finally:
            w.close()

    def open_sessions(self) -> int | None:
        w = self.remote()
        try:
            return w.describe().open_sessions
        except Exception:  # noqa: BLE001 - a dead worker holds nothing
            return None
        finally:
            w.close()


def references(target_dir: str, n_prompts: int, seed: int) -> tuple[list[str], list[list[int]], set[int]]:
    """Prompts of 1..60 words and each one's greedy output (max(MAX_NEW) tokens, or up to EOS);
    candidates whose output ends at EOS are preferred, so that path gets tested (>= n/5 of them)."""
    import torch

    from specdec.modeling import eos_token_ids, load_model

    torch.set_num_threads(1)
    lm = load_model(target_dir, dtype="float64", quantization="none")
    eos = set(eos_token_ids(lm.model, lm.tokenizer))
    rng, kept, rest = random.Random(seed), [], []
    for _ in range(n_prompts * 4):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60)))[:380]
        ids = lm.tokenizer(prompt).input_ids
        out = lm.model.generate(torch.tensor([ids]), max_new_tokens=max(MAX_NEW), do_sample=False,
                                pad_token_id=lm.tokenizer.pad_token_id)[0, len(ids):].tolist()
        (kept if out[-1] in eos else rest).append((prompt, out))
        if len(kept) >= n_prompts // 5 and len(kept) + len(rest) >= n_prompts:
            break
    chosen = (kept + rest)[:n_prompts]
    return [p for p, _ in chosen], [o for _, o in chosen], eos


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def client_loop(i, address, prompts, refs, eos, a, stop, t0, records, lock):
    from orchestrator.client import Client
    from specdec.errors import ServiceError

    rng = random.Random(a.seed * 1000 + i)
    client = Client(address)
    sent = 0
    while not stop.is_set():
        kind = rng.choices(list(KINDS), list(KINDS.values()))[0]
        p, n, gamma = rng.randrange(len(prompts)), rng.choice(MAX_NEW), rng.randint(0, 6)
        sent += 1
        kw = dict(prompt=prompts[p], max_new_tokens=n, gamma=gamma, temperature=0.0,
                  token="loadtest" if getattr(a, "users", "fresh") == "one" else f"loadtest-{i}-{sent}")
        if kind == "sampled":
            kw.update(temperature=0.8, top_p=0.9, seed=rng.randrange(2**32))
        client.timeout_s = rng.uniform(0.05, 0.5) if kind == "deadline" else 120.0
        rec = dict(client=i, kind=kind, prompt=p, max_new=n, gamma=gamma, start=round(time.monotonic() - t0, 3))
        tokens, finish, stats, t = [], None, {}, time.monotonic()
        try:
            if kind in ("stream", "cancel"):
                chunks, cut = client.stream(**kw), (rng.randint(1, 2) if kind == "cancel" else None)
                last, gap = None, 0.0
                for k, c in enumerate(chunks, 1):
                    now = time.monotonic()
                    gap, last = max(gap, now - last) if last is not None else gap, now
                    rec["stall"] = round(gap, 3)
                    tokens += c.token_ids
                    if c.stats is not None:
                        finish, stats = c.finish_reason, c.stats
                    elif cut and k >= cut:
                        chunks.close()  # the client goes away mid-answer
                        break
                status = "OK" if finish else "CANCELLED"
            else:
                r = client.generate(**kw)
                tokens, finish, stats, status = r.token_ids, r.finish_reason, r.stats, "OK"
        except ServiceError as exc:
            status, rec["message"] = exc.code.name, exc.message[:300]
        except Exception as exc:  # noqa: BLE001 - a client-side failure is a finding too
            status, rec["message"] = f"CLIENT_{type(exc).__name__}", str(exc)[:300]
        rec.update(status=status, latency=time.monotonic() - t, tokens=len(tokens), finish=finish,
                   target_failovers=stats.get("target_failovers", 0), draft_failovers=stats.get("draft_failovers", 0))
        if kind != "sampled" and (status == "OK" or tokens):  # greedy: the output (or what came) is the reference's
            ref = refs[p][:n]
            want_finish = "eos" if ref[-1] in eos else "length"
            rec["equal"] = tokens == ref and finish == want_finish if status == "OK" else tokens == ref[:len(tokens)]
            if not rec["equal"]:
                rec.update(got=tokens, want=ref, want_finish=want_finish)
        with lock:
            records.append(rec)
    client.close()


def wait_picked_up(client, address: str, timeout_s: float = 60.0) -> float | None:
    t = time.monotonic()
    while time.monotonic() - t < timeout_s:
        if any(w["address"] == address and w["state"] == "serving" for w in client.workers()):
            return time.monotonic() - t
        time.sleep(0.1)
    return None


def run_faults(procs, client, duration, t0, stop, events):
    def log(what, **detail):
        events.append(dict(t=round(time.monotonic() - t0, 2), event=what, **detail))
        print(f"[loadtest] t={events[-1]['t']:7.2f}s {what} {detail}", file=sys.stderr, flush=True)

    def restart(p):
        p.start().wait_serving()
        log(f"{p.name} restarted, serving", pid=p.popen.pid)
        log(f"{p.name} picked up by the orchestrator", after_s=wait_picked_up(client, p.address))

    plan = [(0.25, "kill", "draft0"), (0.40, "restart", "draft0"), (0.55, "kill", "target0"),
            (0.70, "restart", "target0"), (0.85, "term", "draft1")]
    for frac, action, name in plan:
        if stop.wait(max(0.0, t0 + frac * duration - time.monotonic())):
            return
        p = procs[name]
        if action == "restart":
            restart(p)
            continue
        held = p.open_sessions()
        p.popen.send_signal(signal.SIGKILL if action == "kill" else signal.SIGTERM)
        log(f"{'SIGKILL' if action == 'kill' else 'SIGTERM'} {name}", pid=p.popen.pid, open_sessions=held)
        code = p.popen.wait(60)
        log(f"{name} exited", returncode=code)
        if action == "term":
            restart(p)
    log("fault plan complete")


def run_partitions(procs, client, duration, t0, stop, events):
    """The --partitions plan: cut and heal the workers' links (see the module's docstring)."""
    def log(what, **detail):
        events.append(dict(t=round(time.monotonic() - t0, 2), event=what, **detail))
        print(f"[loadtest] t={events[-1]['t']:7.2f}s {what} {detail}", file=sys.stderr, flush=True)

    plan = [(0.20, "cut", ("target0",)), (0.40, "heal", ("target0",)), (0.55, "cut", ("draft0",)),
            (0.70, "heal", ("draft0",)), (0.80, "cut", ("target1", "draft1")), (0.90, "heal", ("target1", "draft1"))]
    for frac, action, names in plan:
        if stop.wait(max(0.0, t0 + frac * duration - time.monotonic())):
            return
        for name in names:
            getattr(procs[name].netns, action)()
            log(f"{action} {name}'s link")
        if action == "heal":
            for name in names:
                log(f"{name} picked up by the orchestrator", after_s=wait_picked_up(client, procs[name].address))
    log("fault plan complete")


def memory_sampler(procs, path: Path, t0, stop, peaks: dict):
    with open(path, "w") as f:
        f.write("t_s,process,pid,rss_kb\n")
        while True:
            for name, p in procs.items():
                pid = p.popen.pid if p.popen and p.popen.poll() is None else None
                rss = rss_kb(pid)
                f.write(f"{time.monotonic() - t0:.1f},{name},{pid or ''},{rss or ''}\n")
                peaks[name] = max(peaks.get(name, 0.0), round((rss or 0) / 1024, 1))
            f.flush()
            if stop.wait(10.0):
                return


def rss_snapshot(procs) -> dict:
    return {n: dict(pid=p.popen.pid, rss_mb=round((rss_kb(p.popen.pid) or 0) / 1024, 1)) for n, p in procs.items()}


def summarize(records, a, seconds, events, leaks, rss_start, rss_end, peaks, workers) -> dict:
    ok = [r for r in records if r["status"] == "OK"]
    checked = [r for r in records if "equal" in r]
    unexpected = [r for r in records if r["status"] not in EXPECTED.get(r["kind"], {"OK"})]
    return dict(
        duration_s=round(seconds, 1), clients=a.clients, faults=a.faults, requests=len(records),
        by_kind=dict(Counter(r["kind"] for r in records)), status=dict(Counter(r["status"] for r in records)),
        status_by_kind={k: dict(Counter(r["status"] for r in records if r["kind"] == k)) for k in KINDS},
        unexpected_status=len(unexpected), unexpected_examples=unexpected[:5],
        greedy_checked=len(checked), greedy_complete_checked=sum(r["status"] == "OK" for r in checked),
        greedy_equal=sum(r["equal"] for r in checked), greedy_differ=sum(not r["equal"] for r in checked),
        greedy_eos_checked=sum(r["status"] == "OK" and r["finish"] == "eos" for r in checked),
        differ_examples=[r for r in checked if not r["equal"]][:5],
        requests_with_target_failover=sum(r["target_failovers"] > 0 for r in records),
        requests_with_draft_failover=sum(r["draft_failovers"] > 0 for r in records),
        target_failovers=sum(r["target_failovers"] for r in records),
        draft_failovers=sum(r["draft_failovers"] for r in records),
        latency_s={k: dict(p50=pct(v, 0.5), p95=pct(v, 0.95)) for k in KINDS
                   if (v := [r["latency"] for r in ok if r["kind"] == k])},
        latency_all_ok_s=dict(p50=pct([r["latency"] for r in ok], 0.5), p95=pct([r["latency"] for r in ok], 0.95),
                              p99=pct([r["latency"] for r in ok], 0.99)),
        completed=len(ok), lost=len(unexpected), longest_stall_s=max((r.get("stall", 0.0) for r in records), default=0.0),
        recovered_after_s=[e["after_s"] for e in events if "after_s" in e],
        tokens_ok=sum(r["tokens"] for r in ok), tokens_per_s=round(sum(r["tokens"] for r in ok) / seconds, 1),
        sessions_leaked=leaks, sessions_leaked_total=sum(v or 0 for v in leaks.values()),
        rss_start=rss_start, rss_end=rss_end, rss_peak_mb=peaks, workers_end=workers, faults_timeline=events,
    )


def markdown(s: dict) -> str:
    lat = s["latency_all_ok_s"]
    faults = ("cut links" if s.get("partitions") else "on") if s["faults"] else "off"
    lines = [f"# Load test: {s['clients']} clients, {s['duration_s']} s, faults {faults}", "",
             f"- requests: {s['requests']} by kind {s['by_kind']}", f"- status: {s['status']}",
             f"- completed {s['completed']}, lost {s['lost']} (unexpected status)",
             f"- greedy outputs checked: {s['greedy_checked']} ({s['greedy_complete_checked']} complete, "
             f"{s['greedy_eos_checked']} ending at EOS); equal {s['greedy_equal']}, differ {s['greedy_differ']}",
             f"- failovers: target {s['target_failovers']} ({s['requests_with_target_failover']} requests), "
             f"draft {s['draft_failovers']} ({s['requests_with_draft_failover']} requests)",
             f"- latency of OK requests, p50/p95 s: all {lat['p50'] or 0:.2f}/{lat['p95'] or 0:.2f} "
             f"(p99 {lat['p99'] or 0:.2f}); "
             + ", ".join(f"{k} {v['p50']:.2f}/{v['p95']:.2f}" for k, v in s["latency_s"].items()),
             f"- longest stall (between two chunks of a streamed request): {s['longest_stall_s']:.2f} s",
             f"- a healed or restarted worker serving in its pool again after (s): {s['recovered_after_s']}",
             f"- tokens/s (OK requests, aggregate): {s['tokens_per_s']}",
             f"- sessions leaked: {s['sessions_leaked_total']} {s['sessions_leaked']}", "",
             report.markdown_table(["process", "pid start", "RSS start MB", "pid end", "RSS end MB",
                                    "peak MB (10 s samples)"], (
                 [n, st["pid"], st["rss_mb"], s["rss_end"][n]["pid"], s["rss_end"][n]["rss_mb"], s["rss_peak_mb"].get(n)]
                 for n, st in s["rss_start"].items())), "", "Faults:", ""]
    for e in s["faults_timeline"]:
        lines.append(f"- t={e['t']} s: {e['event']} {({k: v for k, v in e.items() if k not in ('t', 'event')})}")
    lines += ["", "**FAILED**: " + "; ".join(s["failures"]) if s["failures"] else "**PASSED**"]
    return "\n".join(lines) + "\n"


def cmd_loadtest(a: argparse.Namespace) -> int:
    from orchestrator.client import Client
    from specdec_tools.stack import free_port, stop_processes

    if a.partitions:
        from specdec_tools.netns import unavailable

        if unavailable():
            print(f"[loadtest] --partitions: {unavailable()}", file=sys.stderr)
            return 2
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    out = report.out_dir(a.out, "loadtest-")
    (out / "logs").mkdir(exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="specdec-loadtest-"))
    from specdec_tools.testing.tiny_models import build_tiny_pair

    target_dir, draft_dir = build_tiny_pair(tmp)
    procs: dict[str, Proc] = {}
    # all five processes share this host's cores: the workers' passes take turns, the draft
    # sessions open lazily (--prefill sequential), as on the one-host stack
    pass_lock = str(tmp / "passes.lock")
    namespaces = []
    for role, model in (("target", target_dir), ("draft", draft_dir)):
        for k in range(2):
            port, netns = free_port(), None
            if a.partitions:
                from specdec_tools.netns import Netns

                netns = Netns()
                namespaces.append(netns)
            host = netns.address if netns is not None else "127.0.0.1"
            procs[f"{role}{k}"] = Proc(f"{role}{k}", [f"{role}_service", "--model", model, "--host", host,
                                                      "--port", str(port), "--dtype", "float64", "--quantize", "none",
                                                      "--session-ttl", "30", "--pass-lock", pass_lock],
                                       out / "logs", port, host, netns)
    port = free_port()
    admin = secrets.token_hex(16)  # the monitor reads the workers' addresses: an admin's right
    (out / "admin-token").write_text(admin + "\n")
    procs["orchestrator"] = Proc("orchestrator", [
        "orchestrator", "--host", "127.0.0.1", "--port", str(port), "--poll-interval", "0.5", "--prefill", "sequential",
        "--target", f"{procs['target0'].address},{procs['target1'].address}",
        "--draft", f"{procs['draft0'].address},{procs['draft1'].address}",
        "--admin-token-file", str(out / "admin-token")], out / "logs", port)
    stop, records, events, lock, peaks = threading.Event(), [], [], threading.Lock(), {}
    threads: list[threading.Thread] = []
    try:
        for p in procs.values():
            p.start()
        print(f"[loadtest] computing references; logs in {out}/logs", file=sys.stderr, flush=True)
        prompts, refs, eos = references(target_dir, a.prompts, a.seed)
        client = Client(procs["orchestrator"].address, timeout_s=30, token=admin)
        client.wait_until_ready(300)
        deadline = time.monotonic() + 120
        while [w["state"] for w in client.workers()] != ["serving"] * 4:
            if time.monotonic() > deadline:
                raise RuntimeError(f"not every worker is serving: {client.workers()}")
            time.sleep(0.2)
        for r in range(8):  # warm-up: every worker gets requests
            client.generate(prompt=prompts[r % len(prompts)], max_new_tokens=8, temperature=0, gamma=3)
        rss_start = rss_snapshot(procs)
        print(f"[loadtest] {a.clients} clients for {a.duration:.0f} s; RSS at start {rss_start}", file=sys.stderr)
        t0 = time.monotonic()
        threads = [threading.Thread(target=client_loop, daemon=True, name=f"client-{i}",
                                    args=(i, client.address, prompts, refs, eos, a, stop, t0, records, lock))
                   for i in range(a.clients)]
        helpers = [threading.Thread(target=memory_sampler, args=(procs, out / "memory.csv", t0, stop, peaks),
                                    daemon=True)]
        if a.faults:
            plan = run_partitions if a.partitions else run_faults
            helpers.append(threading.Thread(target=plan, args=(procs, client, a.duration, t0, stop, events),
                                            daemon=True))
        for th in threads + helpers:
            th.start()
        while time.monotonic() - t0 < a.duration:
            time.sleep(min(10.0, max(0.1, a.duration - (time.monotonic() - t0))))
            with lock:
                print(f"[loadtest] t={time.monotonic() - t0:6.1f}s requests {len(records)} "
                      f"{dict(Counter(r['status'] for r in records))}", file=sys.stderr, flush=True)
        stop.set()
        for th in threads:
            th.join(180)
        seconds = time.monotonic() - t0
        for th in helpers[1:]:  # a restart in progress finishes first
            th.join(120)
        leaks: dict = {}
        deadline = time.monotonic() + a.leak_wait
        while True:
            leaks = {n: p.open_sessions() for n, p in procs.items() if n != "orchestrator"}
            workers = client.workers()
            leaks["orchestrator_active"] = sum(w["active_sessions"] for w in workers)
            if sum(v or 0 for v in leaks.values()) == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        s = summarize(records, a, seconds, events, leaks, rss_start, rss_snapshot(procs), peaks, workers)
        s["partitions"] = a.partitions
        s["failures"] = [why for bad, why in [
            (s["greedy_differ"], f"{s['greedy_differ']} greedy outputs differ from the reference"),
            (s["sessions_leaked_total"], f"{s['sessions_leaked_total']} sessions leaked"),
            (s["unexpected_status"], f"{s['unexpected_status']} requests ended with an unexpected status"),
            (None in leaks.values(), "a worker did not answer Describe at the end"),
            (a.faults and not any(e["event"] == "fault plan complete" for e in events),
             "the fault plan did not complete before the end (a longer --duration, or see the log)"),
            (any("after_s" in e and e["after_s"] is None for e in events), "a restarted worker was not picked up"),
        ] if bad]
        report.write_json(out / "report.json", s)
        (out / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        report.write_table(out, markdown(s), "report.md")
        print(f"[loadtest] report in {out}", file=sys.stderr)
        return 1 if s["failures"] else 0
    except KeyboardInterrupt:
        print("\n[loadtest] interrupted; stopping the services", file=sys.stderr)
        return 130
    finally:
        stop.set()
        for th in threads:
            th.join(5)
        stop_processes([p.popen for p in reversed(procs.values()) if p.popen], 15.0)  # the orchestrator first
        for netns in namespaces:
            netns.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m specdec_tools.loadtest", description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(cmd_loadtest(parser.parse_args()))
