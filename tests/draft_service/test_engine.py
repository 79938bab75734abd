"""draft_service.engine: proposals one step each, the all-accepted round, no lock held across a yield."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import draft_service.engine as engine_module
from specdec.protocol import SamplingParams
from specdec.wire import DraftOptions
from tests.support.engines import count_passes, fresh_logits

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
    """A Propose makes all its proposals before its caller reads them, each pass taking the
    session lock and releasing it: another call on the session is not blocked by a slow reader,
    and leaves the session consistent and usable."""
    draft_engine.open_session("reader", [9, 8, 7])
    try:
        proposals = draft_engine.propose("reader", 3, [], 4, GREEDY, 0)
        assert [p.index for p in proposals] == [0, 1, 2, 3]
        done = threading.Event()
        threading.Thread(target=lambda: (draft_engine.truncate("reader", 3), done.set()), daemon=True).start()
        assert done.wait(30), "a Truncate waited for a Propose that was only being read"
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


def test_a_batched_propose_is_one_pass_a_draft_step(draft_engine, monkeypatch):
    """ProposeBatch runs as given: draft step i of every call in one pass, gamma passes in all
    (nothing waits for work to gather, so nothing depends on timing), and each call's proposals
    are those it makes alone."""
    from specdec.wire import ProposeCall

    prompts = {f"batched-{i}": [5 + i, 9, 11 + 2 * i, 4] for i in range(4)}
    alone = {name: [p.token_id for p in propose_fresh(draft_engine, name, prompt, 3)]
             for name, prompt in prompts.items()}
    for name, prompt in prompts.items():
        draft_engine.open_session(name, prompt)
    try:  # prefilled: the batch's passes are its draft steps alone
        rows = count_passes(draft_engine, monkeypatch)
        results = draft_engine.propose_batch([ProposeCall(name, len(prompt), [], 3, GREEDY, 0)
                                              for name, prompt in prompts.items()])
    finally:
        for name in prompts:
            draft_engine.close_session(name)
    assert [[p.token_id for p in r] for r in results] == list(alone.values())
    assert rows == [4, 4, 4]  # three passes of four sessions' one row each


def propose_fresh(engine, name, prompt, gamma, params=GREEDY, options=DraftOptions(), seed=0):
    engine.open_session(name, prompt)
    try:
        return list(engine.propose(name, len(prompt), [], gamma, params, seed, options))
    finally:
        engine.close_session(name)


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=1.0, top_k=4)], ids=["greedy", "sampled"])
@pytest.mark.parametrize("wrong_at", [None, 2, 0], ids=["guesses-hold", "third-guess-wrong", "first-guess-wrong"])
def test_lookup_makes_the_same_proposals_in_fewer_passes(draft_engine, monkeypatch, params, wrong_at):
    """With DraftOptions.lookup the draft runs the guessed tokens in one pass and draws each
    proposal from its q as always: the proposals (and q) are those of plain drafting with the same
    seed; only the passes are fewer, as many as the guesses that held save. The guesses here are
    the plain proposals themselves, one made wrong (a random model never repeats itself enough
    for a real lookup to hold; the bench measures real ones)."""
    prompt = [9, 8, 7, 6, 5]
    passes = count_passes(draft_engine, monkeypatch)
    plain = propose_fresh(draft_engine, "plain", prompt, 6, params, seed=5)
    assert len(passes) == 1 + 6  # the prefill, then one pass per proposal
    guesses = [p.token_id for p in plain]
    if wrong_at is not None:
        guesses[wrong_at] = (guesses[wrong_at] + 1) % draft_engine.vocab_size
    monkeypatch.setattr(engine_module.ngram, "lookup",
                        lambda tokens, k, n: guesses[len(tokens) - len(prompt):][:k])
    passes.clear()
    looked = propose_fresh(draft_engine, "lookup", prompt, 6, params, DraftOptions(lookup=3), seed=5)
    assert [p.token_id for p in looked] == [p.token_id for p in plain]
    for a, b in zip(looked, plain):
        assert (a.probs is None) == params.greedy
        if a.probs is not None:
            assert torch.allclose(a.probs.dense(), b.probs.dense(), atol=1e-6)
    # one pass up to and including the first wrong guess's position, then one for the rest
    expected = 1 if wrong_at is None else 2
    assert len(passes) - 1 == expected, f"passes {passes}"


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=1.0)], ids=["greedy", "sampled"])
def test_confidence_stop(draft_engine, params):
    """DraftOptions.p_min ends the call after the first proposal the draft gave less than p_min,
    once min_drafts are made: p_min 1 stops at min_drafts, p_min 0 never stops early."""
    prompt = [9, 8, 7, 6]
    assert len(propose_fresh(draft_engine, "never", prompt, 5, params, DraftOptions(p_min=0.0))) == 5
    assert len(propose_fresh(draft_engine, "always", prompt, 5, params, DraftOptions(p_min=1.0, min_drafts=2))) == 2
    if not params.greedy:  # every proposal before the last was confident; the last was not (or the gamma-th)
        p_min = 0.05
        made = propose_fresh(draft_engine, "some", prompt, 8, params, DraftOptions(p_min=p_min), seed=3)
        assert all(p.probs.prob_of(p.token_id) >= p_min for p in made[:-1])
        assert len(made) == 8 or made[-1].probs.prob_of(made[-1].token_id) < p_min
        assert made[-1].batch_rows >= 1 and made[-1].pass_s > 0  # the last proposal reports the passes


def wait_for(condition, timeout_s: float = 60.0) -> None:
    """Polls `condition` (generously: these machines are shared) until it holds."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition did not come about"
        time.sleep(0.01)


