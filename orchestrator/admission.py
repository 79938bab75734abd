"""Which requests run now and which wait: a bounded FIFO queue in front of the decoding loop.

At most `max_running` requests decode at once (their sessions fill the workers' batches); the
next `max_queued` wait here in arrival order, their deadlines and cancellations honoured while
they wait; beyond that a request gets RESOURCE_EXHAUSTED at once, so a client backs off instead
of piling up. The gRPC server has a thread for every running and every queued request (see
orchestrator/server.py), so a waiting request costs a sleeping thread and nothing else.

With `max_per_client`, one client (its bearer token, else its IP address) holds at most that
many requests, running and waiting together; its next gets RESOURCE_EXHAUSTED at once, so a
few slow clients cannot occupy every slot.
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
    def __init__(self, max_running: int, max_queued: int, max_per_client: int = 0):
        self.max_running, self.max_queued = max_running, max_queued
        self.max_per_client = max_per_client  # 0: no limit per client
        self._per_client: dict[str, int] = {}
        self.running = 0
        self._waiting: list[int] = []  # tickets, in arrival order
        self._tickets = itertools.count()
        self._cond = threading.Condition()

    @property
    def queued(self) -> int:
        return len(self._waiting)

    @contextmanager
    def slot(self, context=None, client: str = "") -> Iterator[None]:
        """Holds a running slot for the body; waits for one first when all are taken.
        context: the gRPC call's (is_active, time_remaining); None waits without limit.
        client: who asks (see client_key), for max_per_client."""
        self._hold(client)
        try:
            self._enter(context)
        except BaseException:
            self._let_go(client)
            raise
        try:
            yield
        finally:
            with self._cond:
                self.running -= 1
                self._cond.notify_all()
            self._let_go(client)

    def _hold(self, client: str) -> None:
        if not self.max_per_client:
            return
        with self._cond:
            held = self._per_client.get(client, 0)
            if held >= self.max_per_client:
                raise ResourceExhausted(f"this client already has {held} requests running or waiting "
                                        f"(--max-per-client {self.max_per_client})")
            self._per_client[client] = held + 1

    def _let_go(self, client: str) -> None:
        if not self.max_per_client:
            return
        with self._cond:
            left = self._per_client.get(client, 1) - 1
            if left:
                self._per_client[client] = left
            else:
                self._per_client.pop(client, None)

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


NO_DEADLINE_S = 1e9  # a "remaining time" beyond this (about 30 years) means no deadline


class CallDeadline:
    """A call's deadline: the client's, else the server's default (--request-timeout), so a
    client that sets none cannot hold a slot for ever. Wraps a gRPC context (or the HTTP door's
    call) and quacks like one for the queue (is_active, time_remaining)."""

    def __init__(self, context, default_s: float):
        self.context = context
        client = context.time_remaining()  # gRPC gives ~9.2e18 s, not None, when the client set none
        self.own = (client is None or client > NO_DEADLINE_S) and default_s > 0  # the server's, not the client's
        self.expires = time.monotonic() + default_s if self.own else None

    def is_active(self) -> bool:
        return self.context.is_active()

    def time_remaining(self) -> float | None:
        if self.own:
            return self.expires - time.monotonic()
        return self.context.time_remaining()

    def check(self) -> None:
        if self.own and time.monotonic() > self.expires:
            raise DeadlineExceeded("the request ran past the server's deadline (--request-timeout); "
                                   "set a deadline of your own, or ask for fewer tokens")


def client_key(token: bytes | None, peer: str) -> str:
    """Who a request comes from: its bearer token (hashed: keys may be logged), else the host of
    its gRPC peer ("ipv4:10.0.0.7:51234" -> "ipv4:10.0.0.7"; HTTP passes "http:HOST")."""
    if token:
        import hashlib

        return "token:" + hashlib.sha256(token).hexdigest()[:16]
    return peer.rsplit(":", 1)[0] if peer.count(":") >= 2 else peer
