"""Coupled sampling end to end: a seeded sampled request's output is plain target decoding with
that seed (specdec/sampling.py, coupled_choice at every position), token for token, whatever
gamma, batch, draft or failover, and it follows the target's distribution exactly.

The reference (tests/support/reference.py, coupled) is computed from the target model alone: at
each position its processed distribution and the seed's noise give the token, one forward pass per
token, no draft.
"""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from draft_service.engine import DraftEngine
from orchestrator.proposers.ngram import NgramDraft
from orchestrator.decoder import SpeculativeDecoder
from specdec.errors import ServiceError
from specdec.protocol import GenerationRequest, SamplingParams
from specdec.wire import DraftOptions
from tests.support.distribution import (IN_FLIGHT, NEW_TOKENS, PARAMS, PROMPT, REQUESTS, TUNED, assert_matches,
                                        exact_distribution, sample)
from tests.support.reference import SEEDED_NEW as NEW, SEEDS, coupled as reference, coupled_request as request

SETTINGS = [SamplingParams(0.9), SamplingParams(0.7, top_k=6, top_p=0.8), SamplingParams(1.3, top_p=0.95)]


@pytest.fixture(scope="module")
def decoder(target_engine, draft_engine):
    return SpeculativeDecoder(target_engine, draft_engine, target_engine.tokenizer)


@pytest.mark.parametrize("params", SETTINGS, ids=["T0.9", "T0.7-k6-p0.8", "T1.3-p0.95"])
def test_the_output_is_the_seeds_whatever_gamma(decoder, target_engine, params):
    for seed in SEEDS:
        expected = reference(target_engine, PROMPT, params, seed)
        for gamma in (0, 1, 2, 3, 5, 8):
            r = decoder.generate(request(params, seed, gamma))
            assert r.token_ids == expected, (seed, gamma)
            assert r.stats["sampling"] == "coupled" and r.stats["seed"] == seed % 2**64
    # and rejection sampling, asked for, is not this (it draws differently: a control)
    differs = sum(decoder.generate(request(params, s, 3, sampling_mode="rejection")).token_ids
                  != reference(target_engine, PROMPT, params, s) for s in SEEDS)
    assert differs >= len(SEEDS) - 1


def test_the_output_is_the_seeds_under_concurrency_over_grpc(client, target_engine):
    """Requests of different gammas and seeds at once (the step loop batches them): each is its
    seed's reference, and the wire carries no distribution (bytes per round like greedy's)."""
    params = SETTINGS[1]
    jobs = [(seed, gamma) for seed in range(6) for gamma in (0, 2, 4, 7)]

    def one(job):
        seed, gamma = job
        return client.generate(token_ids=PROMPT, max_new_tokens=NEW, temperature=params.temperature,
                               top_k=params.top_k, top_p=params.top_p, seed=seed, gamma=gamma)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, jobs))
    for (seed, gamma), r in zip(jobs, results):
        assert r.token_ids == reference(target_engine, PROMPT, params, seed), (seed, gamma)
    greedy = client.generate(token_ids=PROMPT, max_new_tokens=NEW, temperature=0, gamma=4)
    rejection = client.generate(token_ids=PROMPT, max_new_tokens=NEW, temperature=params.temperature,
                                top_k=params.top_k, top_p=params.top_p, seed=1, gamma=4, sampling_mode="rejection")
    coupled = [r for (_, g), r in zip(jobs, results) if g == 4]
    per_round = max(r.stats["wire_bytes_per_round"] for r in coupled)
    assert per_round < 1.5 * greedy.stats["wire_bytes_per_round"] < rejection.stats["wire_bytes_per_round"]


