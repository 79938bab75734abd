"""An in-process draft engine that fails on cue: the fault tests' stand-in for a worker that goes
away mid-request, where a real one cannot be cut at an exact step."""

from __future__ import annotations

import time

from specdec.errors import Unavailable


class FailingDraft:
    """The engine, but its `at`-th propose_batch waits `stall_s`, then fails UNAVAILABLE for every call."""

    def __init__(self, engine, at: int = 3, stall_s: float = 0.0):
        self.engine, self.at, self.stall_s, self.calls = engine, at, stall_s, 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def propose_batch(self, calls):
        self.calls += 1
        if self.calls == self.at:
            time.sleep(self.stall_s)
            return [Unavailable("draft worker at x:1 stopped answering")] * len(calls)
        return self.engine.propose_batch(calls)
