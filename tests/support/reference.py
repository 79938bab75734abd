"""The references the service must meet, each computed from the target model alone, one forward
pass per token and no draft:

- greedy: the target's own greedy `generate` (tests/orchestrator/test_greedy_equivalence.py);
- coupled: plain target decoding with a seed's noise (coupled_choice at every position), the
  definition a seeded sampled request must meet (tests/orchestrator/test_coupled_sampling.py);
- controlled: plain target decoding under the decoding controls, a grammar's mask included
  (tests/orchestrator/test_decoding_controls.py, test_structured_output.py).

Run in float64 so a k-row verify pass and a 1-row pass cannot flip a near-tie.
"""

from __future__ import annotations

import torch

from specdec.protocol import GenerationRequest, SamplingParams
from specdec.sampling import apply_controls, coupled_choice, process_logits
from tests.support.distribution import PROMPT

PROMPTS = ["def fibonacci(n):", "import numpy as np\n", "The quick brown fox", "x"]
SEEDS = [0, 1, 2**64 - 1, -5]
SEEDED_NEW = 16  # tokens of a seeded request (coupled_request) and of its coupled reference
CONTROLLED_NEW = 24  # tokens of a controlled reference, unless asked


def greedy(target_engine, prompt_ids, max_new_tokens):
    out = target_engine.model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt_ids):].tolist()


def coupled(target_engine, prompt: list[int], params: SamplingParams, seed: int, n: int = SEEDED_NEW) -> list[int]:
    """Plain target decoding with the seed's noise: the definition the service must meet."""
    tokens, eos = list(prompt), set(target_engine.info.eos_token_ids)
    for _ in range(n):
        with torch.inference_mode():
            logits = target_engine.model(torch.tensor([tokens]), logits_to_keep=1).logits[0, -1]
        token = coupled_choice(process_logits(logits, params, target_engine.vocab_size), seed % 2**64, len(tokens))
        tokens.append(token)
        if token in eos:
            break
    return tokens[len(prompt):]


def coupled_request(params: SamplingParams, seed: int, gamma: int, prompt=PROMPT, **kw) -> GenerationRequest:
    return GenerationRequest(token_ids=prompt, max_new_tokens=SEEDED_NEW, temperature=params.temperature,
                             top_k=params.top_k, top_p=params.top_p, seed=seed, gamma=gamma, **kw)


def controlled(target_engine, prompt: list[int], params: SamplingParams, n: int = CONTROLLED_NEW, stops=frozenset(),
               eos: bool = True) -> list[int]:
    """Plain target decoding under the controls (a grammar's mask included: a matcher follows the
    output): greedy argmax, or the coupled seed's choice."""
    tokens = list(prompt)
    ends = set(stops) | (set(target_engine.info.eos_token_ids) if eos else set())
    matcher = target_engine.grammar_compiler().matcher(params.grammar) if params.grammar is not None else None
    for _ in range(n):
        with torch.inference_mode():
            logits = target_engine.model(torch.tensor([tokens]), logits_to_keep=1).logits[0, -1]
        logits = apply_controls(logits[None].float().clone(), params, tokens, len(tokens), matcher)[0]
        if params.greedy:
            token = int(logits.argmax())
        else:
            token = coupled_choice(process_logits(logits, params, target_engine.vocab_size), params.coupling_seed,
                                   len(tokens))
        tokens.append(token)
        if matcher is not None:
            matcher.consume([token])
        if token in ends:
            break
    return tokens[len(prompt):]