def draft_ahead(engine, name, prompt, gamma, params, ahead, seed=0):
    """Opens a session, proposes gamma drafts with DraftOptions(ahead=...), and waits until the
    worker has drafted `ahead` more tokens; returns (proposals, the tokens drafted ahead)."""
    options = DraftOptions(ahead=ahead)
    engine.open_session(name, prompt)
    proposals = list(engine.propose(name, len(prompt), [], gamma, params, seed, options))
    session = engine.session(name)
    end = len(prompt) + gamma
    wait_for(lambda: len(session.tokens) >= end + ahead)
    with session.lock:
        return proposals, session.tokens[end:end + ahead]


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=1.0, top_k=4)], ids=["greedy", "sampled"])
def test_drafting_ahead_hands_the_next_call_its_proposals(draft_engine, monkeypatch, params):
    """With DraftOptions.ahead the worker keeps drafting after a call's last proposal: its guess
    of the bonus token, then the next round's drafts. A call that brings that guess as the bonus
    gets those drafts at once, with no pass, each with the draft's exact q for its context."""
    prompt = [9, 8, 7, 6]
    options = DraftOptions(ahead=4)
    first, ahead = draft_ahead(draft_engine, "ahead", prompt, 3, params, 4, seed=11)
    try:
        kinds, original = [], draft_engine.runner._pass
        monkeypatch.setattr(draft_engine.runner, "_pass", lambda batch: (kinds.extend(w.kind for w, _ in batch.items),
                                                                  original(batch))[1])
        bonus = ahead[0]
        start = len(prompt) + 3
        taken_before = draft_engine.ahead_taken
        nxt = list(draft_engine.propose("ahead", start, [bonus], 3, params, 11, options))
        assert [p.token_id for p in nxt] == ahead[1:]
        assert "propose" not in kinds, f"the proposals were made ahead, yet the call ran passes: {kinds}"
        assert draft_engine.ahead_taken - taken_before == 3
        assert nxt[-1].batch_rows == 0 and nxt[-1].pass_s == 0.0  # no pass of this call to report
        seq = prompt + [p.token_id for p in first] + [bonus]
        for p in nxt:
            logits = fresh_logits(draft_engine, seq, 1)[-1]
            if params.greedy:
                assert p.probs is None and p.token_id == int(logits.argmax())
            else:  # q is the draft's distribution given exactly this context
                expected = engine_module.process_logits(logits, params, draft_engine.vocab_size)
                assert torch.allclose(p.probs.dense(), expected.dense(), atol=1e-6)
            seq.append(p.token_id)
    finally:
        draft_engine.close_session("ahead")


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=1.0, top_k=4)], ids=["greedy", "sampled"])
def test_a_bonus_other_than_the_guess_drops_what_was_drafted_ahead(draft_engine, params):
    """When the round rejected a draft, or its bonus is not the draft's guess, the call drafts
    as if nothing had been made ahead: the same proposals as a session that never drafted ahead."""
    prompt = [9, 8, 7, 6]
    first, ahead = draft_ahead(draft_engine, "dropped", prompt, 3, params, 4, seed=11)
    other = (ahead[0] + 1) % draft_engine.vocab_size
    try:
        taken_before = draft_engine.ahead_taken
        start = len(prompt) + 3
        nxt = list(draft_engine.propose("dropped", start, [other], 3, params, 7, DraftOptions(ahead=4)))
    finally:
        draft_engine.close_session("dropped")
    assert draft_engine.ahead_taken == taken_before
    plain = propose_fresh(draft_engine, "plain", prompt + [p.token_id for p in first] + [other], 3, params, seed=7)
    assert [p.token_id for p in nxt] == [p.token_id for p in plain]


def test_a_sampled_proposal_is_a_function_of_the_seed_and_its_context(draft_engine):
    """The same seed and context give the same proposals, in one call or over several, after
    drafting ahead or not; another seed gives others (the draft's draws are keyed, not a stream
    whose place depends on how much was drawn before)."""
    params, prompt = SamplingParams(temperature=1.0), [9, 8, 7, 6]
    whole = [p.token_id for p in propose_fresh(draft_engine, "whole", prompt, 6, params, seed=21)]
    first, ahead = draft_ahead(draft_engine, "parts", prompt, 2, params, 1, seed=21)
    try:  # the next call brings two tokens where one was drafted ahead: it drafts the rest itself
        rest = list(draft_engine.propose("parts", len(prompt) + 2, whole[2:4], 2, params, 21, DraftOptions()))
    finally:
        draft_engine.close_session("parts")
    assert [p.token_id for p in first] + [whole[2]] == whole[:2] + ahead
    assert [p.token_id for p in rest] == whole[4:6]
    other = [p.token_id for p in propose_fresh(draft_engine, "other", prompt, 6, params, seed=22)]
    assert other != whole


def test_drafting_ahead_stops_when_the_session_changes(draft_engine):
    """A Truncate (or any call) stops the work drafted ahead: nothing is added after it."""
    prompt = [9, 8, 7, 6]
    draft_engine.open_session("stopped", prompt)
    try:
        list(draft_engine.propose("stopped", 4, [], 2, GREEDY, 0, DraftOptions(ahead=16)))
        assert draft_engine.truncate("stopped", 4) == 4
        session = draft_engine.session("stopped")
        time.sleep(0.2)  # a job that went on would have added tokens by now (a pass takes milliseconds)
        assert len(session.tokens) == 4
    finally:
        draft_engine.close_session("stopped")
