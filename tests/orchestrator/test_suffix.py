"""orchestrator/proposers/suffix.py and the step loop's suffix drafts: drafts with no draft pass, from what
followed the same tokens before in the request or in an ended request of the same tenant.

The index: what it finds, by frequency, within a scope only, bounded in tokens. The policy: a
suffix draft rides in the target's pass only where its expected tokens pay for its rows. Through
the services: a request that repeats an ended one gets its drafts from it, and greedy and seeded
output stay exactly what they are without them. (A suffix draft's q is a point mass:
test_rejection_sampler.py shows such drafts keep the target's distribution.)
"""

from __future__ import annotations

import pytest

from orchestrator.gamma import DRAFT, MIN_STEPS, PRIOR_ACCEPTANCE, Calibration, GammaPolicy, StepRequest
from orchestrator.proposers.suffix import MAX_HITS, SPEC_FACTOR, RequestIndex, SuffixIndex
from tests.support.policy import Feed, learnt

SEQ = list(range(100, 140))  # 40 distinct tokens


def draft(index: SuffixIndex, tokens: list[int], k: int = 8, scope: str = "a"):
    return index.draft(scope, tokens, RequestIndex(), k)


def test_an_ended_request_of_the_same_scope_gives_what_followed_its_tokens():
    index = SuffixIndex()
    index.add("a", SEQ)
    tokens, probs = draft(index, [1, 2, *SEQ[10:14]], k=5)
    assert tokens == SEQ[14:19] and probs == [1.0] * 5


def test_another_scope_finds_nothing_of_it():
    index = SuffixIndex()
    index.add("a", SEQ)
    assert draft(index, [1, 2, *SEQ[10:14]], scope="b") == ([], [])


def test_the_draft_follows_the_most_frequent_continuation_while_its_probability_holds():
    index = SuffixIndex()
    for tail in ([7, 8, 9], [7, 8, 9], [7, 8, 5], [6, 6, 6]):
        index.add("a", [1, 2, 3, 4, *tail])
    tokens, probs = draft(index, [0, 1, 2, 3, 4], k=3)
    assert tokens == [7, 8, 9]
    assert probs == pytest.approx([0.75, 0.75, 0.5])  # 3 of 4 go on with 7, then 8; 2 of those 3 with 9


def test_a_draft_is_at_most_spec_factor_times_the_matched_length():
    index = SuffixIndex()
    index.add("a", [50, 51, *SEQ])
    tokens, _ = draft(index, [9, 50, 51], k=16)  # matched 2 tokens
    assert tokens == SEQ[: int(SPEC_FACTOR * 2)]


def test_the_requests_own_tokens_are_searched_without_any_index():
    tokens = [1, *SEQ[:10], 2, 3, *SEQ[:3]]
    found, probs = SuffixIndex(0).draft("a", tokens, RequestIndex(), 4)
    assert found == SEQ[3:7] and probs == [1.0] * 4


def test_a_requests_index_grows_with_it_and_matches_a_rescan():
    own, tokens = RequestIndex(), [1, 2, 3, 1, 2]
    assert SuffixIndex(0).draft("a", tokens, own, 2)[0] == [3, 1]
    tokens += [4, 1, 2]  # now "1 2" was last followed by 4
    assert SuffixIndex(0).draft("a", tokens, own, 1)[0] == SuffixIndex(0).draft("a", tokens, RequestIndex(), 1)[0]


def test_the_index_is_bounded_and_forgets_the_oldest_request_first():
    index = SuffixIndex(max_tokens=100)
    for i in range(50):
        index.add("a", [1000 + i, 2000 + i, 3000 + i, *SEQ[:37]])  # 40 tokens each
    assert index.tokens <= 100
    assert draft(index, [1000, 2000, 3000]) == ([], [])  # the first request is forgotten
    assert draft(index, [1049, 2049, 3049])[0][:3] == SEQ[:3]  # the last is kept
    keys = index._keys["a"]
    assert len(keys) < 3 * 100 and all(len(hits) <= MAX_HITS for hits in keys.values())


def test_nothing_is_kept_when_off():
    index = SuffixIndex(0)
    index.add("a", SEQ)
    assert index.tokens == 0 and draft(index, [1, *SEQ[10:14]]) == ([], [])


# ---- the policy -----------------------------------------------------------------------------


def policy_with(alpha: float, beta: float) -> GammaPolicy:
    return learnt(lambda rows: alpha + beta * rows)


def choose(policy: GammaPolicy, probs: list[float], calibration: Calibration | None = None) -> int:
    requests = [StepRequest(0, None, calibration=calibration), StepRequest(0, None)]
    return policy.choose_step("t", requests, suffix=lambda: [probs, []])[1][0]


def test_a_likely_draft_rides_where_rows_are_cheap():
    policy = policy_with(alpha=0.020, beta=0.0002)  # a GPU-like pass: weights dominate, rows cost little
    assert choose(policy, [1.0] * 6) == 6


def test_an_unlikely_draft_does_not_pay_for_its_rows():
    policy = policy_with(alpha=0.020, beta=0.004)  # each row costs a fifth of a pass
    assert choose(policy, [0.15, 0.12, 0.1]) == 0
    assert choose(policy, [1.0, 1.0, 1.0]) > 0


