"""Exact speculative sampling (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023).

Pure functions: distributions and draft tokens in, the number of accepted drafts and the tokens
to append out. No model, no network, no globals; randomness comes from an explicit
torch.Generator, so a seeded request is reproducible.

Vocabulary (as in vLLM): *accepted* drafts pass the test; the *recovered* token is drawn from
the residual at the first rejection; the *bonus* token is drawn from the target's last
distribution when every draft passes. Each round therefore appends num_accepted + 1 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from specdec.wire import CompactProbs


@dataclass(frozen=True)
class SampleResult:
    num_accepted: int  # drafts accepted, 0..gamma
    token_ids: list[int]  # the accepted drafts, then the recovered or bonus token: num_accepted + 1


def rejection_sample(
    draft_token_ids: Sequence[int],
    draft_probs: Sequence[CompactProbs | None],
    target_probs: Sequence[CompactProbs],
    generator: torch.Generator,
) -> SampleResult:
    """Accepts or rejects gamma drafts so that the output follows the target distribution.

    draft_token_ids: [gamma]      x_i, drawn by the draft from q_i
    draft_probs:     [gamma]      q_i, the draft's processed distribution at position i; None
                                  for a point mass on x_i (a lookup draft, orchestrator/proposers/ngram.py):
                                  x_i is then kept w.p. p_i(x_i), and a rejection draws from p_i
                                  without x_i, renormalized, which is norm(max(0, p_i - q_i))
    target_probs:    [gamma + 1]  p_i, the target's processed distribution at position i;
                                  p_gamma is the bonus position
    """
    gamma = len(draft_token_ids)
    assert len(draft_probs) == gamma and len(target_probs) == gamma + 1, (gamma, len(draft_probs), len(target_probs))
    assert all(q.vocab_size == target_probs[0].vocab_size for q in [*draft_probs, *target_probs] if q is not None)

    for i, x in enumerate(draft_token_ids):
        q = draft_probs[i]
        p_x = target_probs[i].prob_of(x)
        q_x = q.prob_of(x) if q is not None else 1.0
        u = float(torch.rand((), generator=generator))
        # accept with probability min(1, p(x)/q(x)); written as u*q < p so q(x) = 0 never divides
        if u * q_x < p_x:
            continue
        # first rejection: draw the recovered token from norm(max(0, p - q))
        if q is not None:
            residual = (target_probs[i].dense() - q.dense()).clamp_(min=0.0)
        else:  # q = one-hot(x): max(0, p - q) is p with x's mass removed
            residual = target_probs[i].dense().clone()
            residual[x] = 0.0
        total = float(residual.sum())
        if total <= 0.0:  # p == q up to rounding: the residual is empty, p itself is exact
            recovered = target_probs[i].sample(generator)
        else:
            recovered = int(torch.multinomial(residual / total, 1, generator=generator))
        return SampleResult(i, [*draft_token_ids[:i], recovered])

    # every draft passed: the bonus token comes from the target's last distribution
    return SampleResult(gamma, [*draft_token_ids, target_probs[gamma].sample(generator)])


def greedy_verify(draft_token_ids: Sequence[int], target_argmax: Sequence[int]) -> SampleResult:
    """Temperature 0: accept drafts while they equal the target's argmax.

    draft_token_ids: [gamma]
    target_argmax:   [gamma + 1]  the target's greedy choice at each position
    """
    gamma = len(draft_token_ids)
    assert len(target_argmax) == gamma + 1, (gamma, len(target_argmax))
    n = 0
    while n < gamma and draft_token_ids[n] == target_argmax[n]:
        n += 1
    # the target's choice at the first mismatch (or the bonus position) comes for free
    return SampleResult(n, [*draft_token_ids[:n], int(target_argmax[n])])
