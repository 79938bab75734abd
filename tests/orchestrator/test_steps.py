"""The step loop (orchestrator/steps.py) and the batched calls it makes (ProposeBatch, VerifyBatch):
requests that run together give what each gives alone, whatever joins and leaves between steps;
one call per worker per step carries them all; a bad call fails alone."""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from orchestrator.decoder import SpeculativeDecoder
from orchestrator.gamma import CATCH_UP_LAG, GammaPolicy, StepRecord
from orchestrator.remote import RemoteDraft, RemoteTarget
from specdec.errors import ServiceError
from specdec.protocol import GenerationRequest, SamplingParams
from specdec.wire import ProposeCall, VerifyCall
from specdec.worker.config import WorkerConfig
from tests.support.servers import (HOST, client_of, create_draft, create_target, start_orchestrator, start_stack,
                                   stop_stack, wait_for)

GREEDY = SamplingParams(temperature=0)


def _requests() -> list[GenerationRequest]:
    """Eight greedy requests of different prompt lengths, gammas and lengths: they leave the loop
    at different steps."""
    return [GenerationRequest(token_ids=[30 + i] * (2 + 4 * i) + [7, 9], max_new_tokens=6 + 3 * i, temperature=0,
                              gamma=i % 5) for i in range(8)]


def _staggered(generate, requests, gap_s: float = 0.02) -> list[list[int]]:
    """Runs the requests at once, each starting a little after the one before (joins between steps)."""
    def run(i):
        time.sleep(i * gap_s)
        return generate(requests[i])

    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(run, range(len(requests))))


def test_requests_joining_and_leaving_the_step_loop_give_what_each_gives_alone(target_engine, draft_engine):
    looped = SpeculativeDecoder(target_engine, draft_engine)
    try:
        requests = _requests()
        expected = [looped.generate(r).token_ids for r in requests]  # one at a time: each alone in the loop
        together = _staggered(lambda r: looped.generate(r).token_ids, requests)
        assert together == expected
        assert sum(loop.steps for loop in looped.steps._loops.values()) > 0
    finally:
        looped.close()


def test_one_verify_call_per_step_carries_every_request(target_engine, draft_engine):
    """Four requests that start together: once all have joined, each step sends one VerifyBatch
    holding all four, and one ProposeBatch whose draft steps share passes."""
    sizes: list[int] = []
    original = target_engine.verify_batch

    class Counting:
        def __getattr__(self, name):
            return getattr(target_engine, name)

        def verify_batch(self, calls):
            sizes.append(len(calls))
            return original(calls)

    decoder = SpeculativeDecoder(Counting(), draft_engine)
    requests = [GenerationRequest(token_ids=[50 + i, 3, 4], max_new_tokens=12, temperature=0, gamma=3)
                for i in range(4)]
    try:
        shared_before = draft_engine.runner.batcher.shared_passes
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(decoder.generate, requests))
        rounds = sum(r.stats["rounds"] for r in results)
    finally:
        decoder.close()
    assert max(sizes) == 4, sizes
    assert len(sizes) < rounds, (sizes, rounds)  # fewer calls than rounds: steps carried several
    assert draft_engine.runner.batcher.shared_passes > shared_before


def test_a_batched_propose_runs_draft_step_i_of_every_session_in_one_pass(draft_engine):
    ids = [f"pb-{i}" for i in range(4)]
    for i, sid in enumerate(ids):
        draft_engine.open_session(sid, [60 + i, 1, 2, 3])
    try:
        passes = draft_engine.runner.batcher.passes
        results = draft_engine.propose_batch([ProposeCall(sid, 4, [], 3, GREEDY, 7) for sid in ids])
        assert [len(r) for r in results] == [3, 3, 3, 3]
        assert draft_engine.runner.batcher.passes - passes == 3  # not 12
        # each session's proposals are what it proposes alone
        for sid, got in zip(ids, results):
            alone = list(draft_engine.propose(sid, 4, [], 3, GREEDY, 7))
            assert [p.token_id for p in alone] == [p.token_id for p in got]
    finally:
        for sid in ids:
            draft_engine.close_session(sid)


