"""orchestrator/pool.py: how often the monitor asks the members (a fake worker: only the polling
rhythm is under test, not a worker)."""

from __future__ import annotations

from types import SimpleNamespace

from orchestrator.pool import JOINING, JOINING_POLL_S, SERVING, WorkerPool
from specdec.errors import Unavailable


class Starting:
    """A worker that refuses connections while it starts, then answers."""

    def __init__(self, refusals: int):
        self.refusals = refusals

    def describe(self):
        if self.refusals:
            self.refusals -= 1
            raise Unavailable("connection refused")
        return SimpleNamespace(draining=False, open_sessions=0)


def test_a_member_that_has_not_answered_yet_is_asked_again_within_a_second_whatever_the_poll_interval():
    """With --poll-interval 30 a worker that was still starting when the orchestrator first asked
    used to wait 30 s more to be found serving (a benchmark's orchestrators behind links did)."""
    worker = Starting(refusals=2)
    pool = WorkerPool("draft", ["127.0.0.1:1"], connect=lambda address, **_: worker, resolve=lambda e: [e],
                      poll_s=30.0)
    pool._resolve_entries(["127.0.0.1:1"])
    for _ in range(2):
        pool.poll()
        assert [m.state for m in pool.members()] == [JOINING] and pool.next_poll_s() == JOINING_POLL_S
    pool.poll()
    assert [m.state for m in pool.members()] == [SERVING] and pool.next_poll_s() == 30.0
