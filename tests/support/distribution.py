"""The chi-square machinery of the sampled tests: the target model's exact distribution of a short
continuation, thousands of seeded requests through a service, and the test that compares them.

The exact joint distribution of a 3-token continuation under temperature 1 and top-k 3 is
computed from the target model itself (27 outcomes); the samples are compared with it by a
chi-square test (tests/orchestrator/test_sampled_distribution.py and the tests of every path that
must keep the target's distribution).
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from scipy import stats

from specdec.protocol import SamplingParams
from specdec.sampling import apply_controls, process_logits

PROMPT = [40, 41, 42, 43]
PARAMS = SamplingParams(temperature=1.0, top_k=3)
NEW_TOKENS = 3
REQUESTS = 2400
IN_FLIGHT = 16  # requests at once: the step loop batches them, so thousands of tiny requests take seconds
# temperature and top-p too: a target or draft that ignored either would fail here
TUNED = SamplingParams(temperature=0.7, top_k=6, top_p=0.8)


def exact_distribution(engine, prompt=PROMPT, new_tokens=NEW_TOKENS, params=PARAMS) -> dict[tuple[int, ...], float]:
    def next_probs(prefix):
        with torch.inference_mode():
            logits = engine.model(torch.tensor([prefix]), logits_to_keep=1).logits[0, -1]
        if params.controlled:  # the decoding controls, at this position (tests/orchestrator/test_decoding_controls.py)
            logits = apply_controls(logits[None].float().clone(), params, prefix, len(prefix))[0]
        d = process_logits(logits, params)
        ids = d.indices if d.indices is not None else range(d.probs.numel())
        return {int(i): float(p) for i, p in zip(ids, d.probs) if p > 0}

    eos = set(engine.info.eos_token_ids)
    dist = {(): 1.0}
    for _ in range(new_tokens):
        grown = {}
        for seq, p in dist.items():
            if seq and seq[-1] in eos:  # generation stops at EOS
                grown[seq] = p
                continue
            grown.update({seq + (t,): p * q for t, q in next_probs(list(prompt) + list(seq)).items()})
        dist = grown
    return dist


def sample(client, params: SamplingParams, requests: int = REQUESTS,
           sampling_mode: str = "rejection", **controls) -> list[tuple[tuple[int, ...], int, int]]:
    """Seeds 0..requests-1, rejection sampling unless asked (a request that names no
    sampling_mode is coupled: tests/orchestrator/test_coupled_sampling.py); controls: more
    request fields."""
    def one(seed):
        r = client.generate(token_ids=PROMPT, max_new_tokens=NEW_TOKENS, temperature=params.temperature,
                            top_k=params.top_k, top_p=params.top_p, gamma=2, seed=seed, sampling_mode=sampling_mode,
                            **controls)
        return tuple(r.token_ids), r.stats["accepted_tokens"], r.stats["drafted_tokens"]

    with ThreadPoolExecutor(IN_FLIGHT) as pool:
        return list(pool.map(one, range(requests)))


def assert_matches(exact: dict, results: list[tuple[tuple[int, ...], int, int]]) -> None:
    """results: (continuation, accepted, drafted) per request; a chi-square test against exact."""
    counts = Counter(seq for seq, _, _ in results)
    assert set(counts) <= set(exact), f"impossible continuations: {set(counts) - set(exact)}"
    accepted = sum(a for _, a, _ in results) / sum(d for _, _, d in results)
    assert 0.05 < accepted < 0.95, f"acceptance {accepted}: the test needs both accepts and rejects"

    keys = sorted(exact, key=exact.get)
    expected = np.array([exact[k] for k in keys]) * len(results)
    observed = np.array([counts.get(k, 0) for k in keys], dtype=float)
    # pool the rarest outcomes so that every cell expects at least 5 draws
    small = np.cumsum(expected) < 5
    exp = np.append(expected[~small], expected[small].sum()) if small.any() else expected
    obs = np.append(observed[~small], observed[small].sum()) if small.any() else observed
    result = stats.chisquare(obs, exp * obs.sum() / exp.sum())
    assert result.pvalue > 1e-3, f"p-value {result.pvalue}: observed {obs}, expected {exp.round(1)}"
