"""OpenMP settings for processes that share CPU cores, applied before torch loads OpenMP.

OpenMP threads spin after each parallel region, waiting for more work, before they sleep; how
long is the lever. Two workers on one host (`make run`, compose on one machine, the benchmarks)
each keep a team: spinning long (GNU OpenMP's default, or OMP_WAIT_POLICY=ACTIVE), every team
slows the others (measured: four concurrent greedy requests at 0.31x the throughput of the same
four one after another; a speculative request at ACTIVE 1.07 tok/s against 15.89 at PASSIVE, the
draft's spinning team starving the target's pass). Not spinning at all (PASSIVE, the default until
issue 21) costs every one of a pass's ~200 parallel regions a sleep and a wake-up: a 1-row target
pass ran ~1.5x slower than with its threads spinning. A bounded spin between regions of one pass,
sleep once the pass is over, gives both (default pair through the three services, this 2-core
CPU, 4 prompts x 48 tokens, tok/s; one run per setting, `specdec_tools` stack as `make run`):

    GOMP_SPINCOUNT      1 client gamma 0 / 4    4 clients gamma 0 / 4
    (PASSIVE)           12.59 / 14.40           34.74 / 32.40
    20,000              15.47 / 22.67           55.54 / 43.42
    200,000             19.46 / 21.61           55.56 / 48.32   <- the default
    2,000,000           15.24 / 13.44           53.18 / 50.92

So every entry point sets GOMP_SPINCOUNT=200000 (torch's CPU wheels use GNU OpenMP) unless the
environment already chose OMP_WAIT_POLICY or GOMP_SPINCOUNT; an operator who gives a worker
cores of its own can set OMP_WAIT_POLICY=ACTIVE, and PASSIVE still works as before.

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