@pytest.mark.parametrize("draft", ["n-gram", "lookup and confidence stop", "drafting ahead", "the target itself"])
def test_the_output_is_the_seeds_whatever_the_draft(target_engine, draft_engine, draft):
    made = {
        "n-gram": lambda: (NgramDraft(), DraftOptions()),
        "lookup and confidence stop": lambda: (draft_engine, DraftOptions(p_min=0.3, lookup=3)),
        "drafting ahead": lambda: (draft_engine, DraftOptions(lookup=3, ahead=6)),
        "the target itself": lambda: (DraftEngine(target_engine.loaded), DraftOptions()),
    }[draft]()
    decoder = SpeculativeDecoder(target_engine, made[0], target_engine.tokenizer, draft_options=made[1])
    prompt = PROMPT + [44, 40, 41, 42, 43]  # repeats itself: lookups find guesses
    params = SETTINGS[0]
    for seed in SEEDS[:3]:
        r = decoder.generate(request(params, seed, 4, prompt=prompt))
        assert r.token_ids == reference(target_engine, prompt, params, seed), (draft, seed)
        if draft == "the target itself":  # q == p and the same noise: every draft is the target's token
            assert r.stats["acceptance_rate"] == 1.0


def test_logprobs_are_the_seeds_whatever_gamma(decoder):
    runs = [decoder.generate(request(SETTINGS[1], 3, gamma, logprobs=True, top_logprobs=2)) for gamma in (0, 4)]
    assert runs[0].token_ids == runs[1].token_ids
    for a, b in zip(runs[0].logprobs, runs[1].logprobs):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-9)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert all(lp.logprob < 0 for lp in runs[0].logprobs)


def test_the_mode_follows_the_request_and_the_flag(target_engine, draft_engine, decoder):
    """Unasked, a sampled request draws coupled, with a seed or without; sampling_mode chooses per
    request, and --sampling (SpeculativeDecoder's sampling) sets what an unasked request gets."""
    params = SETTINGS[0]
    assert decoder.generate(request(params, 5, 2)).stats["sampling"] == "coupled"
    unseeded = decoder.generate(GenerationRequest(token_ids=PROMPT, max_new_tokens=4, temperature=0.9, gamma=2))
    assert unseeded.stats["sampling"] == "coupled"
    asked = decoder.generate(GenerationRequest(token_ids=PROMPT, max_new_tokens=4, temperature=0.9, gamma=2,
                                               sampling_mode="rejection"))
    assert asked.stats["sampling"] == "rejection"
    greedy = decoder.generate(GenerationRequest(token_ids=PROMPT, max_new_tokens=4, temperature=0, seed=1))
    assert greedy.stats["sampling"] == "greedy"
    flagged = SpeculativeDecoder(target_engine, draft_engine, target_engine.tokenizer, sampling="rejection")
    assert flagged.generate(request(params, 5, 2)).stats["sampling"] == "rejection"
    assert flagged.generate(GenerationRequest(token_ids=PROMPT, max_new_tokens=4, temperature=0.9,
                                              gamma=2)).stats["sampling"] == "rejection"
    assert flagged.generate(request(params, 5, 2, sampling_mode="coupled")).stats["sampling"] == "coupled"
    with pytest.raises(ServiceError) as err:
        decoder.generate(request(params, 5, 2, sampling_mode="gumbel"))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "sampling_mode" in err.value.message


def test_coupled_sampling_follows_the_target_distribution_over_grpc(client, target_engine):
    """Thousands of seeds through the service (gamma 2, a draft that differs from the target): the
    3-token continuations follow the target's exact distribution (chi-square), and against the
    wrong distribution the same test fails (the negative control)."""
    from specdec.protocol import SamplingParams as P

    results = sample(client, TUNED, sampling_mode="coupled")
    assert_matches(exact_distribution(target_engine, params=TUNED), results)
    with pytest.raises(AssertionError, match="p-value"):
        assert_matches(exact_distribution(target_engine, params=P(temperature=1.0, top_k=6)), results)
    assert_matches(exact_distribution(target_engine, params=PARAMS), sample(client, PARAMS, sampling_mode="coupled"))


# ---- a sampled request with no seed and no sampling_mode: coupled, under a seed the server draws --


def unseeded(params: SamplingParams, new: int = NEW, **kw) -> GenerationRequest:
    """The default path: a sampled request that names neither a seed nor a sampling_mode."""
    return GenerationRequest(token_ids=PROMPT, max_new_tokens=new, temperature=params.temperature, top_k=params.top_k,
                             top_p=params.top_p, **kw)