def test_drafts_that_keep_failing_stop_being_sent():
    """The records' judged suffix drafts calibrate their probabilities: pooled per target, and a
    request's own over the pool."""
    policy = policy_with(alpha=0.020, beta=0.002)
    probs = [1.0, 1.0, 1.0, 1.0]
    assert choose(policy, probs) > 0
    feed = Feed(policy)
    for _ in range(60):
        feed.record([StepRequest(0, None)], [0], 0.05, 1, judged={0: (4, 0, 4.0)})
    assert choose(policy, probs) == 0
    own = Calibration()
    feed.record([StepRequest(0, None, calibration=own)], [0], 0.05, 5, judged={0: (4, 4, 4.0)})
    assert own.num == 4 and choose(policy, probs, own) > 0  # its own suffix drafts were kept: it goes on


def test_suffix_drafts_that_measure_slower_stop_riding_but_for_exploration():
    """The model says they pay (cheap rows, certain matches), the steps say otherwise: measured
    goodput wins, as for drafting (orchestrator/gamma.py)."""
    policy = policy_with(alpha=0.020, beta=0.0002)
    feed = Feed(policy, target_cost=lambda rows: 0.020 + 0.0002 * rows)
    sent = [any(feed.step([StepRequest(0, None)] * 4, lambda g, s: 0.2 if any(s) else 0.05,
                          lambda g, s: 4 + sum(s) // 4, load=4, suffix=lambda: [[1.0] * 4] * 4)[1])
            for _ in range(300)]
    assert all(sent[:5])  # the model's choice until both are measured
    assert sum(sent[-100:]) <= 10  # then the faster arm, the other explored within its budget


def test_a_step_that_drafts_with_the_model_carries_no_suffix_drafts():
    policy = learnt(lambda rows: 0.020 + 0.0002 * rows, lambda rows: 0.001, acceptance=0.9)
    asked = []
    gammas, lengths = policy.choose_step("t", [StepRequest(4, "d"), StepRequest(4, "d")],
                                         suffix=lambda: asked.append(1) or [[], [1.0] * 4])
    assert any(gammas) and lengths == [0, 0] and not asked


def test_the_fixed_policy_sends_none():
    assert GammaPolicy(adaptive=False).choose_step("t", [StepRequest(4, "d")], suffix=lambda: [[1.0]])[1] == [0]


class SuffixAlways(GammaPolicy):
    """A policy for the services' tests: every step sends each request's whole suffix draft, so
    what they check does not hang on which arm the tiny models' timings favour."""

    def choose_step(self, target, requests, load=None, suffix=None):
        candidates = suffix() if suffix is not None else None
        return [0] * len(requests), [len(c) for c in candidates] if candidates else [0] * len(requests)


# ---- through the services -------------------------------------------------------------------


@pytest.fixture(scope="module")
def goodput(stack):
    from tests.support.servers import start_orchestrator

    tport, dport, _ = stack["ports"]
    parts, address = start_orchestrator([f"127.0.0.1:{tport}"], [f"127.0.0.1:{dport}"], gamma_policy="goodput",
                                        suffix_cache_tokens=4096)
    parts.slot.decoder.steps.policy = SuffixAlways()
    yield address
    parts.stop(None)


def test_a_request_repeating_an_ended_one_drafts_from_it_and_stays_exact(goodput, target_engine):
    from orchestrator.client import Client
    from tests.support.reference import greedy as reference

    ids = target_engine.tokenizer("def suffix_drafts(x):").input_ids
    with Client(goodput, timeout_s=120) as client:
        first = client.generate(token_ids=ids, max_new_tokens=40, temperature=0, gamma=4)
        again = client.generate(token_ids=ids, max_new_tokens=40, temperature=0, gamma=4)
        plain = client.generate(token_ids=ids, max_new_tokens=40, temperature=0, gamma=0)
    assert first.token_ids == again.token_ids == reference(target_engine, ids, 40)
    assert plain.stats["suffix_drafted_tokens"] == 0  # gamma 0 asked: no drafts of any kind
    s = again.stats
    assert s["suffix_drafted_tokens"] > 0 and s["suffix_accepted_tokens"] > 0
    assert s["rounds"] < 40 / 2  # its tokens came several a pass


def test_a_seeded_request_keeps_its_seeds_output_with_suffix_drafts(goodput, target_engine):
    from orchestrator.client import Client

    ids = target_engine.tokenizer("class Coupled:").input_ids
    with Client(goodput, timeout_s=120) as client:
        runs = [client.generate(token_ids=ids, max_new_tokens=30, temperature=0.8, seed=11, gamma=4)
                for _ in range(2)]
        alone = client.generate(token_ids=ids, max_new_tokens=30, temperature=0.8, seed=11, gamma=0)
    assert runs[0].token_ids == runs[1].token_ids == alone.token_ids
    assert runs[1].stats["suffix_drafted_tokens"] > 0


def test_suffix_drafts_off_makes_none_of_any_kind(stack, target_engine):
    """--suffix-drafts off: a request that repeats an ended one (and its own tokens) gets no
    suffix draft, and its output is the target's."""
    from orchestrator.client import Client
    from tests.support.reference import greedy as reference
    from tests.support.servers import start_orchestrator

    tport, dport, _ = stack["ports"]
    parts, address = start_orchestrator([f"127.0.0.1:{tport}"], [f"127.0.0.1:{dport}"], gamma_policy="goodput",
                                        suffix_cache_tokens=4096, suffix_drafts=False)
    ids = target_engine.tokenizer("def suffix_drafts(x):").input_ids
    try:
        with Client(address, timeout_s=120) as client:
            runs = [client.generate(token_ids=ids, max_new_tokens=40, temperature=0, gamma=4) for _ in range(2)]
    finally:
        parts.stop(None)
    assert runs[0].token_ids == runs[1].token_ids == reference(target_engine, ids, 40)
    assert runs[1].stats["suffix_drafted_tokens"] == 0
