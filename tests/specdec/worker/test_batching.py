"""specdec.worker.batching: ragged passes over many sessions give each session exactly what a pass
of its own gives; passes are planned within --max-batch-tokens, long prefills in chunks."""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from specdec.protocol import GenerationRequest, SamplingParams
from specdec.worker.batching import Pass, Work, plan_pass

GREEDY = SamplingParams(temperature=0)


class FakeSession:
    def __init__(self, tokens, cached):
        self.tokens, self.cached = list(range(tokens)), cached


def work(tokens, cached=0, keep=1):
    return Work(FakeSession(tokens, cached), keep, "verify", lambda x: x, None)


def test_a_pass_takes_everything_pending_within_the_budget():
    a, b, c = work(5, 4), work(9, 4, keep=5), work(3, 2)
    pending = deque([a, b, c])
    planned = plan_pass(pending, max_tokens=64)
    assert [(w, n) for w, n in planned.items] == [(a, 1), (b, 5), (c, 1)] and not pending


def test_a_long_prefill_is_cut_into_chunks_and_decoding_sessions_still_run():
    decode, prefill, verify = work(11, 10), work(300), work(20, 15, keep=5)
    pending = deque([decode, prefill, verify])
    first = plan_pass(pending, max_tokens=64)
    assert [(w, n) for w, n in first.items] == [(decode, 1), (prefill, 63)]
    assert list(pending) == [prefill, verify]  # the rest of the prefill goes first next time
    # a chunk never takes the positions whose logits are wanted (they come with its last part)
    prefill.session.cached = 298
    assert [(w, n) for w, n in plan_pass(deque([prefill]), max_tokens=1).items] == [(prefill, 1)]
    prefill.session.cached = 299
    lone = plan_pass(deque([verify]), max_tokens=2)  # too big and cannot be cut: runs alone
    assert [(w, n) for w, n in lone.items] == [(verify, 5)]


def test_work_that_does_not_fit_waits_without_losing_its_place():
    a, big, c = work(3, 2), work(40, 30, keep=10), work(2, 1)
    pending = deque([a, big, c])
    assert [(w, n) for w, n in plan_pass(pending, max_tokens=8).items] == [(a, 1), (c, 1)]
    assert list(pending) == [big]


def prefill(tokens):
    return Work(FakeSession(tokens, 0), 1, "prefill", lambda x: x, None)


def test_a_prefill_takes_at_most_max_prefill_rows_of_a_pass():
    decode, long, short = work(11, 10), prefill(300), prefill(50)
    pending = deque([long, decode, short])
    planned = plan_pass(pending, max_tokens=512, max_prefill=128)
    assert [(w, n) for w, n in planned.items] == [(decode, 1), (long, 128)]  # decoding first, then one chunk
    assert list(pending) == [long, short]
    assert [(w, n) for w, n in plan_pass(pending, max_tokens=512).items] == [(long, 300), (short, 50)]


def test_the_batcher_cuts_prefills_short_only_while_sessions_decode(monkeypatch):
    """A prefill with nothing decoding runs in one pass; while sessions decode (open, a pass held
    their work within DECODING_WINDOW_S), in chunks of --max-prefill-tokens-while-decoding, so that
    the decoding sessions' next step never waits behind a long pass."""
    from specdec.worker import batching

    passes = []

    def run(batch):
        passes.append([(w.kind, n) for w, n in batch.items])
        for w, n in batch.items:
            w.session.cached += n
            if w.session.cached == len(w.session.tokens):
                w.future.set_result(None)

    batcher = batching.Batcher(run, max_batch_tokens=512, max_prefill_tokens_while_decoding=128)
    try:
        batcher.submit(prefill(300))
        assert passes == [[("prefill", 300)]]
        decoding = work(11, 10)
        batcher.submit(decoding)  # a session decodes
        batcher.submit(prefill(300))
        assert passes[2:] == [[("prefill", 128)], [("prefill", 128)], [("prefill", 44)]]
        decoding.session.closed = True  # its request ended: the next prompt runs in one pass
        batcher.submit(prefill(300))
        assert passes[5:] == [[("prefill", 300)]]
        batcher.submit(work(11, 10))
        monkeypatch.setattr(batching, "DECODING_WINDOW_S", 0.0)  # a session open but quiet
        batcher.submit(prefill(300))
        assert passes[7:] == [[("prefill", 300)]]
    finally:
        batcher.close()


def test_a_prompt_chunk_waits_for_the_decoding_sessions_next_step(monkeypatch):
    """After a pass that held decoding work, a pass of prompt chunks alone waits (a while) for the
    decoding session's next call, which comes a round trip later: each chunk then rides with a
    decoding step instead of every other one."""
    import threading

    from specdec.worker import batching

    monkeypatch.setattr(batching, "PREFILL_HOLD_FRACTION", 50.0)  # a hold of 1 s: time enough for the round trip
    passes = []

    def run(batch):
        time.sleep(0.02)
        passes.append(sorted(w.kind for w, _ in batch.items))
        for w, n in batch.items:
            w.session.cached += n
            if w.session.cached == len(w.session.tokens):
                w.future.set_result(None)

    batcher = batching.Batcher(run, max_batch_tokens=512, max_prefill_tokens_while_decoding=128)
    session, started = FakeSession(11, 10), threading.Event()

    def decode():
        for step in range(8):
            batcher.submit(Work(session, 1, "verify", lambda x: x, None))
            started.set()
            session.tokens.append(0)  # the next step's token
            time.sleep(0.05)  # the round trip

    thread = threading.Thread(target=decode)
    try:
        thread.start()
        started.wait()
        batcher.submit(prefill(300))  # three chunks of 128, 128 and 44 rows
        thread.join()
    finally:
        batcher.close()
    assert [p for p in passes if "prefill" in p] == [["prefill", "verify"]] * 3, passes