@pytest.fixture(scope="module")
def workers(target_engine, draft_engine):
    target, tport = create_target(WorkerConfig("target", "tiny", host=HOST), target_engine)
    draft, dport = create_draft(WorkerConfig("draft", "tiny", host=HOST), draft_engine)
    yield f"{HOST}:{tport}", f"{HOST}:{dport}"
    target.stop(None)
    draft.stop(None)


def test_a_bad_call_in_a_batch_fails_alone_with_its_own_status(workers):
    target_address, draft_address = workers
    target, draft = RemoteTarget(target_address), RemoteDraft(draft_address)
    target.describe(), draft.describe()
    other = RemoteTarget(target_address)  # another orchestrator: it does not hold the sessions' secrets
    try:
        for sid in ("bad-a", "bad-b"):
            target.open_session(sid, [5, 6, 7])
            draft.open_session(sid, [5, 6, 7])
        results = target.verify_batch([
            VerifyCall("bad-a", 3, [], [8], GREEDY), VerifyCall("nobody", 0, [1], [], GREEDY),
            VerifyCall("bad-a", 3, [], [8], GREEDY), VerifyCall("bad-b", 3, [], [9, 9], GREEDY),
            VerifyCall("bad-b", 3, [], [1] * 100, GREEDY)])
        assert len(results[0].argmax) == 2
        assert isinstance(results[1], ServiceError) and results[1].code == grpc.StatusCode.NOT_FOUND
        assert isinstance(results[2], ServiceError) and results[2].code == grpc.StatusCode.INVALID_ARGUMENT
        assert "twice" in str(results[2])
        assert len(results[3].argmax) == 3
        assert isinstance(results[4], ServiceError)  # the same session again: refused, not run
        stolen = other.verify_batch([VerifyCall("bad-a", 4, [], [], GREEDY)])
        assert isinstance(stolen[0], ServiceError) and stolen[0].code in (grpc.StatusCode.NOT_FOUND,
                                                                          grpc.StatusCode.PERMISSION_DENIED)
        proposals = draft.propose_batch([ProposeCall("bad-a", 3, [], 2, GREEDY, 1),
                                         ProposeCall("bad-b", 3, [], 99, GREEDY, 1)])
        assert len(proposals[0]) == 2
        assert isinstance(proposals[1], ServiceError) and proposals[1].code == grpc.StatusCode.INVALID_ARGUMENT
        # the worker stays healthy: the sessions go on
        assert len(target.verify_batch([VerifyCall("bad-a", 4, [], [], GREEDY)])[0].argmax) == 1
    finally:
        for sid in ("bad-a", "bad-b"):
            target.close_session(sid)
            draft.close_session(sid)
        target.close(), draft.close(), other.close()


def test_through_grpc_concurrent_requests_equal_one_at_a_time(target_engine, draft_engine):
    stack = start_stack(target_engine, draft_engine)
    prompts = ["def fib(n):", "import os\n", "The quick brown fox", "x = [", "class A:", "for i in"]
    try:
        with client_of(stack["address"]) as client:
            def run(i):
                return client.generate(prompt=prompts[i], max_new_tokens=5 + 2 * i, temperature=0, gamma=1 + i % 4)

            alone = [run(i).token_ids for i in range(len(prompts))]
            with ThreadPoolExecutor(len(prompts)) as pool:
                together = [r.token_ids for r in pool.map(run, range(len(prompts)))]
        assert together == alone
    finally:
        stop_stack(stack)


