"""Network namespaces for partition tests (tests/orchestrator/test_partitions.py, `specdec bench load
--partitions`): a worker on a host of its own, reached over a real link that can be cut.

Each Netns is a separate network stack (`ip netns`) joined to this one by a veth pair, an
address at each end of a /30. `cut()` takes the link down at the namespace's end: packets in
flight and sent later vanish and nothing resets a connection, as when a switch dies or a
security group changes; `heal()` brings it back. Needs root and a kernel with network
namespaces (CI's machine has both); `unavailable()` says why not.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from functools import lru_cache

_serial = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


@lru_cache(maxsize=1)
def unavailable() -> str | None:
    """Why this machine cannot run partition tests (None when it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    probe = Netns.__new__(Netns)
    try:
        probe.__init__()
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        return f"cannot make a network namespace here: {detail.strip()}"
    probe.close()
    return None


class Netns:
    """A namespace `name` whose end of the link has address `address` (this end: `gateway`)."""

    def __init__(self):
        n = next(_serial)
        tag = f"{os.getpid() % 100000}x{n}"
        self.name = f"specdec-{tag}"
        self.host_link, self.ns_link = f"sdh{tag}"[:15], f"sdn{tag}"[:15]
        # a /30 per namespace, in a block unlikely to be routed here: 10.<pid-ish>.<n>.0
        octet2, octet3 = 100 + os.getpid() % 100, n % 256
        self.gateway, self.address = f"10.{octet2}.{octet3}.1", f"10.{octet2}.{octet3}.2"
        _ip("netns", "add", self.name)
        try:
            _ip("link", "add", self.host_link, "type", "veth", "peer", "name", self.ns_link)
            _ip("link", "set", self.ns_link, "netns", self.name)
            _ip("addr", "add", f"{self.gateway}/30", "dev", self.host_link)
            _ip("link", "set", self.host_link, "up")
            _ip("-n", self.name, "addr", "add", f"{self.address}/30", "dev", self.ns_link)
            _ip("-n", self.name, "link", "set", self.ns_link, "up")
            _ip("-n", self.name, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def command(self, argv: list[str]) -> list[str]:
        """argv run inside the namespace (the same process: `ip netns exec` execs it)."""
        return ["ip", "netns", "exec", self.name, *argv]

    def cut(self) -> None:
        _ip("-n", self.name, "link", "set", self.ns_link, "down")

    def heal(self) -> None:
        _ip("-n", self.name, "link", "set", self.ns_link, "up")

    def close(self) -> None:
        """Removes the namespace and its link (processes still inside keep running, unreachable)."""
        _ip("netns", "del", self.name, check=False)
        _ip("link", "del", self.host_link, check=False)
