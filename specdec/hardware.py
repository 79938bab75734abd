"""Which hardware a worker's passes run on, and whether two workers share it.

A draft and a target that share hardware compete for it: their passes should take turns
(PassLock) and the orchestrator should prefill one after the other. A draft with hardware of
its own should work while the target verifies (it drafts ahead). Nobody has to say which: each
worker reports where it runs (ModelInfo.host_id, cpus, device_uuid in Describe) and takes a lock
for each CPU it may run on, so that workers whose CPU sets overlap take turns and others never
wait; the orchestrator compares the two reports (`share`).

The host is the kernel's boot id, which every container of one machine sees alike; CPUs are
the process's affinity set (taskset, a container's cpuset); a GPU is its UUID. A container
limited by a CPU quota rather than a cpuset sees every CPU: it counts as sharing, which costs
turn-taking at worst, never two passes fighting for the same cores.

This module imports nothing heavy.
"""

from __future__ import annotations

import fcntl
import os
import socket
import tempfile

BOOT_ID = "/proc/sys/kernel/random/boot_id"


def host_id() -> str:
    """The kernel's boot id (hostname where there is none)."""
    try:
        with open(BOOT_ID) as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def cpus() -> tuple[int, ...]:
    """The CPUs this process may run on."""
    return tuple(sorted(os.sched_getaffinity(0)))


def share(a, b) -> bool | None:
    """Whether the workers that describe themselves as a and b (ModelInfo) run on the same
    hardware: one host and overlapping CPUs (both on CPU) or the same GPU. None: one of them did
    not say (a worker of an older version), or no draft."""
    if a is None or b is None or not a.host_id or not b.host_id:
        return None
    if a.host_id != b.host_id:
        return False
    if a.device_uuid or b.device_uuid:
        return a.device_uuid == b.device_uuid
    return bool(set(a.cpus) & set(b.cpus))


def lock_paths(cpu_ids: tuple[int, ...], directory: str | None = None) -> list[str]:
    """One lock file per CPU, in a folder of this user's: workers of one user on one host that
    may run on a CPU lock its file around each pass."""
    folder = os.path.join(directory or tempfile.gettempdir(), f"specdec-{os.getuid()}")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    return [os.path.join(folder, f"cpu{i}.lock") for i in sorted(cpu_ids)]


class PassLock:
    """Exclusive locks on files, held by a worker around each forward pass (--pass-lock).

    Workers that share cores (the draft and the target on one host) each run their passes with a
    team of as many threads as there are cores. When a draft pass and a target pass run at once,
    twice as many threads as cores take turns at every barrier and both passes crawl; that happens
    as soon as two requests are in different phases of their rounds (one drafting while the other
    verifies). With a lock file per CPU, workers whose CPU sets overlap hold a common lock around
    each pass, and their passes take turns, each with all its cores; workers on disjoint CPUs
    never wait for each other. Locks are taken in the order of their paths (no two workers wait
    for each other's). No paths: a no-op (a GPU worker). The kernel frees the locks of a worker
    that dies; one frozen mid-pass holds them.
    """

    def __init__(self, paths: list[str]):
        self.paths = list(paths)
        self._fds = [os.open(p, os.O_RDWR | os.O_CREAT, 0o600) for p in sorted(self.paths)]

    @classmethod
    def from_flag(cls, value: str | None, on_cpu: bool) -> "PassLock":
        """--pass-lock: "auto" (on CPU: a lock per CPU this process may run on; on a GPU none),
        "off", or one file that every worker given it locks."""
        if value in (None, "", "off") or value == "auto" and not on_cpu:
            return cls([])
        return cls(lock_paths(cpus()) if value == "auto" else [value])

    def __enter__(self) -> "PassLock":
        for fd in self._fds:
            fcntl.flock(fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        for fd in reversed(self._fds):
            fcntl.flock(fd, fcntl.LOCK_UN)

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []
