"""Workers as real child processes (`python -m target_service` ...), to kill, stop and restart."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from orchestrator.remote import RemoteDraft, RemoteTarget
from specdec_tools.stack import free_port


class WorkerProcess:
    def __init__(self, role: str, model_dir, *extra: str, netns=None, cpus: str | None = None):
        """netns: a specdec_tools.netns.Netns to run in, reached at its address only. cpus: a
        taskset CPU list to pin it to (a host of its own on this machine)."""
        self.role, self.port = role, free_port()
        host = netns.address if netns is not None else "127.0.0.1"
        self.address = f"{host}:{self.port}"
        self.args = [sys.executable, "-m", f"{role}_service", "--model", str(model_dir), "--host", host,
                     "--port", str(self.port), "--dtype", "float64", "--quantize", "none",
                     # each stands for a host of its own: one frozen mid-pass (SIGSTOP) must not hold the
                     # others' passes, as the CPU locks of workers sharing cores would (specdec/hardware.py)
                     "--pass-lock", "off", *extra]
        if cpus is not None:
            self.args = ["taskset", "-c", cpus, *self.args]
        if netns is not None:
            self.args = netns.command(self.args)
        self.proc = None
        self.start()

    def start(self):
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(self.args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return self

    def client(self):
        return (RemoteTarget if self.role == "target" else RemoteDraft)(self.address, timeout_s=5)

    def wait_serving(self, timeout_s=120.0):
        worker = self.client()
        try:
            worker.wait_until_serving(timeout_s)
        finally:
            worker.close()

    def open_sessions(self) -> int:
        worker = self.client()
        try:
            return worker.describe().open_sessions
        finally:
            worker.close()

    def stopped(self) -> bool:
        """Every thread of it stopped (SIGSTOP taken): it can answer nothing until SIGCONT."""
        try:
            states = [Path(task, "stat").read_text().rpartition(")")[2].split()[0]
                      for task in Path(f"/proc/{self.proc.pid}/task").iterdir()]
        except (FileNotFoundError, IndexError):  # a thread ending as it is read
            return False
        return bool(states) and all(state in "tT" for state in states)

    def kill(self, sig=signal.SIGKILL):
        self.proc.send_signal(sig)
        if sig == signal.SIGKILL:
            self.proc.wait(10)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)
