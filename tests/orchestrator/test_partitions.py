"""Partitions over real links: workers on hosts of their own (network namespaces, each reached
over a veth link), links cut mid-request. A cut link resets nothing: packets just vanish, as when
a switch dies or a host freezes, so only the orchestrator's keepalive pings and its pool's polls
can tell. Greedy output must equal the undisturbed run; the stall a cut causes is bounded by
seconds (the keepalive and the poll), not by the 120 s worker deadline.

The orchestrator runs in this process with the documented defaults (1 s polls, 2 s keepalive,
120 s --worker-timeout). Skipped where network namespaces are unavailable (not root); the
frozen-worker tests of test_faults.py cover the same paths without them.
"""

from __future__ import annotations

import time

import pytest

from orchestrator.client import Client
from tests.orchestrator.conftest import LONG
from specdec_tools.netns import Netns, unavailable
from tests.support.processes import WorkerProcess
from tests.support.servers import ADMIN_TOKEN, Streamed, start_orchestrator, wait_for

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=f"partition tests: {unavailable()}")

# the bounds (the targets): a cut costs an in-flight request at most STALL_S beyond its
# replay; a healed worker serves in its pool again within REJOIN_S
STALL_S = 10.0
REJOIN_S = 10.0


@pytest.fixture
def hosts(model_dirs):
    """hosts(role) -> a worker process in a namespace of its own, and the namespace."""
    made: list[tuple[WorkerProcess, Netns]] = []

    def start(role, *extra):
        ns = Netns()
        try:
            w = WorkerProcess(role, model_dirs[role], *extra, netns=ns)
        except BaseException:
            ns.close()
            raise
        made.append((w, ns))
        return w, ns

    yield start
    for w, ns in made:
        w.stop()
        ns.close()


def orchestrator_for(targets, drafts):
    parts, address = start_orchestrator([w.address for w in targets], [w.address for w in drafts])
    return parts, Client(address, timeout_s=300, token=ADMIN_TOKEN)


def states(client) -> dict[str, str]:
    return {w["address"]: w["state"] for w in client.workers()}


def test_a_cut_target_under_two_requests_costs_seconds_not_the_deadline(hosts, prompt, expected):
    (victim, link), (spare, _) = hosts("target"), hosts("target")
    draft, _ = hosts("draft")
    for w in (victim, spare, draft):
        w.wait_serving()
    # both requests on the victim: the spare joins the pool once they hold their sessions there
    parts, client = orchestrator_for([victim], [draft])
    try:
        streams = [Streamed(client, prompt, LONG), Streamed(client, prompt[:-1], LONG)]
        for s in streams:
            s.start()
            assert s.first.wait(60)
        client.add_workers(target=[spare.address])
        wait_for(lambda: states(client).get(spare.address) == "serving", 30, "the spare serving")
        link.cut()
        cut = time.monotonic()
        for s, want in zip(streams, (expected, None)):
            tokens, stats, stall = s.result()
            assert stats["target_failovers"] == 1, stats
            if want is not None:
                assert tokens == want
            assert stall < STALL_S, f"a request stalled {stall:.1f} s after the cut"
        assert time.monotonic() - cut < STALL_S + 30, "the requests ended long after the cut"
        assert states(client)[victim.address] == "unavailable"
        # the second request's output is the undisturbed run's too
        again = client.generate(token_ids=prompt[:-1], max_new_tokens=LONG, temperature=0, gamma=3)
        assert streams[1].tokens == list(again.token_ids)
        # the link heals: the victim is back in its pool within seconds, and takes sessions
        link.heal()
        healed = time.monotonic()
        wait_for(lambda: states(client)[victim.address] == "serving", 60, "the healed target serving")
        assert time.monotonic() - healed < REJOIN_S
    finally:
        client.close()
        parts.stop(None)


def test_a_cut_draft_mid_request_goes_on_within_seconds(hosts, prompt, expected):
    (target, _), (draft, link) = hosts("target"), hosts("draft")
    for w in (target, draft):
        w.wait_serving()
    parts, client = orchestrator_for([target], [draft])
    try:
        s = Streamed(client, prompt, LONG)
        s.start()
        assert s.first.wait(60)
        link.cut()
        tokens, stats, stall = s.result()
        assert tokens == expected
        assert stats["draft_failovers"] == 1, stats
        assert stall < STALL_S, f"the request stalled {stall:.1f} s after the draft's cut"
        link.heal()
        healed = time.monotonic()
        wait_for(lambda: states(client)[draft.address] == "serving", 60, "the healed draft serving")
        assert time.monotonic() - healed < REJOIN_S
        r = client.generate(token_ids=prompt, max_new_tokens=40, temperature=0, gamma=3)
        assert list(r.token_ids) == expected[:40] and r.stats["drafted_tokens"] > 0
    finally:
        client.close()
        parts.stop(None)


def test_a_new_request_during_a_partition_is_not_delayed(hosts, prompt, expected):
    (cut_off, link), (healthy, _) = hosts("target"), hosts("target")
    draft, draft_link = hosts("draft")
    for w in (cut_off, healthy, draft):
        w.wait_serving()
    parts, client = orchestrator_for([cut_off, healthy], [draft])
    try:
        started = time.monotonic()
        client.generate(token_ids=prompt, max_new_tokens=40, temperature=0, gamma=3)
        undisturbed = time.monotonic() - started
        link.cut()
        draft_link.cut()
        wait_for(lambda: states(client)[cut_off.address] == states(client)[draft.address] == "unavailable", 30,
                 "the pool seeing the cuts")
        started = time.monotonic()
        r = client.generate(token_ids=prompt, max_new_tokens=40, temperature=0, gamma=3)
        during = time.monotonic() - started
        assert list(r.token_ids) == expected[:40]
        assert r.stats["target_failovers"] == 0, "placed on the healthy target from the start"
        assert during < undisturbed + 2.0, f"{during:.1f} s during the partition against {undisturbed:.1f} s"
    finally:
        client.close()
        parts.stop(None)