def test_unseeded_requests_draw_coupled_and_follow_the_target_distribution(decoder, target_engine, monkeypatch):
    """Thousands of requests with no seed through the decoder and a draft that differs from the
    target (gamma 2, so drafts are kept and rejected): each draws coupled, under a seed of its own
    that its stats report, and the 3-token continuations follow the target's exact distribution
    (chi-square); against the wrong distribution the same test fails. The server draws its seeds
    from os.urandom (decoder.draw_seed); here they come from a fixed generator, so every run tests
    the same requests."""
    import orchestrator.decoder as decoder_module

    rng, lock = random.Random(50), threading.Lock()

    def draw_seed() -> int:
        with lock:
            return rng.getrandbits(63)

    monkeypatch.setattr(decoder_module, "draw_seed", draw_seed)

    def one(_):
        r = decoder.generate(unseeded(TUNED, NEW_TOKENS, gamma=2))
        return tuple(r.token_ids), r.stats["accepted_tokens"], r.stats["drafted_tokens"], r.stats["sampling"], \
            r.stats["seed"]

    with ThreadPoolExecutor(IN_FLIGHT) as pool:
        runs = list(pool.map(one, range(REQUESTS)))
    assert {run[3] for run in runs} == {"coupled"}
    assert len({run[4] for run in runs}) == REQUESTS  # a seed of its own each, as drawn
    results = [run[:3] for run in runs]
    assert_matches(exact_distribution(target_engine, params=TUNED), results)
    with pytest.raises(AssertionError, match="p-value"):
        assert_matches(exact_distribution(target_engine, params=SamplingParams(temperature=1.0, top_k=6)), results)


@pytest.mark.parametrize("params", SETTINGS[:2], ids=["T0.9", "T0.7-k6-p0.8"])
def test_an_unseeded_answer_comes_back_with_its_reported_seed(decoder, client, target_engine, params):
    """The seed the server drew is in stats.seed: sent again with it (at any gamma) the request
    gets the same tokens, which are plain target decoding with that seed; over gRPC as in-process."""
    first = decoder.generate(unseeded(params, gamma=3))
    seed = first.stats["seed"]
    assert first.stats["sampling"] == "coupled"
    assert first.token_ids == reference(target_engine, PROMPT, params, seed)
    for gamma in (0, 5):
        again = decoder.generate(request(params, seed, gamma))
        assert again.token_ids == first.token_ids and again.stats["seed"] == seed, gamma
    kw = dict(token_ids=PROMPT, max_new_tokens=NEW, temperature=params.temperature, top_k=params.top_k,
              top_p=params.top_p)
    drawn = [client.generate(gamma=4, **kw) for _ in range(2)]
    assert drawn[0].stats["seed"] != drawn[1].stats["seed"]
    for r in drawn:
        assert r.stats["sampling"] == "coupled"
        assert client.generate(gamma=1, seed=r.stats["seed"], **kw).token_ids == r.token_ids


def test_an_unseeded_sampled_round_carries_token_ids_only_over_grpc(client):
    """At temperature 1 with no top-k or top-p (dense distributions), a request with no seed and
    no sampling_mode costs on the wire about what a greedy round costs; asked for rejection
    sampling, the same request's rounds carry both models' distributions."""
    kw = dict(token_ids=PROMPT, max_new_tokens=NEW, gamma=4)
    greedy = client.generate(temperature=0, **kw).stats
    sampled = [client.generate(temperature=1.0, **kw).stats for _ in range(3)]
    rejection = client.generate(temperature=1.0, sampling_mode="rejection", **kw).stats
    assert {s["sampling"] for s in sampled} == {"coupled"} and rejection["sampling"] == "rejection"
    per_round = max(s["wire_bytes_per_round"] for s in sampled)
    assert per_round < 1.5 * greedy["wire_bytes_per_round"]
    assert 10 * per_round < rejection["wire_bytes_per_round"]
