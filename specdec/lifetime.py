"""A supervised child process dies with its supervisor (`specdec serve`), however that dies.

The supervisor names itself in SPECDEC_SUPERVISOR_PID; each entry point calls
`die_with_supervisor()` first thing, which asks Linux for SIGTERM when the parent dies
(PR_SET_PDEATHSIG) and exits at once if the parent is already gone. Done here, after exec, rather
than in a Popen preexec_fn: the supervisor has threads (its readiness probes, gRPC's own), and a
child forked from a threaded process may deadlock in Python code before it execs (a lock another
thread held at fork stays held in the child).

A service also looks every second whether its supervisor is still its parent
(`supervisor_gone`, from specdec/grpc_server.py's wait for a signal): with the kernel's SIGTERM
alone, a killed `specdec serve` left a child running in about one test run in five (the child's
Python handler never ran).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

SUPERVISOR_ENV = "SPECDEC_SUPERVISOR_PID"
PR_SET_PDEATHSIG = 1
_supervisor: int | None = None  # the pid of the `specdec serve` that started this process, if one did


def die_with_supervisor() -> None:
    """SIGTERM to this process when the supervisor that started it dies (Linux; elsewhere the
    supervisor's SIGINT/SIGTERM handling still stops its children)."""
    global _supervisor
    supervisor = os.environ.pop(SUPERVISOR_ENV, None)  # not inherited by this process's own children
    if not supervisor or not sys.platform.startswith("linux"):
        return
    _supervisor = int(supervisor)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if supervisor_gone():  # the supervisor died before prctl took effect
        sys.exit(1)


def supervisor_gone() -> bool:
    """Whether this process was started by a supervisor that has since died (its parent changed)."""
    return _supervisor is not None and os.getppid() != _supervisor
