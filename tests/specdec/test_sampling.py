"""process_logits agrees with transformers' own warpers, and the wire form is lossless."""

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from specdec.errors import InvalidArgument
from specdec.protocol import SamplingParams
from specdec.sampling import process_logits
from specdec.wire import CompactProbs

V = 1000


def hf_probs(logits, p: SamplingParams):
    scores = logits[None].clone()
    scores = TemperatureLogitsWarper(p.temperature)(None, scores)
    if p.top_k:
        scores = TopKLogitsWarper(p.top_k)(None, scores)
    if p.top_p < 1:
        scores = TopPLogitsWarper(p.top_p)(None, scores)
    return torch.softmax(scores, -1)[0]


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.6, top_k=20), SamplingParams(1.2, top_p=0.7),
                                    SamplingParams(0.9, top_k=50, top_p=0.9), SamplingParams(1.0, top_p=0.01)], ids=str)
def test_matches_transformers_warpers(params):
    logits = torch.randn(V, generator=torch.Generator().manual_seed(0)) * 3
    ours = process_logits(logits, params)
    torch.testing.assert_close(ours.dense(), hf_probs(logits, params), rtol=1e-5, atol=1e-7)
    assert ours.is_sparse == (params.top_k > 0 or params.top_p < 1)


def test_wire_round_trip():
    logits = torch.randn(V)
    for params in (SamplingParams(1.0), SamplingParams(1.0, top_k=7)):
        probs = process_logits(logits, params)
        back = CompactProbs.from_proto(probs.to_proto(), V)
        assert torch.equal(back.dense(), probs.dense())


@pytest.mark.parametrize("bad", [SamplingParams(-1), SamplingParams(float("nan")), SamplingParams(1, top_k=-2),
                                 SamplingParams(1, top_p=0), SamplingParams(1, top_p=1.01)], ids=str)
def test_bad_params_are_refused(bad):
    with pytest.raises(InvalidArgument):
        bad.validate()


@pytest.mark.parametrize("scale", [8.0, 0.5], ids=["peaked-fast-path", "flat-full-sort"])
def test_top_p_on_a_large_vocabulary(scale):
    """A large vocabulary takes the top-2048 shortcut when it holds top_p's mass, else sorts all."""
    logits = torch.randn(50_000, generator=torch.Generator().manual_seed(1)) * scale
    params = SamplingParams(1.0, top_p=0.9)
    torch.testing.assert_close(process_logits(logits, params).dense(), hf_probs(logits, params), rtol=1e-5, atol=1e-7)


def test_top_p_cut_uses_the_whole_distribution():
    """Regression: when the top-2048 candidates hold more than top_p but less than all of the
    mass, the cut must use masses of the whole distribution, not of the candidates alone."""
    logits = torch.randn(10_000, generator=torch.Generator().manual_seed(0)) * 2.2
    full = torch.softmax(logits, -1)
    top_mass = float(full.topk(2048).values.sum())
    assert 0.9 < top_mass < 0.999, top_mass  # the case under test
    params = SamplingParams(1.0, top_p=0.9)
    torch.testing.assert_close(process_logits(logits, params).dense(), hf_probs(logits, params), rtol=1e-5, atol=1e-7)


def test_tiny_temperature_is_greedy():
    assert SamplingParams(1e-9).greedy and not SamplingParams(1e-3).greedy
