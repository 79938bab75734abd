"""The sampler alone: its output follows the target distribution p, whatever the draft's q.

Each case draws many seeded rounds with gamma = 1 from a fixed (p, q) and compares the
distribution of the first emitted token with p by a chi-square test. A wrong residual (e.g.
sampling the recovered token from p, or from p - q without the clamp) fails these tests; see
test_a_wrong_residual_is_detected.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from orchestrator.rejection_sampler import greedy_verify, rejection_sample
from specdec.protocol import SamplingParams
from specdec.sampling import process_logits
from specdec.wire import CompactProbs

V = 8
DRAWS = 20_000


def dense(values) -> CompactProbs:
    t = torch.tensor(values, dtype=torch.float32)
    return CompactProbs(V, t / t.sum())


def first_token_counts(p: CompactProbs, q: CompactProbs, *, sampler=rejection_sample, seed=0) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    counts = np.zeros(V)
    bonus = dense([1.0] * V)  # the bonus position does not matter for the first token
    for _ in range(DRAWS):
        x = q.sample(g)  # the draft draws from q, as the draft worker does
        counts[sampler([x], [q], [p, bonus], g).token_ids[0]] += 1
    return counts


def assert_follows(counts: np.ndarray, p: CompactProbs) -> None:
    probs = p.dense().double().numpy()
    expected = probs / probs.sum() * counts.sum()
    support = expected > 0
    assert counts[~support].sum() == 0, f"tokens with p = 0 were emitted: {counts}"
    chi2 = stats.chisquare(counts[support], expected[support])
    assert chi2.pvalue > 1e-4, f"output does not follow p: counts {counts}, expected {expected.round()}"


CASES = {
    "similar": ([4, 3, 2, 1, 1, 1, 1, 1], [3, 3, 3, 1, 1, 1, 1, 1]),
    "opposite": ([8, 4, 2, 1, 0.5, 0.25, 0.1, 0.05], [0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8]),
    # q = 0 where p > 0: those tokens can only come from the residual
    "q_zero_where_p_positive": ([1, 1, 1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0, 0, 0]),
    # p = 0 where q > 0: those drafts must always be rejected
    "p_zero_where_q_positive": ([0, 0, 1, 2, 3, 0, 0, 1], [1, 1, 1, 1, 1, 1, 1, 1]),
    "identical": ([5, 1, 1, 1, 1, 1, 1, 1], [5, 1, 1, 1, 1, 1, 1, 1]),
}


@pytest.mark.parametrize("case", CASES)
def test_output_follows_target_distribution(case):
    p_values, q_values = CASES[case]
    p, q = dense(p_values), dense(q_values)
    assert_follows(first_token_counts(p, q), p)


@pytest.mark.parametrize("params", [SamplingParams(0.7, top_k=3), SamplingParams(1.3, top_p=0.6),
                                    SamplingParams(1.0, top_k=5, top_p=0.8)], ids=str)
def test_processed_sparse_distributions(params):
    """top-k / top-p make p and q sparse with different supports; the output still follows p."""
    gen = torch.Generator().manual_seed(7)
    p = process_logits(torch.randn(V, generator=gen) * 2, params)
    q = process_logits(torch.randn(V, generator=gen) * 2, params)
    assert_follows(first_token_counts(p, q), p)


def test_all_accepted_draws_bonus_from_last_target_distribution():
    p = dense([1] * V)
    bonus = dense([0, 0, 0, 1, 0, 0, 0, 3])
    g = torch.Generator().manual_seed(1)
    counts = np.zeros(V)
    for _ in range(4000):
        r = rejection_sample([2, 2], [p, p], [p, p, bonus], g)  # p == q: always accepted
        assert r.num_accepted == 2 and r.token_ids[:2] == [2, 2]
        counts[r.token_ids[2]] += 1
    assert_follows(counts, bonus)


def test_a_wrong_residual_is_detected():
    """The test has teeth: a sampler that draws the recovered token from p instead of
    norm(max(0, p - q)) is biased, and the same check rejects it."""

    def wrong(drafts, qs, ps, g):
        x = drafts[0]
        if float(torch.rand((), generator=g)) * qs[0].prob_of(x) < ps[0].prob_of(x):
            return rejection_sample(drafts, qs, ps, g)
        return type(rejection_sample(drafts, qs, ps, g))(0, [ps[0].sample(g)])

    p, q = dense(CASES["opposite"][0]), dense(CASES["opposite"][1])
    counts = first_token_counts(p, q, sampler=wrong)
    probs = p.dense().double().numpy()
    assert stats.chisquare(counts, probs / probs.sum() * counts.sum()).pvalue < 1e-6


@pytest.mark.parametrize("x", [0, 3, 5], ids=["likely", "unlikely", "impossible"])
def test_a_point_mass_draft_follows_target_distribution(x):
    """A lookup draft (orchestrator/proposers/ngram.py) proposes x with certainty and sends q = None: x is
    kept w.p. p(x), a rejection draws from p without x. The output still follows p, whether x is
    p's favourite, a rare token or one p never emits."""
    p = dense([6, 1, 2, 0.5, 1, 0, 3, 1])
    g = torch.Generator().manual_seed(11)
    counts = np.zeros(V)
    bonus = dense([1.0] * V)
    for _ in range(DRAWS):
        counts[rejection_sample([x], [None], [p, bonus], g).token_ids[0]] += 1
    assert_follows(counts, p)


def test_a_point_mass_taken_as_a_dense_q_would_be_detected():
    """The point-mass test has teeth: drawing the recovered token from p itself (forgetting to
    remove x) over-emits x, and the same check rejects it."""
    p = dense([6, 1, 2, 0.5, 1, 0, 3, 1])
    g = torch.Generator().manual_seed(11)
    counts = np.zeros(V)
    for _ in range(DRAWS):
        u = float(torch.rand((), generator=g))
        counts[0 if u < p.prob_of(0) else p.sample(g)] += 1
    probs = p.dense().double().numpy()
    support = probs > 0
    assert stats.chisquare(counts[support], (probs / probs.sum() * counts.sum())[support]).pvalue < 1e-6


def test_same_seed_same_output():
    p, q = dense(CASES["similar"][0]), dense(CASES["similar"][1])
    runs = [
        [rejection_sample([1, 2, 3], [q, q, q], [p, p, p, p], torch.Generator().manual_seed(42)) for _ in range(1)]
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


def test_greedy_verify():
    assert greedy_verify([5, 6, 7], [5, 6, 9, 1]).token_ids == [5, 6, 9]
    assert greedy_verify([5, 6, 7], [5, 6, 7, 1]) .token_ids == [5, 6, 7, 1]
    assert greedy_verify([5, 6, 7], [4, 6, 7, 1]).token_ids == [4]
    assert greedy_verify([], [3]).token_ids == [3]


def test_shapes_are_checked():
    p = dense([1] * V)
    with pytest.raises(AssertionError):
        rejection_sample([1, 2], [p, p], [p, p], torch.Generator())
