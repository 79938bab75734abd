"""Worker faults with real processes: SIGKILL and SIGSTOP mid-request, orchestrator death,
client cancellation. Greedy output must equal the undisturbed run; nothing may leak.

Workers run as subprocesses (`python -m target_service ...`) on the tiny float64 models; the
orchestrator runs in this process, where the test can see its pools.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

import grpc
import pytest

from orchestrator.client import Client
from specdec.errors import ServiceError
from specdec_tools.stack import free_port
from tests.support.faults import LONG, holder, kill_mid_request, orchestrator_for
from tests.support.processes import WorkerProcess
from tests.support.servers import ADMIN_TOKEN, Streamed, start_orchestrator
from tests.support.servers import paced, wait_for as _eventually


@pytest.fixture
def workers(model_dirs):
    started = []

    def start(role, *extra):
        w = WorkerProcess(role, model_dirs[role], *extra)
        started.append(w)
        return w

    yield start
    for w in started:
        w.stop()


def test_draft_killed_mid_request_moves_to_the_other_draft(workers, prompt, expected):
    target = workers("target")
    drafts = [workers("draft"), workers("draft")]
    for w in (target, *drafts):
        w.wait_serving()
    parts, client = orchestrator_for([target], drafts)
    try:
        tokens, stats, victim = kill_mid_request(client, prompt, "draft", {d.address: d for d in drafts})
        assert tokens == expected
        assert stats["draft_failovers"] == 1 and stats["target_failovers"] == 0
        survivor = next(d for d in drafts if d is not victim)
        # the request finished speculating on the survivor, and closed its session there
        assert stats["drafted_tokens"] > 0
        assert survivor.open_sessions() == 0 and target.open_sessions() == 0
        # the pool knows: new requests go to the survivor only
        states = {w["address"]: w["state"] for w in client.workers()}
        assert states[victim.address] == "unavailable"
        r = client.generate(token_ids=prompt, max_new_tokens=20, temperature=0, gamma=3)
        assert r.token_ids == expected[:20] and r.stats["draft_failovers"] == 0
    finally:
        client.close()
        parts.stop(None)


def test_last_draft_killed_falls_back_to_target_only(workers, prompt, expected):
    target, draft = workers("target"), workers("draft")
    for w in (target, draft):
        w.wait_serving()
    parts, client = orchestrator_for([target], [draft])
    try:
        tokens, stats, _ = kill_mid_request(client, prompt, "draft", {draft.address: draft})
        assert tokens == expected
        assert stats["draft_failovers"] == 1
        # later rounds ran without drafts: fewer drafted tokens than rounds * gamma
        assert stats["drafted_tokens"] < 3 * stats["rounds"]
        assert target.open_sessions() == 0
    finally:
        client.close()
        parts.stop(None)


def test_stalled_draft_costs_one_round_deadline_not_the_request(workers, prompt, expected):
    target, draft = workers("target"), workers("draft")
    for w in (target, draft):
        w.wait_serving()
    parts, client = orchestrator_for([target], [draft], draft_timeout_s=1.0)
    try:
        # a stalled draft holding the request would end in the client's deadline (120 s), not here
        tokens, stats, _ = kill_mid_request(client, prompt, "draft", {draft.address: draft}, sig=signal.SIGSTOP)
        assert tokens == expected
        assert stats["draft_failovers"] == 1
    finally:
        draft.proc.send_signal(signal.SIGCONT)
        client.close()
        parts.stop(None)


def test_target_killed_mid_request_moves_to_the_other_target(workers, prompt, expected):
    targets = [workers("target"), workers("target")]
    draft = workers("draft")
    for w in (*targets, draft):
        w.wait_serving()
    parts, client = orchestrator_for(targets, [draft])
    try:
        tokens, stats, victim = kill_mid_request(client, prompt, "target", {t.address: t for t in targets})
        assert tokens == expected
        assert stats["target_failovers"] == 1 and stats["draft_failovers"] == 0
        survivor = next(t for t in targets if t is not victim)
        assert survivor.open_sessions() == 0 and draft.open_sessions() == 0
    finally:
        client.close()
        parts.stop(None)


def test_frozen_target_mid_request_moves_within_seconds_not_the_deadline(workers, prompt, expected):
    """A frozen host (SIGSTOP: its kernel keeps the connection open, nothing answers): the pool's
    poll or the keepalive finds it in seconds and the request moves, with the 120 s default
    --worker-timeout and the default 1 s polls."""
    targets = [workers("target"), workers("target")]
    draft = workers("draft")
    for w in (*targets, draft):
        w.wait_serving()
    parts, address = start_orchestrator([w.address for w in targets], [draft.address])
    client = Client(address, timeout_s=300, token=ADMIN_TOKEN)
    victim = None
    try:
        request = Streamed(client, prompt, LONG)
        request.start()
        assert request.first.wait(60)
        victim = {t.address: t for t in targets}[holder(client, "target")]
        victim.kill(signal.SIGSTOP)
        tokens, stats, stall = request.result()
        assert tokens == expected
        assert stats["target_failovers"] == 1
        assert stall < 10, f"the request stalled {stall:.1f} s (the worker's deadline, not its keepalive)"
    finally:
        if victim is not None:
            victim.proc.send_signal(signal.SIGCONT)
        client.close()
        parts.stop(None)


def test_a_coupled_request_keeps_its_seeds_output_across_a_target_failover(workers, prompt, target_engine):
    """Sampled with a seed (coupled): the new target draws each position's token from the same
    noise, so the answer is the seed's, as if nothing had happened."""
    from specdec.protocol import SamplingParams
    from tests.support.reference import coupled as coupled_reference

    params = SamplingParams(0.8, top_p=0.95)
    seed, expected = next((s, out) for s in range(20)
                          if len(out := coupled_reference(target_engine, prompt, params, s, 120)) == 120)
    targets = [workers("target"), workers("target")]
    draft = workers("draft")
    for w in (*targets, draft):
        w.wait_serving()
    parts, client = orchestrator_for(targets, [draft])
    try:
        tokens, stats, _ = kill_mid_request(client, prompt, "target", {t.address: t for t in targets},
                                            max_new_tokens=120, temperature=params.temperature, top_p=params.top_p,
                                            seed=seed)
        assert stats["target_failovers"] == 1 and stats["sampling"] == "coupled"
        assert tokens == expected
    finally:
        client.close()
        parts.stop(None)


