"""OpenMP settings for processes that share CPU cores, applied before torch loads OpenMP.

OpenMP threads spin after each parallel region, waiting for more work, before they sleep; how
long is the lever. Two workers on one host (`make run`, compose on one machine, the benchmarks)
each keep a team. A team that spins long (GNU OpenMP's default, or OMP_WAIT_POLICY=ACTIVE) holds
the cores the other team needs: the draft's spinning team starves the target's pass, and
concurrent requests slow each other. A team that never spins (PASSIVE) pays a sleep and a wake-up
at each of a pass's ~200 parallel regions. A bounded spin between the regions of one pass, sleep
once the pass is over, avoids both; 200,000 spins (about a millisecond) is the count chosen for the
default pair's throughput through the three services on 2 cores, one client and four, with drafts
and without.

So every entry point sets GOMP_SPINCOUNT=200000 (torch's CPU wheels use GNU OpenMP) unless the
environment already chose OMP_WAIT_POLICY or GOMP_SPINCOUNT; an operator who gives a worker
cores of its own can set OMP_WAIT_POLICY=ACTIVE, and PASSIVE still works.

This module imports nothing heavy: call `bound_openmp_spinning()` before anything imports torch.
"""

from __future__ import annotations

import os

SPIN_COUNT = "200000"


def bound_openmp_spinning() -> None:
    """Sets GOMP_SPINCOUNT (idle OpenMP threads spin about a millisecond, then sleep) unless the
    environment already chose OMP_WAIT_POLICY or GOMP_SPINCOUNT."""
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