def _alone(engine, tokens, cached_upto, keep):
    """Logits of the last `keep` tokens when the session runs in a pass of its own."""
    sid = f"alone-{len(tokens)}-{cached_upto}-{keep}"
    engine.open_session(sid, tokens[:cached_upto + 1])
    try:
        s = engine.session(sid)
        with s.lock:
            s.tokens[:] = tokens
            return engine.run(s, keep, "verify")
    finally:
        engine.close_session(sid)


def test_a_mixed_pass_equals_each_session_alone(target_engine):
    """A prefill, a verify of 5 tokens, a one-token draft-like step and a session rolled back just
    before: in one pass, each gets the logits it gets alone (float64: equal to 1e-12)."""
    cases = {  # name: (all tokens, tokens cached before the pass, logits wanted)
        "prefill": ([7, 3, 9, 11, 2, 5, 8], 0, 1),
        "verify": ([5, 17, 99, 3, 42, 8, 11, 12, 13, 14, 15], 6, 5),
        "step": ([1, 2, 3, 4], 3, 1),
        "rolled-back": ([9, 8, 7, 6, 5, 4, 3, 2], 4, 2),
    }
    expected = {name: _alone(target_engine, *case) for name, case in cases.items()}
    sessions = {}
    for name, (tokens, cached, keep) in cases.items():
        target_engine.open_session(f"mixed-{name}", tokens[: max(cached, 1) + (1 if name == "rolled-back" else 0)]
                                   if name != "prefill" else tokens[:1])
        s = target_engine.session(f"mixed-{name}")
        if name == "rolled-back":  # cache 6 tokens, then roll back to 4
            s.tokens[:] = tokens[:6] + [0]
            target_engine.run(s, 1, "verify")
            target_engine.truncate(f"mixed-{name}", 4)
        elif cached:
            s.tokens[:] = tokens[: cached + 1]
            target_engine.run(s, 1, "verify")
            target_engine.truncate(f"mixed-{name}", cached)
        assert s.cached == cached
        s.tokens[:] = tokens
        sessions[name] = s
    works = {name: Work(s, cases[name][2], "verify", lambda x: x.clone(), None) for name, s in sessions.items()}
    target_engine.runner._run_pass(Pass([(w, len(w.session.tokens) - w.session.cached) for w in works.values()]))
    try:
        for name, w in works.items():
            torch.testing.assert_close(w.future.result(), expected[name], rtol=1e-12, atol=1e-12)
            assert sessions[name].cached == len(cases[name][0])
    finally:
        for name in cases:
            target_engine.close_session(f"mixed-{name}")


def test_concurrent_requests_are_batched_and_equal_one_at_a_time(target_engine, draft_engine):
    """Eight greedy requests at once through the decoder (draft steps, verifies and prefills of
    different lengths share passes) give the tokens each gives alone."""
    from orchestrator.decoder import SpeculativeDecoder

    decoder = SpeculativeDecoder(target_engine, draft_engine, tokenizer=target_engine.tokenizer)
    prompts = [[40 + i] * (3 + 5 * i) for i in range(8)]
    requests = [GenerationRequest(token_ids=p, max_new_tokens=20, temperature=0, gamma=1 + i % 4)
                for i, p in enumerate(prompts)]
    alone = [decoder.generate(r).token_ids for r in requests]

    shared_before = target_engine.runner.batcher.shared_passes + draft_engine.runner.batcher.shared_passes
    with ThreadPoolExecutor(len(requests)) as pool:
        together = [r.token_ids for r in pool.map(decoder.generate, requests)]
    assert together == alone
    shared = target_engine.runner.batcher.shared_passes + draft_engine.runner.batcher.shared_passes - shared_before
    assert shared > 0, "no pass held more than one session"


@pytest.mark.parametrize("max_batch_tokens", [1, 4])
def test_tiny_batch_limits_still_give_exact_prefills(target_engine, max_batch_tokens):
    from target_service.engine import TargetEngine

    engine = TargetEngine(target_engine.loaded, max_batch_tokens=max_batch_tokens)
    try:
        prompt = [5, 17, 99, 3, 42, 8, 11, 12, 13]
        engine.open_session("chunked", prompt)
        v = engine.verify("chunked", len(prompt), [], [4, 5], GREEDY)
        target_engine.open_session("whole", prompt)
        w = target_engine.verify("whole", len(prompt), [], [4, 5], GREEDY)
        target_engine.close_session("whole")
        assert v.argmax == w.argmax
    finally:
        engine.close()
