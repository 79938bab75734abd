"""Whether two workers share hardware (specdec/hardware.py): what they report, how the
orchestrator reads it, and the per-CPU pass locks that make workers sharing cores take turns."""

from __future__ import annotations

import os
import threading

import pytest

from specdec import hardware
from specdec.hardware import PassLock, lock_paths
from specdec.wire import ModelInfo


def info(host="h", cpus=(0, 1), uuid=""):
    return ModelInfo("m", 10, "f", (1,), -1, -1, 64, "cuda:0" if uuid else "cpu", "float32", host_id=host,
                     cpus=tuple(cpus), device_uuid=uuid)


@pytest.mark.parametrize("a,b,shared", [
    (info(), info(), True),  # one host, every core
    (info(cpus=(0,)), info(cpus=(1,)), False),  # pinned apart: two hosts on one machine
    (info(cpus=(0, 1)), info(cpus=(1, 2)), True),  # one core in common is enough to fight over
    (info(host="a"), info(host="b"), False),  # two machines
    (info(uuid="GPU-1"), info(uuid="GPU-1"), True),  # one GPU
    (info(uuid="GPU-1"), info(uuid="GPU-2"), False),
    (info(), info(uuid="GPU-2"), False),  # a CPU draft beside a GPU target
    (info(host=""), info(), None),  # a worker that does not say
])
def test_two_workers_share_hardware_where_their_reports_overlap(a, b, shared):
    assert hardware.share(a, b) is shared and hardware.share(b, a) is shared


def test_this_process_reports_its_machine_and_cpus():
    assert hardware.host_id() == hardware.host_id() != ""
    assert set(hardware.cpus()) == os.sched_getaffinity(0)


def test_model_info_carries_the_report_over_the_wire():
    sent = info(host="boot-1", cpus=(0, 3))
    got = ModelInfo.from_proto(sent.to_proto())
    assert got == sent and hardware.share(got, sent)


def _blocks(first: PassLock, second: PassLock) -> bool:
    """Whether `second` waits while `first` is held."""
    entered = threading.Event()

    def other_worker():
        with second:
            entered.set()

    with first:
        thread = threading.Thread(target=other_worker)
        thread.start()
        blocked = not entered.wait(0.3)
    thread.join(10)
    assert entered.is_set()
    return blocked


def test_workers_whose_cpus_overlap_take_turns_and_others_never_wait(tmp_path):
    def lock(*cpus):
        return PassLock(lock_paths(cpus, str(tmp_path)))

    assert _blocks(lock(0, 1), lock(1, 2)), "a pass on CPU 1 ran while another worker on CPU 1 held it"
    assert not _blocks(lock(0), lock(1)), "a worker on CPU 1 waited for one on CPU 0"
    # the same CPUs taken in opposite orders by many threads: locks go in path order, so none deadlocks
    a, b = lock(2, 3), lock(3, 2)
    done = []

    def run(held):
        for _ in range(200):
            with held:
                pass
        done.append(1)

    threads = [threading.Thread(target=run, args=(held,)) for held in (a, b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert len(done) == 2


def test_the_flag_auto_locks_this_process_cpus_and_nothing_on_a_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    auto = PassLock.from_flag("auto", on_cpu=True)
    assert [os.path.basename(p) for p in auto.paths] == [f"cpu{i}.lock" for i in sorted(os.sched_getaffinity(0))]
    assert all(p.startswith(str(tmp_path)) for p in auto.paths)
    one = PassLock.from_flag(str(tmp_path / "mine.lock"), on_cpu=True)
    assert one.paths == [str(tmp_path / "mine.lock")]
    for value, on_cpu in (("auto", False), ("off", True), ("", True), (None, True)):
        with PassLock.from_flag(value, on_cpu) as nothing:  # a no-op
            assert nothing.paths == []
    for held in (auto, one):
        held.close()