def test_two_orchestrators_share_the_workers_and_their_steps_merge(workers, target_engine):
    target_address, draft_address = workers
    first, a = start_orchestrator([target_address], [draft_address])
    second, b = start_orchestrator([target_address], [draft_address])
    prompts = ["def fib(n):", "import os\n", "The quick", "x = ["]
    try:
        with client_of(a) as ca, client_of(b) as cb:
            alone = [ca.generate(prompt=p, max_new_tokens=10, temperature=0, gamma=3).token_ids for p in prompts]
            shared = target_engine.runner.batcher.shared_passes
            with ThreadPoolExecutor(4) as pool:
                together = list(pool.map(
                    lambda i: (ca if i % 2 else cb).generate(prompt=prompts[i], max_new_tokens=10, temperature=0,
                                                             gamma=3).token_ids, range(4)))
        assert together == alone
        assert target_engine.runner.batcher.shared_passes > shared
    finally:
        first.stop(None)
        second.stop(None)


def test_a_request_cancelled_mid_step_leaves_the_others_exact(target_engine, draft_engine):
    decoder = SpeculativeDecoder(target_engine, draft_engine)
    requests = _requests()[:4]
    try:
        expected = [decoder.generate(r).token_ids for r in requests]
        stop = threading.Event()

        def abandoned():
            chunks = decoder.generate_stream(GenerationRequest(token_ids=[77, 78], max_new_tokens=500, temperature=0,
                                                               gamma=2))
            for _ in chunks:
                if stop.is_set():
                    break
            chunks.close()  # the consumer goes away: the ticket leaves the loop between steps

        with ThreadPoolExecutor(5) as pool:
            gone = pool.submit(abandoned)
            together = list(pool.map(lambda r: decoder.generate(r).token_ids, requests))
            stop.set()
            gone.result(timeout=60)
        assert together == expected
        wait_for(lambda: target_engine.describe().open_sessions == 0, what="the abandoned session closed")
    finally:
        decoder.close()


# ---- the in-step gamma --------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_on_cuda_the_step_loop_and_ragged_batches_give_what_each_request_gives_alone(model_dirs):
    """The same check on a GPU, in float32 with TF32 off (float64 is slow there, and exact ties
    are as unlikely): concurrent requests through the step loop equal each alone."""
    from draft_service.engine import DraftEngine
    from specdec.modeling import load_model
    from target_service.engine import TargetEngine

    torch.backends.cuda.matmul.allow_tf32 = False
    target = TargetEngine(load_model(str(model_dirs["target"]), device="cuda", dtype="float32"))
    draft = DraftEngine(load_model(str(model_dirs["draft"]), device="cuda", dtype="float32"))
    looped = SpeculativeDecoder(target, draft)
    try:
        requests = _requests()
        expected = [looped.generate(r).token_ids for r in requests]  # one at a time
        assert _staggered(lambda r: looped.generate(r).token_ids, requests) == expected
    finally:
        looped.close()
        target.close()
        draft.close()


def recording(policy: GammaPolicy) -> list[StepRecord]:
    """The records the step loop hands the policy, in order."""
    records, observe = [], policy.observe
    policy.observe = lambda record: (records.append(record), observe(record))[1]
    return records


def test_a_lazily_opened_draft_session_catches_up_in_a_step_the_record_marks(target_engine, draft_engine):
    """On shared cores the draft's session opens when its request first drafts, and that first
    Propose takes its whole prompt in: its record shows the lag (the policy learns no draft costs
    from such a step: test_gamma.py), the steps after it are in step."""
    policy = GammaPolicy(adaptive=False)
    records = recording(policy)
    decoder = SpeculativeDecoder(target_engine, draft_engine, gamma_policy=policy)
    try:
        result = decoder.generate(GenerationRequest(token_ids=list(range(40, 80)), max_new_tokens=12, temperature=0,
                                                    gamma=3))
    finally:
        decoder.close()
    assert result.stats["drafted_tokens"] > 0
    drafting = [r for r in records if any(r.gammas)]
    assert drafting[0].requests[0].lag > CATCH_UP_LAG and drafting[0].drafts  # the catch-up, reported
    assert all(r.requests[0].lag <= CATCH_UP_LAG for r in drafting[1:])


