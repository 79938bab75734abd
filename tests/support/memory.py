"""This process's memory, to bound what a test's requests may make it grow by."""

from __future__ import annotations

import os


def rss_mib() -> float:
    """This process's resident set size, in MiB."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
