"""logprobs: each generated token's log-probability under the target model, and its top
alternatives, whatever the drafts did: compared with one plain forward pass of the target."""

from __future__ import annotations

import grpc
import pytest
import torch

from orchestrator.decoder import SpeculativeDecoder
from specdec.errors import ServiceError
from specdec.protocol import GenerationRequest

PROMPT_IDS = [5, 6, 7, 8]
MODES = {"greedy": dict(temperature=0.0), "sampled": dict(temperature=0.8, top_p=0.9, top_k=40, seed=11)}


def reference(target_engine, prompt, tokens, top):
    """log_softmax of the target's logits at every generated position, and its top ids."""
    with torch.inference_mode():
        logits = target_engine.model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()
    return chosen, logprobs.topk(top, dim=-1)


@pytest.mark.parametrize("mode", MODES)
def test_logprobs_are_the_targets_own_in_process(target_engine, draft_engine, mode):
    decoder = SpeculativeDecoder(target_engine, draft_engine, tokenizer=target_engine.tokenizer)
    r = decoder.generate(GenerationRequest(token_ids=PROMPT_IDS, max_new_tokens=24, gamma=4, logprobs=True,
                                           top_logprobs=3, **MODES[mode]))
    assert r.stats["accepted_tokens"] > 0  # drafts were accepted: the values come from verify passes
    chosen, top = reference(target_engine, PROMPT_IDS, r.token_ids, 3)
    assert [lp.token_id for lp in r.logprobs] == r.token_ids
    assert [lp.logprob for lp in r.logprobs] == pytest.approx(chosen, abs=1e-4)
    assert [[t for t, _ in lp.top] for lp in r.logprobs] == top.indices.tolist()
    assert [x for lp in r.logprobs for _, x in lp.top] == pytest.approx(top.values.flatten().tolist(), abs=1e-4)


def test_logprobs_over_grpc_match_in_process_and_cost_nothing_when_off(client, target_engine):
    r = client.generate(token_ids=PROMPT_IDS, max_new_tokens=12, temperature=0, logprobs=True, top_logprobs=2)
    chosen, top = reference(target_engine, PROMPT_IDS, r.token_ids, 2)
    assert [lp.logprob for lp in r.logprobs] == pytest.approx(chosen, abs=1e-4)
    assert [[t for t, _ in lp.top] for lp in r.logprobs] == top.indices.tolist()
    streamed = [lp for c in client.stream(token_ids=PROMPT_IDS, max_new_tokens=12, temperature=0, logprobs=True)
                for lp in c.logprobs or ()]
    assert [lp.logprob for lp in streamed] == pytest.approx(chosen, abs=1e-4) and all(not lp.top for lp in streamed)
    assert client.generate(token_ids=PROMPT_IDS, max_new_tokens=4, temperature=0).logprobs is None


@pytest.mark.parametrize("kwargs, words", [(dict(logprobs=True, top_logprobs=21), "top_logprobs"),
                                           (dict(logprobs=True, top_logprobs=-1), "top_logprobs"),
                                           (dict(top_logprobs=2), "needs logprobs")])
def test_bad_logprobs_requests_are_refused(client, kwargs, words):
    with pytest.raises(ServiceError) as info:
        client.generate(token_ids=PROMPT_IDS, max_new_tokens=2, **kwargs)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and words in info.value.message
