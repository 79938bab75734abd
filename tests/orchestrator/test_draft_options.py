"""Drafts that stop when unsure, drafts checked against a lookup, drafts with no model: the output
is still the target's, greedily token for token and sampled in distribution.

DraftOptions (the orchestrator's --draft-p-min, --draft-lookup) and the n-gram draft
(--draft ngram) change which tokens a round proposes and how many; the rejection test must keep
the target's distribution whatever they do. The sampled cases use a prompt that repeats itself,
so that lookups find guesses, and a chi-square test against the target's exact distribution.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from orchestrator.proposers.ngram import NgramDraft
from orchestrator.decoder import SpeculativeDecoder
from specdec.protocol import GenerationRequest
from specdec.sampling import process_logits
from specdec.wire import DraftOptions
from tests.support.distribution import IN_FLIGHT, PARAMS, assert_matches, exact_distribution
from tests.support.reference import PROMPTS, greedy as reference

REQUESTS = 2400
CONFIGS = {
    "confidence stop and lookup": lambda draft: (draft, DraftOptions(p_min=0.4, lookup=3)),
    "n-gram draft": lambda draft: (NgramDraft(), DraftOptions()),
}
GREEDY_CONFIGS = {**CONFIGS, "drafting ahead": lambda draft: (draft, DraftOptions(lookup=3, ahead=6))}


def decoder_for(config, target_engine, draft_engine):
    draft, options = GREEDY_CONFIGS[config](draft_engine)
    return SpeculativeDecoder(target_engine, draft, target_engine.tokenizer, draft_options=options)


def repeating_prompt(target_engine) -> list[int]:
    """[40, 41, y, 40, 41]: a lookup of the last 2-gram guesses y, then 40. y is the token the
    target itself gives the highest probability there under PARAMS (below 0.9), so that guesses
    are both accepted and rejected."""
    def p_y(y):
        with torch.inference_mode():
            logits = target_engine.model(torch.tensor([[40, 41, y, 40, 41]]), logits_to_keep=1).logits[0, -1]
        return process_logits(logits, PARAMS).prob_of(y)

    scored = [(p_y(y), y) for y in range(target_engine.vocab_size)]
    return [40, 41, max((p, y) for p, y in scored if p < 0.9)[1], 40, 41]


@pytest.mark.parametrize("config", GREEDY_CONFIGS)
@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_greedy_output_is_the_targets(config, prompt, target_engine, draft_engine):
    decoder = decoder_for(config, target_engine, draft_engine)
    ids = target_engine.tokenizer(prompt).input_ids
    ids = ids + ids  # repeated, so the lookups find something
    r = decoder.generate(GenerationRequest(token_ids=ids, max_new_tokens=24, temperature=0, gamma=5))
    assert r.token_ids == reference(target_engine, ids, 24)


@pytest.mark.parametrize("config", CONFIGS)
def test_sampled_output_matches_target_distribution(config, target_engine, draft_engine):
    decoder = decoder_for(config, target_engine, draft_engine)
    prompt = repeating_prompt(target_engine)
    exact = exact_distribution(target_engine, prompt)

    def one(seed):
        r = decoder.generate(GenerationRequest(token_ids=prompt, max_new_tokens=3, temperature=PARAMS.temperature,
                                               top_k=PARAMS.top_k, gamma=3, seed=seed,
                                               sampling_mode="rejection"))
        return tuple(r.token_ids), r.stats["accepted_tokens"], r.stats["drafted_tokens"]

    with ThreadPoolExecutor(IN_FLIGHT) as pool:
        results = list(pool.map(one, range(REQUESTS)))
    assert_matches(exact, results)


def test_drafting_ahead_keeps_the_target_distribution(target_engine, draft_engine):
    """Four tokens at gamma 1: the first round drafts one token and the draft goes on drafting
    ahead (its guess of the bonus, then one more); the second round takes that one when the
    first kept its draft and drew the guessed bonus. The output is still the target's."""
    decoder = SpeculativeDecoder(target_engine, draft_engine, target_engine.tokenizer,
                                 draft_options=DraftOptions(ahead=2))
    prompt = [40, 41, 42, 43]
    exact = exact_distribution(target_engine, prompt, new_tokens=4)
    taken_before = draft_engine.ahead_taken

    def one(seed):
        r = decoder.generate(GenerationRequest(token_ids=prompt, max_new_tokens=4, temperature=PARAMS.temperature,
                                               top_k=PARAMS.top_k, gamma=1, seed=seed,
                                               sampling_mode="rejection"))
        return tuple(r.token_ids), r.stats["accepted_tokens"], r.stats["drafted_tokens"]

    with ThreadPoolExecutor(IN_FLIGHT) as pool:
        results = list(pool.map(one, range(REQUESTS)))
    assert draft_engine.ahead_taken > taken_before, "no round took a proposal drafted ahead: the test tests nothing"
    assert_matches(exact, results)
