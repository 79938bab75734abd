"""The noise of coupled sampling (specdec/sampling.py): a fixed function of (seed, position,
token id), Exp(1) and independent, and a choice that is an exact draw from the distribution."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from scipy import stats

from specdec.sampling import coupled_choice, coupling_exponentials
from specdec.wire import CompactProbs

VOCAB = 151_936  # the default pair's


def test_the_noise_is_pinned():
    """A known answer: a change to the hash would change every seeded answer ever given, on
    every host. These values are the definition; do not update them to make the test pass.
    (The hash is integers; only the last step, one float64 log, may differ by an ulp between
    math libraries, hence the tolerance.)"""
    got = coupling_exponentials(1, 2, np.arange(4, dtype=np.uint32))
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, [0.5514097409555949, 0.043420850079723544, 0.23835280753410876,
                                     0.4175529756153576], rtol=1e-14)


def test_the_noise_of_a_token_does_not_depend_on_which_others_are_asked_for():
    ids = np.arange(VOCAB, dtype=np.uint32)
    whole = coupling_exponentials(7, 100, ids)
    some = np.array([5, 151_935, 77, 5], dtype=np.uint32)
    assert np.array_equal(coupling_exponentials(7, 100, some), whole[some])
    assert np.array_equal(coupling_exponentials(2**64 - 1, 0, ids[:10]), coupling_exponentials(-1 % 2**64, 0, ids[:10]))


def test_the_noise_is_exponential_and_independent_across_tokens_positions_and_seeds():
    ids = np.arange(VOCAB, dtype=np.uint32)
    a = coupling_exponentials(3, 10, ids)
    assert stats.kstest(a, "expon").pvalue > 1e-3
    # neighbours: the same seed at the next position, the next seed at the same position, the next token
    for b in (coupling_exponentials(3, 11, ids), coupling_exponentials(4, 10, ids), np.roll(a, 1)):
        assert abs(stats.spearmanr(a, b).statistic) < 4 / np.sqrt(VOCAB)
    # one token across many positions is Exp(1) too
    across = np.array([coupling_exponentials(3, t, ids[42:43])[0] for t in range(4000)])
    assert stats.kstest(across, "expon").pvalue > 1e-3


P = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.04, 0.01])


def choices(probs: CompactProbs, seeds: range, position: int = 9) -> Counter:
    return Counter(coupled_choice(probs, seed, position) for seed in seeds)


@pytest.mark.parametrize("form", ["dense", "sparse", "shortened dense"])
def test_the_choice_is_an_exact_draw_from_p(form):
    """Over many seeds the chosen token follows p (chi-square), whatever form p is kept in; the
    same seed gives the same token in every form."""
    n = 50
    if form == "dense":
        probs = CompactProbs(n, torch.cat([P, torch.zeros(n - P.numel())]))
    elif form == "sparse":
        order = torch.tensor([3, 0, 5, 1, 4, 2])  # any order: a choice is by token id, not by slot
        probs = CompactProbs(n, P[order], order)
    else:
        probs = CompactProbs(n, P.clone())  # a draft head scoring only the first ids
    seeds = range(12_000)
    counts = choices(probs, seeds)
    assert set(counts) <= set(range(6))
    observed = np.array([counts[i] for i in range(6)], dtype=float)
    assert stats.chisquare(observed, P.double().numpy() * len(seeds)).pvalue > 1e-3
    dense = CompactProbs(n, torch.cat([P, torch.zeros(n - P.numel())]))
    for seed in range(50):
        assert coupled_choice(probs, seed, 9) == coupled_choice(dense, seed, 9)


def test_the_chi_square_catches_a_choice_that_is_not_from_p():
    """Negative control: the same draws tested against a neighbouring distribution must fail."""
    counts = choices(CompactProbs(6, P.clone()), range(12_000))
    wrong = torch.tensor([0.37, 0.27, 0.21, 0.1, 0.04, 0.01])
    observed = np.array([counts[i] for i in range(6)], dtype=float)
    assert stats.chisquare(observed, wrong.double().numpy() * 12_000).pvalue < 1e-3


def test_the_draft_and_the_target_agree_more_often_the_closer_q_is_to_p():
    """The coupling: with the same noise, the two argmaxes agree at least (1 - TV) / (1 + TV) of
    the time (Daliri et al. 2025), and always when q == p."""
    q_same, q_near, q_far = P.clone(), torch.tensor([0.3, 0.3, 0.2, 0.1, 0.05, 0.05]), P.flip(0)
    p = CompactProbs(6, P.clone())
    for q in (q_same, q_near, q_far):
        tv = float((P - q).abs().sum()) / 2
        agree = np.mean([coupled_choice(p, s, 4) == coupled_choice(CompactProbs(6, q), s, 4) for s in range(4000)])
        assert agree >= (1 - tv) / (1 + tv) - 0.03, (tv, agree)
        if tv == 0:
            assert agree == 1.0


# ---- the same choices made on the device (DeviceChoices: a chain of draft steps) ----------------


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                  reason="no CUDA device here"))]


@pytest.mark.parametrize("device", DEVICES)
def test_the_device_noise_is_the_hosts(device):
    """The integer hash in int64 tensors gives the host's uint32 values exactly, over a whole
    vocabulary and seeds up to 2**64 - 1: the exponentials differ only where torch's float64 log
    rounds otherwise than numpy's (its last bit, a few in a thousand on this CPU)."""
    from specdec.sampling import _position_key, coupling_exponentials_on

    ids = np.arange(VOCAB, dtype=np.uint32)
    cases = [(0, 0), (1, 2), (2**64 - 1, 12345), (987654321987654321, 7)]
    keys = torch.tensor([_position_key(seed, position) for seed, position in cases], dtype=torch.long, device=device)
    ours = coupling_exponentials_on(keys, VOCAB).cpu().numpy()
    for row, (seed, position) in zip(ours, cases):
        theirs = coupling_exponentials(seed, position, ids)
        np.testing.assert_allclose(row, theirs, rtol=2.3e-16, atol=0)  # an ulp: 2**-52 relative at most
        assert np.count_nonzero(row != theirs) < VOCAB // 100  # a wrong hash would differ nearly everywhere


