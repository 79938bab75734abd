"""OpenMP settings for processes that share CPU cores, applied before torch loads OpenMP.

By default OpenMP threads spin for a while after each parallel region, waiting for more work.
Two workers on one host (`make run`, compose on one machine, the benchmarks) each keep a team
of spinning threads, and every team slows the others: measured on the 2-core machine with the
default pair, four concurrent greedy requests ran at 0.31x the throughput of the same four one
after another; with OMP_WAIT_POLICY=PASSIVE (threads sleep when idle) 1.17x, and one request
alone got 18% faster. So every entry point makes PASSIVE the default; an operator who gives a
worker cores of its own can still set OMP_WAIT_POLICY=ACTIVE.

This module imports nothing heavy: call `prefer_passive_openmp()` before anything imports torch.
"""

from __future__ import annotations

import fcntl
import os

WAIT_POLICY = "PASSIVE"


def prefer_passive_openmp() -> None:
    """Sets OMP_WAIT_POLICY=PASSIVE unless the environment already chose a policy."""
    os.environ.setdefault("OMP_WAIT_POLICY", WAIT_POLICY)


class PassLock:
    """An exclusive lock on a file, held by a worker around each forward pass (--pass-lock).

    Workers that share cores (the draft and the target on one host) each run their passes with a
    team of as many threads as there are cores. When a draft pass and a target pass run at once,
    twice as many threads as cores take turns at every barrier and both passes crawl; that happens
    as soon as two requests are in different phases of their rounds (one drafting while the other
    verifies). With one lock file for all workers of a host, their passes take turns instead, each
    with all the cores. A path of None makes the lock a no-op (workers with hardware of their own).
    The kernel frees the lock of a worker that dies; one that is frozen mid-pass holds it.
    """

    def __init__(self, path: str | None):
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600) if path else None

    def __enter__(self) -> "PassLock":
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