@pytest.mark.parametrize("role", ["target", "draft"])
def test_a_controlled_request_keeps_its_output_across_a_failover(workers, prompt, target_engine, role):
    """Penalties, logit_bias and a grammar count the output from output_start: a worker that takes
    the session over mid-request (its prompt: everything so far) applies them as before, its
    grammar matcher caught up on the output so far."""
    from specdec.protocol import GrammarSpec, SamplingParams
    from tests.support.reference import controlled as controlled_reference

    controls = dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2, logit_bias={101: 1.5})
    regex = "[a-z ]{100,200}"
    params = SamplingParams(0.0, **{**controls, "logit_bias": tuple(controls["logit_bias"].items())},
                            output_start=len(prompt), grammar=GrammarSpec("regex", regex))
    expected = controlled_reference(target_engine, prompt, params, 120)
    targets, drafts = ([workers("target"), workers("target")], [workers("draft")]) if role == "target" else \
        ([workers("target")], [workers("draft"), workers("draft")])
    for w in (*targets, *drafts):
        w.wait_serving()
    parts, client = orchestrator_for(targets, drafts)
    try:
        tokens, stats, _ = kill_mid_request(client, prompt, role, {w.address: w for w in (*targets, *drafts)},
                                            max_new_tokens=120, structured_output={"regex": regex}, **controls)
        assert stats[f"{role}_failovers"] == 1
        assert tokens == expected[: len(tokens)] and len(tokens) == len(expected)
    finally:
        client.close()
        parts.stop(None)


def test_only_target_killed_gives_unavailable_not_a_hang(workers, prompt):
    target, draft = workers("target"), workers("draft")
    for w in (target, draft):
        w.wait_serving()
    parts, client = orchestrator_for([target], [draft])
    try:
        with pytest.raises(ServiceError) as e:  # UNAVAILABLE, not the client's deadline (a hang)
            kill_mid_request(client, prompt, "target", {target.address: target})
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
        assert target.address in e.value.message and "no other target" in e.value.message
        assert draft.open_sessions() == 0, "the draft session is closed even when the request fails"
        # the target comes back (same address): the pool takes it again and requests succeed
        target.start().wait_serving()
        _eventually(lambda: {w["address"]: w["state"] for w in client.workers()}[target.address] == "serving",
                    timeout_s=30)
        assert client.generate(token_ids=prompt, max_new_tokens=5, temperature=0).finish_reason == "length"
    finally:
        client.close()
        parts.stop(None)


