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

import os

WAIT_POLICY = "PASSIVE"


def prefer_passive_openmp() -> None:
    """Sets OMP_WAIT_POLICY=PASSIVE unless the environment already chose a policy."""
    os.environ.setdefault("OMP_WAIT_POLICY", WAIT_POLICY)
