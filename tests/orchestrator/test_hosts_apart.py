"""A draft and a target that find out whether they share hardware (specdec/hardware.py), started
with default flags as a user would: pinned to CPUs of their own they are apart, so the
orchestrator prefills both at once and the draft drafts each next round while the target
verifies; on the same cores they take turns. Greedy output stays the target's own either way."""

from __future__ import annotations

import os

import pytest

from orchestrator.client import Client
from tests.orchestrator.conftest import LONG
from tests.support.processes import WorkerProcess
from tests.support.servers import start_orchestrator

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two hosts need two CPUs")


@pytest.fixture
def pair(model_dirs):
    started = []

    def start(target_cpus=None, draft_cpus=None):
        # the workers' own defaults (--pass-lock auto), not the fault tests' "a host each, no lock"
        target = WorkerProcess("target", model_dirs["target"], "--pass-lock", "auto", cpus=target_cpus)
        draft = WorkerProcess("draft", model_dirs["draft"], "--pass-lock", "auto", cpus=draft_cpus)
        started.extend((target, draft))
        for w in (target, draft):
            w.wait_serving()
        return target, draft

    yield start
    for w in started:
        w.stop()


def _describe(worker):
    client = worker.client()
    try:
        return client.describe()
    finally:
        client.close()


def test_pinned_apart_the_draft_drafts_ahead_by_default_and_greedy_stays_exact(pair, prompt, expected):
    from specdec import hardware

    cpus = sorted(os.sched_getaffinity(0))
    target, draft = pair(str(cpus[0]), str(cpus[1]))
    t_info, d_info = _describe(target), _describe(draft)
    assert t_info.cpus == (cpus[0],) and d_info.cpus == (cpus[1],) and t_info.host_id == d_info.host_id
    assert hardware.share(t_info, d_info) is False
    parts, address = start_orchestrator([target.address], [draft.address])  # --prefill auto, --draft-ahead auto
    try:
        with Client(address, timeout_s=120) as client:
            r = client.generate(token_ids=prompt, max_new_tokens=LONG, temperature=0, gamma=3)
        assert r.token_ids == expected
        stats = r.stats
        # every round after the first was asked for ahead; with a draft this close to its target
        # most rounds keep every draft, and those find their proposals made
        assert stats["ahead_rounds"] == stats["rounds"] - 1 and stats["drafted_tokens"] > 0
        assert 0 < stats["ahead_hits"] <= stats["ahead_rounds"]
        # both prefilled at once: the draft took in the whole prompt at the start, not lazily
        assert stats["draft_prefill_tokens"] == len(prompt)
    finally:
        parts.stop(None)


def test_a_draft_killed_while_it_drafts_ahead_loses_nothing(model_dirs, prompt, expected, monkeypatch):
    """SIGKILL the draft holding the session of a request whose rounds it drafts ahead, while the
    request's next Propose (sent beside a Verify: steps._send_next) is on the wire: the draft is
    frozen as the step sends that call and killed once the call is out, so it is never answered.
    The next round finds that call failed, proposes on its own, finds the draft gone, and the
    session moves to the other draft (apart too, so drafting ahead goes on there). Greedy output
    is the undisturbed run's, and the next request is served as if nothing had happened."""
    import signal
    import threading

    import grpc

    import orchestrator.steps as steps
    from specdec.errors import ServiceError
    from tests.support.faults import LONG, orchestrator_for
    from tests.support.servers import wait_for

    cpus = sorted(os.sched_getaffinity(0))
    target = WorkerProcess("target", model_dirs["target"], "--pass-lock", "auto", cpus=str(cpus[0]))
    drafts = [WorkerProcess("draft", model_dirs["draft"], "--pass-lock", "auto", cpus=str(cpus[1])) for _ in range(2)]
    by_address = {d.address: d for d in drafts}
    armed, lost = threading.Event(), []  # lost: (the draft killed, the next call it had not answered)
    send_next = steps.StepLoop._send_next

    def kill_beside_the_verify(loop, step, live):
        ahead = [i for i in live if steps.next_call(step.states[i], step.rounds[i]) is not None]
        if not armed.is_set() or lost or not ahead:
            return send_next(loop, step, live)
        state = step.states[ahead[0]]
        member = state.placement.draft
        victim, stub, sent = by_address[member.address], member.worker._stub, threading.Event()
        propose = stub.ProposeBatch

        class Announced:  # the stub's ProposeBatch, telling when its call is on the wire
            def future(self, *args, **kwargs):
                call = propose.future(*args, **kwargs)
                sent.set()
                return call

        victim.kill(signal.SIGSTOP)  # it may take the call in, but answer nothing
        wait_for(victim.stopped, what="the draft frozen")
        stub.ProposeBatch = Announced()
        try:
            send_next(loop, step, live)
            assert state.next_call is not None and sent.wait(30), "the next Propose was not sent"
            victim.kill(signal.SIGKILL)
            lost.append((victim, state.next_call))
        finally:
            stub.ProposeBatch = propose

    monkeypatch.setattr(steps.StepLoop, "_send_next", kill_beside_the_verify)
    try:
        for w in (target, *drafts):
            w.wait_serving()
        parts, client = orchestrator_for([target], drafts)
        try:
            chunks = client.stream(token_ids=prompt, max_new_tokens=LONG, temperature=0, gamma=3)
            tokens, last = list(next(chunks).token_ids), None
            armed.set()  # the kill lands at the next step that sends a next Propose
            for chunk in chunks:
                tokens.extend(chunk.token_ids)
                last = chunk
            assert lost, "no next Propose went out after the first chunk: the test tests nothing"
            victim, call = lost[0]
            answer = call.future.result()[call.index]  # lost, not answered
            assert isinstance(answer, ServiceError) and answer.code == grpc.StatusCode.UNAVAILABLE, answer
            assert tokens == expected
            stats = last.stats
            assert stats["draft_failovers"] == 1 and stats["target_failovers"] == 0
            assert stats["ahead_hits"] > 0 and stats["drafted_tokens"] > 0
            # nothing left open, the pool knows, and the next request is served by the survivor, drafting ahead
            survivor = next(d for d in drafts if d is not victim)
            wait_for(lambda: survivor.open_sessions() == 0 and target.open_sessions() == 0,
                     what="the request's sessions closed")
            assert {w["address"]: w["state"] for w in client.workers()}[victim.address] == "unavailable"
            r = client.generate(token_ids=prompt, max_new_tokens=40, temperature=0, gamma=3)
            assert r.token_ids == expected[:40] and r.stats["draft_failovers"] == 0
            assert r.stats["ahead_rounds"] > 0  # how many rounds draft is the policy's choice
        finally:
            client.close()
            parts.stop(None)
    finally:
        for w in (target, *drafts):
            w.stop()


def test_on_the_same_cores_nothing_is_drafted_ahead_and_the_draft_opens_lazily(pair, prompt, expected):
    from specdec import hardware

    target, draft = pair()
    assert hardware.share(_describe(target), _describe(draft)) is True
    parts, address = start_orchestrator([target.address], [draft.address])
    try:
        with Client(address, timeout_s=120) as client:
            r = client.generate(token_ids=prompt, max_new_tokens=40, temperature=0, gamma=3)
        assert r.token_ids == expected[:40]
        assert r.stats["ahead_rounds"] == 0 and r.stats["drafted_tokens"] > 0
    finally:
        parts.stop(None)
