"""draft_service.engine: proposals one step each, the all-accepted round, no lock held across a yield."""

from __future__ import annotations

import threading

import pytest

from specdec.errors import Aborted
from specdec.protocol import SamplingParams
from tests.specdec.worker.test_engine import fresh_logits

GREEDY = SamplingParams(temperature=0)


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


def test_propose_holds_no_lock_while_its_caller_reads(draft_engine):
    """The session lock is taken per step, not across a yield: another call on the session is
    not blocked by a slow reader, and the Propose it interrupted stops with ABORTED."""
    draft_engine.open_session("reader", [9, 8, 7])
    try:
        proposals = draft_engine.propose("reader", 3, [], 4, GREEDY, 0)
        next(proposals)  # the caller holds the generator between proposals
        done = threading.Event()
        threading.Thread(target=lambda: (draft_engine.truncate("reader", 3), done.set()), daemon=True).start()
        assert done.wait(30), "a Truncate waited for a Propose that was only being read"
        with pytest.raises(Aborted):
            next(proposals)
        # the session is consistent and usable again
        assert [p.index for p in draft_engine.propose("reader", 3, [], 2, GREEDY, 0)] == [0, 1]
    finally:
        draft_engine.close_session("reader")


def test_the_last_proposal_reports_the_rows_and_seconds_of_its_passes(draft_engine):
    """The gamma policy fits pass seconds against rows: the last proposal carries both (means over
    the call's steps), the others neither."""
    draft_engine.open_session("timed", [9, 8, 7])
    try:
        proposals = list(draft_engine.propose("timed", 3, [], 3, GREEDY, 0))
    finally:
        draft_engine.close_session("timed")
    *earlier, last = proposals
    assert all(p.batch_rows == 0 and p.pass_s == 0.0 for p in earlier)
    assert last.batch_rows >= 1 and 0 < last.pass_s <= sum(p.compute_s for p in proposals)
