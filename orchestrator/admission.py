"""Which requests run now and which wait: a bounded FIFO queue in front of the decoding loop.

At most `max_running` requests decode at once (their sessions fill the workers' batches); the
next `max_queued` wait here in arrival order, their deadlines and cancellations honoured while
they wait; beyond that a request gets RESOURCE_EXHAUSTED at once, so a client backs off instead
of piling up. The gRPC server has a thread for every running and every queued request (see
orchestrator/server.py), so a waiting request costs a sleeping thread and nothing else.
"""

from __future__ import annotations

import itertools
import threading
import time
from contextlib import contextmanager
from typing import Iterator

from specdec.errors import Cancelled, DeadlineExceeded, ResourceExhausted

POLL_S = 0.1  # how often a waiting request checks that its client is still there


class Admission:
    def __init__(self, max_running: int, max_queued: int):
        self.max_running, self.max_queued = max_running, max_queued
        self.running = 0
        self._waiting: list[int] = []  # tickets, in arrival order
        self._tickets = itertools.count()
        self._cond = threading.Condition()

    @property
    def queued(self) -> int:
        return len(self._waiting)

    @contextmanager
    def slot(self, context=None) -> Iterator[None]:
        """Holds a running slot for the body; waits for one first when all are taken.
        context: the gRPC call's (is_active, time_remaining); None waits without limit."""
        self._enter(context)
        try:
            yield
        finally:
            with self._cond:
                self.running -= 1
                self._cond.notify_all()

    def _enter(self, context) -> None:
        with self._cond:
            if self.running < self.max_running and not self._waiting:
                self.running += 1
                return
            if len(self._waiting) >= self.max_queued:
                raise ResourceExhausted(f"the server is full: {self.running} requests running and {self.queued} "
                                        f"waiting (--max-running {self.max_running}, --max-queued {self.max_queued})")
            ticket = next(self._tickets)
            self._waiting.append(ticket)
            try:
                while not (self.running < self.max_running and self._waiting[0] == ticket):
                    wait = POLL_S
                    if context is not None:
                        if not context.is_active():
                            raise Cancelled("the client cancelled the request while it waited in the queue")
                        remaining = context.time_remaining()
                        if remaining is not None:
                            if remaining <= 0:
                                raise DeadlineExceeded("the request's deadline passed while it waited in the queue")
                            wait = min(wait, remaining)
                    self._cond.wait(wait)
            finally:
                self._waiting.remove(ticket)
                self._cond.notify_all()  # the next ticket may now be first
            self.running += 1

    def wait_idle(self, timeout_s: float) -> bool:
        """True once nothing runs or waits (for tests and draining)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self.running or self._waiting:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True
