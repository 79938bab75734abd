"""CPU kernels whose rows are independent (specdec/kernels.py) and the attention that keeps a
verify pass equal to single steps (specdec/worker/batching.py, ROWWISE_MAX_ROWS).

Exactness here means bitwise: a k-row verify pass must give exactly the logits k one-row steps
give, or speculative greedy output can differ from the target's own step-by-step output.
"""

from __future__ import annotations

import pytest
import torch

from draft_service.engine import DraftEngine
from orchestrator.decoder import SpeculativeDecoder
from specdec.kernels import Int8RowLinear, activation_bits, quantize_rows
from specdec.modeling import load_model
from specdec.protocol import GenerationRequest, SamplingParams, VerifyCall
from target_service.engine import TargetEngine

GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def linear():
    torch.manual_seed(0)
    return torch.nn.Linear(256, 384)


def test_rows_are_independent_bit_for_bit(linear):
    m = Int8RowLinear(linear)
    for rows in (2, 3, 5, 9, 17, 33):
        x = torch.randn(rows, 256) * torch.logspace(-2, 1, rows)[:, None]  # rows of very different scales
        alone = torch.cat([m(x[i:i + 1]) for i in range(rows)])
        assert torch.equal(m(x), alone), rows


def test_the_sums_are_exact_integer_sums(linear):
    """fbgemm's scale for the tensor is 1 and its zero point exact, so the result is the float32
    epilogue over exact int32 sums of the int8 weights and the per-row int8 activations."""
    m = Int8RowLinear(linear)
    x = torch.randn(7, 256)
    qw, _ = torch.ops.quantized.linear_unpack(m._packed)
    levels = 127.0 if activation_bits() == 8 else 63.0
    q = torch.empty_like(x)
    s = quantize_rows(x, levels, out=q)
    assert torch.equal(q, torch.round(x * (levels / x.abs().amax(1, keepdim=True))))  # integers, half to even
    assert q.abs().max() == levels
    sums = q.double() @ qw.int_repr().double().t()
    assert (sums.abs() < 2**24).all()  # exact in float32 too
    expected = (sums.float() * qw.q_per_channel_scales().float()[None, :]) * s + linear.bias
    assert torch.equal(m(x), expected)


def test_close_to_the_float_linear_any_shape_no_bias():
    torch.manual_seed(1)
    plain = torch.nn.Linear(128, 64, bias=False)
    m = Int8RowLinear(plain)
    x = torch.randn(2, 3, 128)
    y = m(x)
    assert y.shape == (2, 3, 64) and m.bias is None
    assert float((y - plain(x)).norm() / plain(x).norm()) < 0.03
    assert torch.equal(m(torch.zeros(1, 128)), torch.zeros(1, 64))  # an all-zero row: no division by zero
    assert activation_bits() in (7, 8)


@pytest.fixture(scope="module")
def int8_rows_target(model_dirs):
    return TargetEngine(load_model(str(model_dirs["target"]), dtype="float32", quantization="int8-rows"))


def _bases(v):
    return v.argmax, v.logprob_bases


@pytest.mark.parametrize("k", range(2, 10))
@pytest.mark.parametrize("quantization", ["int8-rows", "fp16"])
def test_a_k_row_verify_equals_k_single_steps(model_dirs, int8_rows_target, quantization, k):
    """Whole model, through the worker's own passes: the argmax and the log-probability at every
    position of a k-row verify are bitwise those of k one-row verifies."""
    engine = int8_rows_target if quantization == "int8-rows" else _fp16_target(model_dirs)
    prompt, drafts = [5, 9, 14, 20, 31, 7], [40, 41, 42, 43, 44, 45, 46, 47, 48][: k - 1]
    engine.open_session("whole", prompt)
    engine.open_session("steps", prompt)
    try:
        whole = engine.verify("whole", len(prompt), [], drafts, GREEDY, top_logprobs=0)
        steps = [engine.verify("steps", len(prompt) - 1, [prompt[-1]], [], GREEDY, top_logprobs=0)]
        for i, d in enumerate(drafts):
            steps.append(engine.verify("steps", len(prompt) + i, [d], [], GREEDY, top_logprobs=0))
        assert whole.argmax == [s.argmax[0] for s in steps]
        assert whole.logprob_bases == [s.logprob_bases[0] for s in steps]
    finally:
        engine.close_session("whole")
        engine.close_session("steps")


_FP16: dict = {}


def _fp16_target(model_dirs):
    if "engine" not in _FP16:
        _FP16["engine"] = TargetEngine(load_model(str(model_dirs["target"]), dtype="float32", quantization="fp16"))
    return _FP16["engine"]


def test_a_session_computes_the_same_alone_and_beside_others(int8_rows_target):
    """Rows of other sessions in the same pass change nothing of a session's result."""
    e = int8_rows_target
    for sid, prompt in (("a", [3, 4, 5, 6]), ("b", [7, 8, 9, 10, 11, 12, 13]), ("alone", [3, 4, 5, 6])):
        e.open_session(sid, prompt)
    try:
        calls = [VerifyCall("a", 4, [], [20, 21, 22], GREEDY, 0), VerifyCall("b", 7, [], [30, 31], GREEDY, 0)]
        together = e.verify_batch(calls)
        alone = e.verify("alone", 4, [], [20, 21, 22], GREEDY, top_logprobs=0)
        assert _bases(together[0]) == _bases(alone)
    finally:
        for sid in ("a", "b", "alone"):
            e.close_session(sid)


def test_speculative_output_equals_gamma_0_on_an_int8_rows_target(int8_rows_target, model_dirs):
    draft = DraftEngine(load_model(str(model_dirs["draft"]), dtype="float32", quantization="int8", role="draft"))
    decoder = SpeculativeDecoder(int8_rows_target, draft, int8_rows_target.tokenizer)
    prompt = [40, 41, 42, 43, 44, 40, 41]
    for kw in (dict(temperature=0), dict(temperature=0.8, top_p=0.9, seed=3)):  # greedy, coupled sampling
        ref = decoder.generate(GenerationRequest(token_ids=prompt, max_new_tokens=24, gamma=0, **kw)).token_ids
        for gamma in (1, 3, 6):
            r = decoder.generate(GenerationRequest(token_ids=prompt, max_new_tokens=24, gamma=gamma, **kw))
            assert r.token_ids == ref, (kw, gamma)
