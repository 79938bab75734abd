"""Greedy speculative output equals the target model's own greedy `generate`, token for token.

Run in float64 so a k-row verify pass and a 1-row pass cannot flip a near-tie.
"""

from __future__ import annotations

import pytest

from draft_service.engine import DraftEngine
from orchestrator.decoder import SpeculativeDecoder
from specdec.protocol import GenerationRequest
from tests.support.reference import PROMPTS, greedy as reference


@pytest.fixture(scope="module")
def decoder(target_engine, draft_engine):
    return SpeculativeDecoder(target_engine, draft_engine, target_engine.tokenizer)


@pytest.fixture(scope="module")
def self_draft_decoder(target_engine):
    # the target as its own draft: every draft is accepted, so every round ends with a bonus token
    return SpeculativeDecoder(target_engine, DraftEngine(target_engine.loaded), target_engine.tokenizer)


@pytest.mark.parametrize("gamma", [0, 1, 3, 6])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_in_process_greedy_matches_generate(decoder, target_engine, prompt, gamma):
    ids = target_engine.tokenizer(prompt).input_ids
    result = decoder.generate(GenerationRequest(token_ids=ids, max_new_tokens=24, temperature=0, gamma=gamma))
    assert result.token_ids == reference(target_engine, ids, 24)
    assert result.stats["rounds"] == result.stats["target_forward_passes"]


def test_all_accepted_rounds_match_generate(self_draft_decoder, target_engine):
    ids = target_engine.tokenizer(PROMPTS[0]).input_ids
    r = self_draft_decoder.generate(GenerationRequest(token_ids=ids, max_new_tokens=25, temperature=0, gamma=4))
    assert r.token_ids == reference(target_engine, ids, 25)
    assert r.stats["acceptance_rate"] == 1.0
    assert r.stats["rounds"] == 5  # 5 tokens per round: 4 accepted drafts + the bonus token


@pytest.mark.parametrize("gamma", [0, 2, 5])
@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_grpc_greedy_matches_generate(client, target_engine, prompt, gamma):
    ids = target_engine.tokenizer(prompt).input_ids
    r = client.generate(token_ids=ids, max_new_tokens=20, temperature=0, gamma=gamma)
    assert r.token_ids == reference(target_engine, ids, 20)
    assert r.finish_reason in ("length", "eos")
    assert r.stats["wire_bytes"] > 0


def test_streamed_chunks_add_up_to_the_unary_answer(client):
    unary = client.generate(prompt="def f(", max_new_tokens=16, temperature=0)
    chunks = list(client.stream(prompt="def f(", max_new_tokens=16, temperature=0))
    assert "".join(c.text_delta for c in chunks) == unary.text
    assert [t for c in chunks for t in c.token_ids] == unary.token_ids
    assert chunks[-1].finish_reason == unary.finish_reason and chunks[-1].stats is not None
    assert all(c.stats is None for c in chunks[:-1])
