"""specdec.worker.engine: sessions with absolute, idempotent rollback without recomputation, isolation,
expiry, and engines that stop their threads."""

from __future__ import annotations

import threading

import pytest
import torch

from specdec.errors import FailedPrecondition, NotFound, OutOfRange
from specdec.protocol import SamplingParams
from tests.support.engines import fresh_logits
from tests.support.servers import wait_for

GREEDY = SamplingParams(temperature=0)


def test_truncate_then_forward_equals_fresh_computation(target_engine):
    prompt = [5, 17, 99, 3, 42, 8]
    target_engine.open_session("rollback", prompt)
    try:
        target_engine.verify("rollback", 6, [], [11, 12, 13, 14], GREEDY)  # caches 10 positions
        session = target_engine.session("rollback")
        assert session.cached == 10
        assert target_engine.truncate("rollback", 7) == 7  # keep prompt + first draft
        assert target_engine.truncate("rollback", 7) == 7  # idempotent
        assert session.cached == 7  # the accepted prefix stays cached: nothing recomputed
        session.tokens.extend([77, 78])
        logits = target_engine.run(session, 2, "verify")
        expected = fresh_logits(target_engine, [*prompt, 11, 77, 78], 2)
        torch.testing.assert_close(logits, expected, rtol=1e-9, atol=1e-9)
    finally:
        target_engine.close_session("rollback")


def test_sessions_are_isolated(target_engine):
    target_engine.open_session("a", [1, 2, 3, 4])
    target_engine.open_session("b", [50, 60])
    try:
        target_engine.verify("b", 2, [], [70, 80, 90], GREEDY)
        a = target_engine.verify("a", 4, [], [5], GREEDY)
        b = target_engine.verify("b", 2, [], [70], GREEDY)
        assert a.argmax == fresh_logits(target_engine, [1, 2, 3, 4, 5], 2).argmax(-1).tolist()
        assert b.argmax == fresh_logits(target_engine, [50, 60, 70], 2).argmax(-1).tolist()
    finally:
        target_engine.close_session("a")
        target_engine.close_session("b")


def test_session_errors(target_engine):
    with pytest.raises(NotFound):
        target_engine.verify("nope", 0, [], [], GREEDY)
    target_engine.open_session("err", [1, 2, 3])
    try:
        with pytest.raises(OutOfRange):
            target_engine.truncate("err", 4)
        with pytest.raises(FailedPrecondition):
            target_engine.verify("err", 9, [], [1], GREEDY)
    finally:
        target_engine.close_session("err")
    with pytest.raises(NotFound):
        target_engine.close_session("err")


def test_empty_session_and_gaps_are_failed_preconditions(target_engine):
    target_engine.open_session("empty", [1, 2])
    try:
        target_engine.truncate("empty", 0)
        with pytest.raises(FailedPrecondition, match="empty"):
            target_engine.verify("empty", 0, [], [3], GREEDY)
        with pytest.raises(FailedPrecondition):  # a gap, even one past the context
            target_engine.verify("empty", 10**9, [1], [], GREEDY)
        assert target_engine.verify("empty", 0, [1, 2], [], GREEDY).length == 2  # still usable
    finally:
        target_engine.close_session("empty")


def test_idle_sessions_expire(target_engine):
    from target_service.engine import TargetEngine

    engine = TargetEngine(target_engine.loaded, session_ttl_s=0.4)
    try:
        engine.open_session("idle", [1, 2, 3])
        wait_for(lambda: engine.describe().open_sessions == 0, timeout_s=30, what="the idle session's expiry")
        with pytest.raises(NotFound):
            engine.session("idle")
    finally:
        engine.close()


def test_close_stops_the_engines_threads(target_engine):
    from target_service.engine import TargetEngine

    engine = TargetEngine(target_engine.loaded, session_ttl_s=600)
    engine.open_session("s", [1, 2, 3])
    before = {t.name for t in threading.enumerate()}
    assert "session-reaper" in before and "batcher" in before  # the batcher's thread runs the passes
    reaper, batcher = engine.sessions._reaper, engine.runner.batcher._thread
    engine.close()
    engine.close()  # idempotent
    assert not reaper.is_alive() and not batcher.is_alive()
    assert engine.runner._model_thread._shutdown
    assert engine.describe().open_sessions == 0


def test_an_engine_sharing_a_model_thread_leaves_it_running(target_engine):
    from specdec.worker.runner import new_model_thread
    from target_service.engine import TargetEngine

    shared = new_model_thread()
    engine = TargetEngine(target_engine.loaded, model_thread=shared)
    engine.close()
    assert shared.submit(lambda: 42).result() == 42
    shared.shutdown()
