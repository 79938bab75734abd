"""Limits: cached tokens per worker, request sizes at the orchestrator, draining workers."""

from __future__ import annotations

import grpc
import pytest

from orchestrator.decoder import SpeculativeDecoder
from specdec.protocol import GenerationRequest, RequestLimits
from specdec.errors import InvalidArgument, ResourceExhausted, ServiceError, Unavailable
from specdec.protocol import SamplingParams
from target_service.engine import TargetEngine
from draft_service.engine import DraftEngine

GREEDY = SamplingParams(temperature=0.0)


def test_cached_tokens_are_capped_per_worker(target_engine):
    engine = TargetEngine(target_engine.loaded, max_cached_tokens=50)
    engine.open_session("a", list(range(1, 41)))
    with pytest.raises(ResourceExhausted, match="max-cached-tokens"):
        engine.open_session("b", list(range(1, 21)))
    assert engine.describe().open_sessions == 1, "a refused session leaves nothing behind"
    engine.verify("a", 40, [], [5, 6, 7], GREEDY)  # 43 tokens: fits
    with pytest.raises(ResourceExhausted):
        engine.verify("a", 43, [1] * 5, [5, 6, 7], GREEDY)  # 51 would not
    engine.truncate("a", 10)  # a rollback frees room
    engine.open_session("b", list(range(1, 21)))
    assert engine.describe().held_tokens == 30
    for s in ("a", "b"):
        engine.close_session(s)


def test_draft_proposals_count_against_the_cap(draft_engine):
    engine = DraftEngine(draft_engine.loaded, max_cached_tokens=12)
    engine.open_session("s", list(range(1, 11)))
    with pytest.raises(ResourceExhausted):
        list(engine.propose("s", 10, [], 4, GREEDY, 0))  # 10 + 4 > 12
    assert len(list(engine.propose("s", 10, [], 2, GREEDY, 0))) == 2
    engine.close_session("s")


def test_request_limits_name_the_flag(target_engine, draft_engine):
    decoder = SpeculativeDecoder(target_engine, draft_engine, target_engine.tokenizer,
                                 limits=RequestLimits(max_new_tokens=8, max_prompt_tokens=5))
    with pytest.raises(InvalidArgument, match="--max-new-tokens"):
        decoder.generate(GenerationRequest(token_ids=[1, 2, 3], max_new_tokens=9))
    with pytest.raises(InvalidArgument, match="--max-prompt-tokens"):
        decoder.generate(GenerationRequest(token_ids=[1] * 6, max_new_tokens=4))
    assert len(decoder.generate(GenerationRequest(token_ids=[1] * 5, max_new_tokens=8, temperature=0)).token_ids) <= 8


def test_a_draining_worker_takes_no_new_session_but_serves_open_ones(target_engine):
    engine = TargetEngine(target_engine.loaded)
    engine.open_session("open", [1, 2, 3])
    engine.draining = True
    assert engine.describe().draining
    with pytest.raises(Unavailable, match="shutting down"):
        engine.open_session("new", [1, 2, 3])
    assert engine.verify("open", 3, [], [4], GREEDY).length == 4
    assert engine.drain(0.1) == 1, "past the drain timeout the remaining session is dropped"
    with pytest.raises(ServiceError) as e:
        engine.verify("open", 4, [], [], GREEDY)
    assert e.value.code == grpc.StatusCode.NOT_FOUND