def test_client_cancel_and_deadline_free_both_sessions(workers, prompt):
    target, draft = workers("target"), workers("draft")
    for w in (target, draft):
        w.wait_serving()
    parts, client = orchestrator_for([target], [draft])
    try:
        stream = client.stream(token_ids=prompt, max_new_tokens=LONG, temperature=0, gamma=3)
        next(stream)
        assert target.open_sessions() == 1
        stream.close()  # the client goes away
        _eventually(lambda: target.open_sessions() == 0 and draft.open_sessions() == 0)
        # a request that cannot finish before its 0.3 s deadline: each round waits for `go`
        go = threading.Event()
        original = parts.slot.decoder.generate_stream
        parts.slot.decoder.generate_stream = paced(original, lambda i: go.wait(60))
        try:
            with Client(client.address, timeout_s=0.3) as hasty, pytest.raises(ServiceError) as e:
                hasty.generate(token_ids=prompt, max_new_tokens=LONG, temperature=0, gamma=3)
            assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        finally:
            go.set()
            parts.slot.decoder.generate_stream = original
        _eventually(lambda: target.open_sessions() == 0 and draft.open_sessions() == 0)
        assert all(w["active_sessions"] == 0 for w in client.workers())
    finally:
        client.close()
        parts.stop(None)


def test_dead_orchestrator_sessions_expire_on_the_workers(workers, prompt, model_dirs):
    target, draft = workers("target", "--session-ttl", "2"), workers("draft", "--session-ttl", "2")
    for w in (target, draft):
        w.wait_serving()
    port = free_port()
    orch = subprocess.Popen([sys.executable, "-m", "orchestrator", "--host", "127.0.0.1", "--port", str(port),
                             "--target", target.address, "--draft", draft.address],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with Client(f"127.0.0.1:{port}", timeout_s=60) as c:
            c.wait_until_ready(120)
            stream = c.stream(token_ids=prompt, max_new_tokens=LONG, temperature=0, gamma=3)
            next(stream)
            orch.kill()  # mid-request: nobody will close these sessions
            orch.wait(10)
        assert target.open_sessions() + draft.open_sessions() >= 1
        _eventually(lambda: target.open_sessions() == 0 and draft.open_sessions() == 0, timeout_s=15)
    finally:
        if orch.poll() is None:
            orch.kill()


def test_sigterm_lets_the_session_finish_then_the_worker_exits(workers, prompt, expected):
    target, draft = workers("target"), workers("draft")
    spare = workers("target")
    for w in (target, draft, spare):
        w.wait_serving()
    parts, client = orchestrator_for([target, spare], [draft])
    try:
        # the request waits after its first round until the victim drains, so SIGTERM surely
        # lands while it is in flight (without the gate it could have ended before)
        go = threading.Event()
        parts.slot.decoder.generate_stream = paced(parts.slot.decoder.generate_stream,
                                                   lambda i: i > 0 or go.wait(60))
        chunks = client.stream(token_ids=prompt, max_new_tokens=LONG, temperature=0, gamma=3)
        tokens = list(next(chunks).token_ids)
        victim = {target.address: target, spare.address: spare}[holder(client, "target")]
        assert victim.open_sessions() == 1
        victim.kill(signal.SIGTERM)
        _eventually(lambda: {w["address"]: w["state"] for w in client.workers()}[victim.address] == "draining",
                    timeout_s=30)
        assert victim.open_sessions() == 1, "in flight when the drain began"
        go.set()
        for chunk in chunks:
            tokens.extend(chunk.token_ids)
            stats = chunk.stats or {}
        assert tokens == expected and stats["target_failovers"] == 0, "the draining worker finished the session"
        assert victim.proc.wait(30) == 0, "it exits cleanly once its sessions are done"
        # while it drained, it took no new session
        assert {w["address"]: w["state"] for w in client.workers()}[victim.address] in ("draining", "unavailable")
    finally:
        client.close()
        parts.stop(None)


def test_sigterm_past_the_drain_timeout_hands_the_session_to_another_target(workers, prompt, expected):
    target = workers("target", "--drain-timeout", "0.2")
    spare, draft = workers("target"), workers("draft")
    for w in (target, spare, draft):
        w.wait_serving()
    parts, client = orchestrator_for([target, spare], [draft])
    try:
        tokens, stats, victim = kill_mid_request(client, prompt, "target", {target.address: target, spare.address: spare},
                                                 sig=signal.SIGTERM)
        assert tokens == expected
        if victim is target:  # drained in 0.2 s: the session moved
            assert stats["target_failovers"] == 1
        assert victim.proc.wait(30) == 0
    finally:
        client.close()
        parts.stop(None)
