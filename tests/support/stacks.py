"""One `specdec bench` stack for the runs of a test module that ask for the same one.

Each start of the three services costs ~15 s of CPU on this machine (each process imports torch
and transformers and builds its models), and the benchmark smoke tests check what the runs
report, not that each run had services of its own. `ReusedStacks` stands in for
`specdec_tools.stack.ProcessStack` while a module's tests run: a run asking for a stack with
the same flags as an earlier one gets that one, already serving, and its stop() stops only what
the run added (the orchestrators of other setups). The services stay the real ones.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from specdec_tools import stack as stack_module


class Reused:
    """An earlier run's ProcessStack, handed to the next run: stop() stops only what this run added
    (the orchestrators of other setups and links); the three services wait for the module's end."""

    def __init__(self, stack):
        self._stack, self._base = stack, (len(stack.commands), len(stack.extra_addresses))

    def __getattr__(self, name):
        return getattr(self._stack, name)

    def stop(self, grace_s: float = 10.0) -> None:
        stack, (commands, extra) = self._stack, self._base
        stack_module.stop_processes(stack.procs[commands:], grace_s)
        del stack.commands[commands:], stack.procs[commands:], stack.extra_addresses[extra:]


class ReusedStacks:
    def __init__(self, tmp: Path):
        self.tmp, self.stacks, self.real = tmp, {}, stack_module.ProcessStack

    def __call__(self, target_dir: str, draft_dir: str, **flags) -> Reused:
        key = repr((Path(target_dir).name, Path(draft_dir).name, sorted(flags.items())))
        if key not in self.stacks:  # the run's model directories go with its run: the stack keeps copies
            home = self.tmp / f"stack-{len(self.stacks)}"
            dirs = [str(shutil.copytree(d, home / Path(d).name)) for d in (target_dir, draft_dir)]
            self.stacks[key] = self.real(*dirs, **flags)
        return Reused(self.stacks[key])

    def stop_all(self) -> None:
        for stack in self.stacks.values():
            stack.stop()
