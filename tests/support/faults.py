"""Faults mid-request (tests/orchestrator/test_faults.py, test_hosts_apart.py): an orchestrator in
this process whose pools serve the worker processes given, and a long streamed request whose
worker is killed after its first chunk."""

from __future__ import annotations

import signal
import time

from orchestrator.client import Client
from tests.support.servers import ADMIN_TOKEN, start_orchestrator, wait_for

LONG = 300  # tokens: enough rounds that a kill after the first chunk lands mid-request


def orchestrator_for(targets, drafts, **kwargs):
    """An orchestrator whose pools serve every worker given (the start-up waits for one of each;
    a fault test needs the others there too, or a failover finds none)."""
    parts, address = start_orchestrator([w.address for w in targets], [w.address for w in drafts],
                                        poll_s=0.2, worker_timeout_s=10, **kwargs)
    client = Client(address, timeout_s=120, token=ADMIN_TOKEN)
    addresses = {w.address for w in (*targets, *drafts)}
    wait_for(lambda: {w["address"] for w in client.workers() if w["state"] == "serving"} >= addresses,
             what="every worker serving in the pools")
    return parts, client


def holder(client, role):
    """The address of the worker of `role` holding this orchestrator's one active session."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        active = [w["address"] for w in client.workers() if w["role"] == role and w["active_sessions"]]
        if active:
            return active[0]
        time.sleep(0.01)
    raise AssertionError(f"no {role} holds a session")


def kill_mid_request(client, ids, role, workers_by_address, sig=signal.SIGKILL, **kwargs):
    """Streams a long request (greedy unless kwargs say) and kills the worker of `role` holding
    it after chunk one. For SIGKILL and SIGSTOP every worker given is frozen (SIGSTOP) as chunk
    one arrives, so the request cannot finish before the signal lands however fast the rest would
    run; the others go on once the victim has it."""
    chunks = client.stream(token_ids=ids, **{"max_new_tokens": LONG, "temperature": 0, "gamma": 3, **kwargs})
    tokens = list(next(chunks).token_ids)
    freeze = sig in (signal.SIGKILL, signal.SIGSTOP)
    for w in workers_by_address.values() if freeze else ():
        w.proc.send_signal(signal.SIGSTOP)
    victim = workers_by_address[holder(client, role)]
    victim.kill(sig)
    for w in workers_by_address.values() if freeze else ():
        if w is not victim:
            w.proc.send_signal(signal.SIGCONT)
    last = None
    for chunk in chunks:
        tokens.extend(chunk.token_ids)
        last = chunk
    return tokens, last.stats, victim