ROWS = [  # each row's params in one batch: greedy and coupled rows mixed, every truncation
    dict(temperature=0.0),
    dict(temperature=0.7, coupling_seed=5),
    dict(temperature=1.3, top_k=20, coupling_seed=2**64 - 1),
    dict(temperature=1.0, top_p=0.8, coupling_seed=11),
    dict(temperature=0.9, min_p=0.05, top_k=40, top_p=0.9, coupling_seed=3),
    dict(temperature=1.1, top_k=10_000, coupling_seed=8),  # top-k beyond the vocabulary: off
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [[0], [1], list(range(len(ROWS)))], ids=["greedy", "coupled", "mixed"])
def test_device_choices_are_the_hosts(rows, device):
    """A chain's choices on the device (DeviceChoices) are the host's: the argmax for greedy rows,
    coupled_choice over process_logits' distribution for coupled ones, each row at its own
    position, with the draft's probability of each choice."""
    from specdec.protocol import SamplingParams
    from specdec.sampling import DeviceChoices, process_logits

    params = [SamplingParams(**ROWS[i]) for i in rows]
    n, choices = 3000, 4
    positions = [17 + 5 * i for i in range(len(params))]
    rules = DeviceChoices(params, positions, choices)
    rules.bind(torch.from_numpy(rules.words()).to(device))
    g = torch.Generator().manual_seed(0)
    agreed = 0
    for k in range(choices):
        for m in (len(params), 1):  # every row, then a chain's shorter prefix
            logits = torch.randn(m, n, generator=g, dtype=torch.float64) * 3
            tokens, probs = (t.cpu() for t in rules.choose(logits.to(device), k, True))
            for i in range(m):
                p = params[i]
                if p.greedy:
                    want = int(logits[i].argmax())
                    want_prob = float(torch.softmax(logits[i].float(), -1)[want])
                else:
                    q = process_logits(logits[i], p, n)
                    want = coupled_choice(q, p.coupling_seed, positions[i] + k)
                    want_prob = q.prob_of(want)
                assert int(tokens[i]) == want
                assert float(probs[i]) == pytest.approx(want_prob, rel=1e-5)
                agreed += 1
            assert rules.choose(logits.to(device), k, False)[1] is None
    assert agreed == choices * (len(params) + 1)


def test_device_choices_of_a_coupled_row_follow_its_distribution():
    """Over many seeds a coupled row's device choice is an exact draw from its top-p distribution
    (chi-square, which fails for the untruncated one): the truncation and the noise both hold."""
    from specdec.protocol import SamplingParams
    from specdec.sampling import DeviceChoices

    logits = torch.log(torch.tensor([0.4, 0.25, 0.2, 0.1, 0.04, 0.01]))
    seeds = range(6000)
    params = [SamplingParams(temperature=1.0, top_p=0.8, coupling_seed=s) for s in seeds]
    rules = DeviceChoices(params, [9] * len(params), 1)
    rules.bind(torch.from_numpy(rules.words()))
    tokens, _ = rules.choose(logits.expand(len(params), -1), 0, False)
    counts = np.bincount(tokens.numpy(), minlength=6)
    assert counts[3:].sum() == 0  # top-p 0.8 keeps the first three
    nucleus = np.array([0.4, 0.25, 0.2]) / 0.85
    assert stats.chisquare(counts[:3], nucleus * len(seeds)).pvalue > 1e-3
    assert stats.chisquare(counts[:4] + 1e-9, np.array([0.4, 0.25, 0.2, 0.1]) / 0.95 * len(seeds)).pvalue < 1e-3