def test_a_draft_session_does_not_catch_up_while_a_prefill_runs(target_engine, draft_engine):
    """A lazily opened draft session takes its whole prompt in when its request first drafts. While
    another request prefills, that catch-up would take turns with the prefill on shared cores and
    hold up the step joining requests wait for: the request runs plain until no prefill runs (its
    cap is 0 then, whatever the policy: the fixed one drafts every cap)."""
    decoder = SpeculativeDecoder(target_engine, draft_engine, gamma_policy=GammaPolicy(adaptive=False))
    request = GenerationRequest(token_ids=list(range(40, 80)), max_new_tokens=12, temperature=0, gamma=3)
    try:
        with decoder.steps.prefill():  # another request's prefill, in flight throughout
            during = decoder.generate(request)
        after = decoder.generate(request)
    finally:
        decoder.close()
    assert during.stats["drafted_tokens"] == 0 and after.stats["drafted_tokens"] > 0
    assert during.token_ids == after.token_ids


def test_a_step_a_prefill_overlapped_teaches_no_step_overhead(target_engine, draft_engine):
    """A step's time beyond its passes is learnt from steps no prefill overlapped: one that waited
    for a prefill's passes once taught the policy an overhead ~10x too large."""
    policy = GammaPolicy(adaptive=True)
    records = recording(policy)
    decoder = SpeculativeDecoder(target_engine, draft_engine, gamma_policy=policy)
    request = GenerationRequest(token_ids=[5, 6, 7, 8], max_new_tokens=8, temperature=0, gamma=2)
    try:
        with decoder.steps.prefill():
            decoder.generate(request)
        costs = policy.costs[records[0].target]
        assert records and all(r.overlapped for r in records)
        assert not costs.overhead.steps and not any(d.extra.steps for d in costs.drafts.values())
        decoder.generate(request)
        assert not records[-1].overlapped and policy.costs[records[-1].target].overhead.steps
    finally:
        decoder.close()


def test_a_step_whose_draft_failed_is_marked_faulted(target_engine, model_dirs):
    """A draft that stalls and then fails (a cut link, found by the keepalive in seconds) holds its
    step for the stall: that step's record is marked faulted, so its seconds are no arm's rate and
    no step's cost (test_gamma.py), while the other steps are not."""
    from draft_service.engine import DraftEngine
    from specdec.modeling import load_model
    from tests.support.drafts import FailingDraft

    policy = GammaPolicy(adaptive=False)
    records = recording(policy)
    # an engine of its own: the failed draft's session stays open there (a real one's TTL frees it)
    engine = DraftEngine(load_model(str(model_dirs["draft"]), dtype="float64"))
    draft = FailingDraft(engine, at=3, stall_s=0.3)
    decoder = SpeculativeDecoder(target_engine, draft, gamma_policy=policy)
    request = GenerationRequest(token_ids=[5, 6, 7, 8], max_new_tokens=24, temperature=0, gamma=2)
    try:
        result = decoder.generate(request)
        alone = decoder.generate(GenerationRequest(token_ids=[5, 6, 7, 8], max_new_tokens=24, temperature=0, gamma=0))
    finally:
        decoder.close()
        engine.close()
    assert result.token_ids == alone.token_ids and result.stats["draft_failovers"] == 1 and draft.calls == 3
    assert [r.faulted for r in records].count(True) == 1
    assert all(r.seconds < 0.3 for r in records if not r.faulted)


