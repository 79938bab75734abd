"""Worker pools against real worker servers: spreading, pinning, DNS discovery, adding workers.

Every worker here is a real gRPC server with its own tiny engine; only DNS is faked (a resolver
function), since this machine cannot serve a name that resolves to several addresses.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from draft_service.engine import DraftEngine
from orchestrator.client import Client
from orchestrator.config import OrchestratorConfig
from orchestrator.pool import GONE, REFUSED, SERVING, WorkerPool, pair_pools, parse_entries
from orchestrator.remote import RemoteTarget
from specdec.errors import ServiceError
from specdec.modeling import load_model
from specdec.worker.config import WorkerConfig
from target_service.engine import TargetEngine
from tests.support.reference import greedy as reference
from tests.support.servers import ADMIN_TOKEN, create_draft, create_target, start_orchestrator
from tests.support.servers import wait_for as _wait_for


@pytest.fixture(scope="module")
def workers(model_dirs):
    """Two target and two draft servers, each with an engine of its own."""
    servers = {"target": [], "draft": []}
    for role, make, create, d in (("target", TargetEngine, create_target, "target"),
                                  ("draft", DraftEngine, create_draft, "draft")):
        for _ in range(2):
            engine = make(load_model(str(model_dirs[d]), dtype="float64"))
            parts, port = create(WorkerConfig(role, "tiny", host="127.0.0.1"), engine)
            servers[role].append({"parts": parts, "address": f"127.0.0.1:{port}", "engine": engine})
    yield servers
    for role in servers.values():
        for w in role:
            w["parts"].stop(None)


@pytest.fixture(scope="module")
def orchestrator(workers):
    parts, address = start_orchestrator([w["address"] for w in workers["target"]],
                                        [w["address"] for w in workers["draft"]], poll_s=0.2)
    with Client(address, timeout_s=120, token=ADMIN_TOKEN) as client:
        client.wait_until_ready(30)
        _wait_for(lambda: [w["state"] for w in client.workers()] == [SERVING] * 4)
        yield {"parts": parts, "client": client, "address": address}
    parts.stop(None)


def test_entries_are_checked():
    assert parse_entries(" a:1, b:2 ,") == ["a:1", "b:2"]
    for bad in ("a", "a:", ":1", "a:b"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            parse_entries(bad)
    with pytest.raises(SystemExit):
        OrchestratorConfig.from_args(["--target", "nohostport"])


def test_concurrent_sessions_spread_over_both_pools_and_stay_correct(orchestrator, workers, target_engine):
    client = orchestrator["client"]
    prompts = ["def fib(n):", "import numpy", "The quick brown fox", "x = [", "class A:", "print(", "for i in", "# a"]
    ids = [target_engine.tokenizer(p).input_ids for p in prompts]
    before = {w["address"]: w["placed_sessions"] for w in client.workers()}

    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(
            lambda i: client.generate(token_ids=i, max_new_tokens=16, temperature=0, gamma=3), ids))

    for prompt_ids, r in zip(ids, results):
        assert r.token_ids == reference(target_engine, prompt_ids, 16)
    placed = {w["address"]: w["placed_sessions"] - before[w["address"]] for w in client.workers()}
    for role in ("target", "draft"):
        counts = [placed[w["address"]] for w in workers[role]]
        assert sum(counts) == len(prompts)
        assert min(counts) >= 2, f"{role} sessions were not spread: {counts}"
    # every session was closed on the worker it was pinned to
    _wait_for(lambda: all(w["engine"].describe().open_sessions == 0 for r in workers.values() for w in r))
    assert all(w["active_sessions"] == 0 and w["state"] == SERVING for w in client.workers())


def test_a_new_session_goes_to_the_least_loaded_worker(workers):
    """Load includes sessions other orchestrators hold, as the workers report it."""
    pool = WorkerPool("target", [w["address"] for w in workers["target"]], connect=RemoteTarget, poll_s=0.1)
    pair_pools(pool, None)
    pool.start()
    busy = RemoteTarget(workers["target"][0]["address"])
    try:
        pool.wait_for_member(10)
        for i in range(3):  # "another orchestrator" holds three sessions on the first target
            busy.open_session(f"elsewhere-{i}", [1, 2, 3])
        _wait_for(lambda: {m.address: m.others for m in pool.members()}[workers["target"][0]["address"]] == 3)
        chosen = [pool.acquire() for _ in range(3)]
        assert {m.address for m in chosen} == {workers["target"][1]["address"]}
        fourth = pool.acquire()  # now both hold three: ties go to the one we used least
        assert fourth.address == workers["target"][0]["address"]
        for m in chosen + [fourth]:
            pool.release(m)
    finally:
        for i in range(3):
            busy.close_session(f"elsewhere-{i}")
        busy.close()
        pool.stop()


def test_a_name_resolving_to_many_addresses_and_replicas_coming_and_going(model_dirs, target_engine):
    # two servers on one port, on two loopback addresses, as two pods behind one name would be
    first, port = create_target(WorkerConfig("target", "t", host="127.0.0.1"), target_engine)
    second, _ = create_target(WorkerConfig("target", "t", host="127.0.0.2", port=port), target_engine)
    dns = {"targets.test": [f"127.0.0.1:{port}"]}
    resolve = lambda entry: dns[entry.rpartition(":")[0]]  # noqa: E731 - the fake DNS
    pool = WorkerPool("target", [f"targets.test:{port}"], connect=RemoteTarget, resolve=resolve,
                      poll_s=0.05, resolve_s=0.1)
    pair_pools(pool, None)
    pool.start()
    try:
        pool.wait_for_member(10)
        assert [m.address for m in pool.members()] == [f"127.0.0.1:{port}"]
        dns["targets.test"] = [f"127.0.0.1:{port}", f"127.0.0.2:{port}"]  # scaled up
        _wait_for(lambda: sorted(m.state for m in pool.members()) == [SERVING, SERVING])
        held = pool.acquire()
        dns["targets.test"] = [a for a in dns["targets.test"] if a != held.address]  # that replica leaves
        _wait_for(lambda: {m.address: m.state for m in pool.members()}.get(held.address) == GONE)
        assert pool.acquire().address != held.address, "a vanished replica gets no new session"
        pool.release(held)  # its last session ends: it leaves the pool
        _wait_for(lambda: held.address not in {m.address for m in pool.members()})
    finally:
        pool.stop()
        first.stop(None)
        second.stop(None)


def test_workers_are_added_at_run_time_and_a_mismatch_is_refused(orchestrator, target_engine, model_dirs):
    client = orchestrator["client"]
    extra, port = create_target(WorkerConfig("target", "t", host="127.0.0.1"), target_engine)
    other = DraftEngine(load_model(str(model_dirs["other"])))
    wrong, wrong_port = create_draft(WorkerConfig("draft", "x", host="127.0.0.1"), other)
    try:
        client.add_workers(target=[f"127.0.0.1:{port}"], draft=[f"127.0.0.1:{wrong_port}"])
        _wait_for(lambda: {w["address"]: w["state"] for w in client.workers()}.get(f"127.0.0.1:{port}") == SERVING)
        refused = {w["address"]: w for w in client.workers()}[f"127.0.0.1:{wrong_port}"]
        assert refused["state"] == REFUSED and "tiny-other-vocab" in refused["message"]
        # requests keep working, and never land on the refused draft
        for _ in range(4):
            client.generate(prompt="hello", max_new_tokens=4, temperature=0, gamma=2)
        assert {w["address"]: w for w in client.workers()}[f"127.0.0.1:{wrong_port}"]["placed_sessions"] == 0
        with pytest.raises(ServiceError) as e:
            client.add_workers(target=["no-port"])
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        extra.stop(None)
        wrong.stop(None)


def test_workers_command_lists_the_pools(orchestrator, workers):
    admin = ["--token", ADMIN_TOKEN]  # the addresses are for admins
    out = subprocess.run([sys.executable, "-m", "orchestrator.cli", "workers", "--server", orchestrator["address"], "--json",
                          *admin], capture_output=True, text=True, timeout=60, check=True).stdout
    listed = {(w["role"], w["address"]) for w in json.loads(out)}
    assert {(role, w["address"]) for role in workers for w in workers[role]} <= listed
    table = subprocess.run([sys.executable, "-m", "orchestrator.cli", "workers", "--server", orchestrator["address"]],
                           capture_output=True, text=True, timeout=60, check=True).stdout
    assert "serving" in table and "tiny-target" in table


def test_stack_gives_each_process_its_own_metrics_port(monkeypatch):
    from specdec_tools.stack import child_env

    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "prometheus")
    monkeypatch.setenv("OTEL_EXPORTER_PROMETHEUS_PORT", "9500")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "demo")
    ports = {m: child_env(m)["OTEL_EXPORTER_PROMETHEUS_PORT"] for m in ("orchestrator", "target_service", "draft_service")}
    assert ports == {"orchestrator": "9500", "target_service": "9501", "draft_service": "9502"}
    assert child_env("draft_service")["OTEL_SERVICE_NAME"] == "demo-draft"


# ---- a worker that stops answering -----------------------------------------------------------


def test_call_deadlines_follow_the_workers_measured_pace():
    from orchestrator.remote import DEADLINE_FLOOR_S, DEADLINE_SLACK, PassClock

    clock = PassClock(ceiling_s=120.0)
    assert clock.deadline(1) == clock.deadline(4000) == 120.0, "nothing measured: the ceiling"
    clock.observe(4, 0.05)  # a decoding pass: 50 ms
    assert clock.deadline(4) == DEADLINE_FLOOR_S, "a small call gets the floor"
    assert clock.deadline(4000) == 120.0, "a prefill's pace is not known yet"
    clock.observe(2000, 2.0)  # a prefill: 1 ms a row
    assert clock.deadline(4000) == pytest.approx(DEADLINE_SLACK * (0.05 + 4000 * 0.001))
    assert clock.deadline(100_000) == 120.0, "never beyond the ceiling (--worker-timeout)"


class _Stalled:
    """A worker whose polls fail from some point on, with `error`, counting abandon_calls."""

    def __init__(self):
        self.error, self.abandoned = None, []

    def describe(self):
        from specdec.wire import ModelInfo

        if self.error is not None:
            raise self.error
        return ModelInfo("m", 8, "f", (0,), 0, 0, 64, "cpu", "float32")

    def abandon_calls(self, why):
        self.abandoned.append(why)
        return 2


def test_the_pool_cancels_the_calls_of_a_member_that_stops_answering():
    from specdec.errors import DeadlineExceeded, Unavailable

    worker = _Stalled()
    pool = WorkerPool.fixed("target", [worker])
    pool.poll()
    assert [m.state for m in pool.members()] == [SERVING] and worker.abandoned == []
    # a poll answered late (a cut link, or a busy host): no new sessions, calls still waited for ...
    worker.error = DeadlineExceeded("target worker at x:1: Deadline Exceeded")
    pool.poll()
    assert [m.state for m in pool.members()] == ["unavailable"] and worker.abandoned == []
    # ... a second one in a row: it stopped answering, its calls are given up on
    pool.poll()
    assert len(worker.abandoned) == 1 and "Deadline Exceeded" in worker.abandoned[0]
    pool.poll()  # still down: they were cancelled once
    assert len(worker.abandoned) == 1
    # back, then its connection breaks (refused, reset, a keepalive unanswered): at the first poll
    worker.error = None
    pool.poll()
    worker.error = Unavailable("target worker at x:1: failed to connect")
    pool.poll()
    assert len(worker.abandoned) == 2 and "failed to connect" in worker.abandoned[1]


def test_abandoned_calls_fail_unavailable_at_once(workers):
    """A call waiting on a worker (here its prefill, held by the test) fails UNAVAILABLE when
    abandoned, naming the worker and why, long before its deadline; the worker stays usable."""
    import threading
    import time

    server = workers["target"][0]
    engine, gate = server["engine"], threading.Event()
    original = engine.open_session

    def held(*args, **kwargs):
        gate.wait(30)
        return original(*args, **kwargs)

    engine.open_session = held
    worker = RemoteTarget(server["address"], timeout_s=60)
    outcome = {}

    def call():
        started = time.monotonic()
        try:
            worker.open_session("abandoned-1", [1, 2, 3])
        except ServiceError as exc:
            outcome["error"] = exc
        outcome["s"] = time.monotonic() - started

    try:
        thread = threading.Thread(target=call)
        thread.start()
        _wait_for(lambda: worker._calls, what="the call in flight")
        assert worker.abandon_calls("stopped answering (test)") == 1
        thread.join(10)
        error = outcome["error"]
        assert error.code == grpc.StatusCode.UNAVAILABLE
        assert server["address"] in error.message and "stopped answering (test)" in error.message
        assert outcome["s"] < 30, "it ended at the cancel, not the gate or the deadline"
    finally:
        gate.set()
        engine.open_session = original
    assert worker.open_session("abandoned-2", [1, 2, 3])[0] == 3
    worker.close_session("abandoned-2")
    worker.close()


def test_a_worker_still_starting_is_joining_and_no_news(caplog):
    """A worker that has not come up yet refuses connections: that is no fault to log at every
    start (it was an 'unavailable ... Connection refused' line between the progress bars)."""
    import logging

    from specdec.errors import Unavailable

    worker = _Stalled()
    worker.error = Unavailable("target worker at x:1: failed to connect to all addresses; Connection refused")
    pool = WorkerPool.fixed("target", [worker])
    with caplog.at_level(logging.INFO, logger="orchestrator.pool"):
        pool.poll()
        pool.poll()
        assert [(m.state, "Connection refused" in m.message) for m in pool.members()] == [("joining", True)]
        worker.error = None
        pool.poll()
    assert [m.state for m in pool.members()] == [SERVING]
    assert [r.getMessage() for r in caplog.records] == ["target pool: in-process-target-0 is serving "]


def test_a_member_whose_model_failed_to_load_is_failed_not_starting(caplog):
    """A worker whose load failed answers Describe FAILED_PRECONDITION with its reason
    (specdec/worker/server.py; tests/orchestrator/test_startup.py runs the real one): the pool keeps
    the reason, start-up stops waiting for a pool where every member failed, and a member
    restarted with a model that loads serves again."""
    import logging

    from orchestrator.pool import FAILED, JOINING, LoadFailed
    from specdec.errors import FailedPrecondition

    worker = _Stalled()
    worker.address = "x:1"
    # as the orchestrator's client raises a worker's status (specdec.errors.from_rpc_error)
    worker.error = ServiceError("draft worker at x:1: model is still loading", grpc.StatusCode.UNAVAILABLE)
    pool = WorkerPool.fixed("draft", [worker])
    with caplog.at_level(logging.INFO, logger="orchestrator.pool"):
        pool.poll()
        assert [m.state for m in pool.members()] == [JOINING]
        assert pool.progress() == "the draft worker at x:1 (model is still loading)"
        worker.error = ServiceError("draft worker at x:1: model load failed: head h was made for another target",
                                    grpc.StatusCode.FAILED_PRECONDITION)
        pool.poll()
        pool.poll()
    assert [(m.state, m.message) for m in pool.members()] == [(FAILED, worker.error.message)]
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", f"draft pool: x:1 is failed {worker.error.message}")]  # once, when it changed
    assert pool.progress() == "the draft worker at x:1 (model load failed: head h was made for another target)"
    with pytest.raises(LoadFailed) as e:  # at once: the answer is final, no start-up timeout to wait out
        pool.wait_for_member(120)
    assert e.value.message == worker.error.message

    # beside a member refused for its model, it is the refusal start-up reports (no serving without it)
    def refuse(info):
        raise FailedPrecondition("draft 'm' differs")

    mixed = WorkerPool.fixed("draft", [worker, _Stalled()])
    mixed.accept = refuse
    mixed.poll()
    assert sorted(m.state for m in mixed.members()) == [FAILED, REFUSED]
    with pytest.raises(FailedPrecondition) as e:
        mixed.wait_for_member(120)
    assert not isinstance(e.value, LoadFailed) and e.value.message == "draft 'm' differs"

    worker.error = None  # restarted, and its model loads
    pool.poll()
    assert [m.state for m in pool.members()] == [SERVING] and pool.wait_for_member(0).address == "x:1"
