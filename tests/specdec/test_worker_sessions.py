"""Worker sessions: absolute, idempotent rollback without recomputation, and isolation."""

from __future__ import annotations

import pytest
import torch

from specdec.errors import FailedPrecondition, NotFound, OutOfRange
from specdec.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0)


def fresh_logits(engine, tokens, keep):
    with torch.inference_mode():
        return engine.model(torch.tensor([tokens]), logits_to_keep=keep).logits[0]


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
        logits = target_engine.on_model_thread(target_engine.forward, session, 2, "verify")
        expected = fresh_logits(target_engine, [*prompt, 11, 77, 78], 2)
        torch.testing.assert_close(logits, expected, rtol=1e-9, atol=1e-9)
    finally:
        target_engine.close_session("rollback")


def test_verify_retry_is_harmless(target_engine):
    target_engine.open_session("retry", [1, 2, 3])
    try:
        first = target_engine.verify("retry", 3, [], [4, 5], GREEDY)
        again = target_engine.verify("retry", 3, [], [4, 5], GREEDY)
        assert first.argmax == again.argmax and again.length == 5
    finally:
        target_engine.close_session("retry")


def test_draft_all_accepted_round(draft_engine):
    """When all drafts pass, the draft never ran on its last proposal: the next round feeds it
    together with the bonus token, and the proposals match a fresh greedy run."""
    draft_engine.open_session("draft", [9, 8, 7])
    try:
        first = [p.token_id for p in draft_engine.propose("draft", 3, [], 3, GREEDY, 0)]
        session = draft_engine.session("draft")
        assert len(session.tokens) == 6 and session.cached == 5
        nxt = [p.token_id for p in draft_engine.propose("draft", 6, [100], 2, GREEDY, 0)]
        seq = [9, 8, 7, *first, 100]
        for token in nxt:
            assert token == int(fresh_logits(draft_engine, seq, 1)[-1].argmax())
            seq.append(token)
    finally:
        draft_engine.close_session("draft")


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
    import time

    from target_service.engine import TargetEngine

    engine = TargetEngine(target_engine.loaded, session_ttl_s=0.4)
    engine.open_session("idle", [1, 2, 3])
    time.sleep(1.5)
    with pytest.raises(NotFound):
        engine.session("idle")
    assert engine.describe().open_sessions == 0