def test_the_step_debug_line_is_what_the_step_log_summary_reads(target_engine, draft_engine, caplog):
    """--log-level debug logs every step (requests, gammas, suffix drafts, rows, times);
    specdec_tools/step_log_summary.py turns a run's lines into where its time went. Their format must agree."""
    from specdec_tools import step_log_summary as summary

    decoder = SpeculativeDecoder(target_engine, draft_engine, gamma_policy=GammaPolicy(adaptive=True))
    try:
        with caplog.at_level("DEBUG", logger="orchestrator.steps"):
            result = decoder.generate(GenerationRequest(token_ids=list(range(40, 60)), max_new_tokens=10,
                                                        temperature=0, gamma=3))
    finally:
        decoder.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "orchestrator.steps"]
    lines.append("[bench-serve]   on c=1   1 requests in 1.0 s: 10.00 tok/s aggregate")
    (line,) = summary.summarize(lines)
    counts = {kind: int(n) for kind, n in re.findall(r"(\w): (\d+) steps", line)}
    assert sum(counts.values()) == result.stats["rounds"]  # one step per round: every step's line parsed


def test_the_next_propose_goes_out_beside_the_verify_and_a_round_that_keeps_every_draft_takes_it(
        target_engine, monkeypatch):
    """Where the draft drafts ahead, each round's next Propose goes out while the target verifies
    (rounds.next_call), and a round whose predecessor kept every draft, with the draft's guess as
    its bonus token, takes its proposals from that answer instead of a call of its own. The target
    as its own draft keeps every draft: every round with a next call takes it, and greedy output is
    the target's."""
    import orchestrator.steps as steps
    from draft_service.engine import DraftEngine
    from tests.support.reference import greedy

    taken: list[bool] = []
    real = steps.take_next
    monkeypatch.setattr(steps, "take_next", lambda req, rnd: taken.append(real(req, rnd)) or taken[-1])
    decoder = SpeculativeDecoder(target_engine, DraftEngine(target_engine.loaded), draft_ahead=5)
    prompt = [5, 6, 7, 8, 9]
    try:
        result = decoder.generate(GenerationRequest(token_ids=prompt, max_new_tokens=40, temperature=0, gamma=4))
    finally:
        decoder.close()
    assert result.token_ids == greedy(target_engine, prompt, 40)
    assert taken.count(True) >= result.stats["rounds"] - 2, taken  # the first round, and none after the last
    assert result.stats["ahead_hits"] >= taken.count(True)


@pytest.mark.parametrize("mode", ["coupled", "rejection"])
def test_a_seed_gives_the_same_answer_whether_the_next_proposals_came_beside_the_verify_or_not(
        target_engine, monkeypatch, mode):
    """The next Propose sent beside the verify changes which call hands over a round's proposals,
    never the proposals nor the request's draws: a seeded request gives one answer with it and
    without it (the target as its own draft keeps every draft, and the bonus token is the draft's
    guess in some rounds and not in others). Without it the draft's work ahead is held back here,
    so that no call finds its proposals made: a draw depends on its context and the seed alone,
    not on which call or job made it, nor how far drafting ahead had got when a call came."""
    import orchestrator.steps as steps
    from draft_service.engine import DraftEngine

    request = GenerationRequest(token_ids=[40, 41, 42, 43], max_new_tokens=40, temperature=0.3, seed=7, gamma=3,
                                sampling_mode=mode)
    answers, taken, first, real = [], [], [], steps.take_next
    monkeypatch.setattr(steps, "take_next", lambda req, rnd: taken.append(real(req, rnd)) or taken[-1])
    for pipelined in (True, False):
        if not pipelined:
            monkeypatch.setattr(steps, "next_call", lambda req, rnd: None)
            monkeypatch.setattr(DraftEngine, "_draft_ahead", lambda *args: None)
        decoder = SpeculativeDecoder(target_engine, DraftEngine(target_engine.loaded), draft_ahead=5)
        try:
            answers.append(decoder.generate(request))
        finally:
            decoder.close()
        if pipelined:
            first = list(taken[1:])  # (the first round has no next call)
    assert answers[0].token_ids == answers[1].token_ids
    assert all(first) if mode == "coupled" else True in first and False in first, first
