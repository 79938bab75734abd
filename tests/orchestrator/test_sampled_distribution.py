"""End to end over gRPC: sampled continuations follow the target model's exact distribution.

The exact joint distribution of a 3-token continuation under temperature 1 and top-k 3 is
computed from the target model itself (27 outcomes); thousands of seeded requests through
orchestrator, draft and target are compared with it by a chi-square test (tests/support/distribution.py). The draft is a
different random model, so rejections, recovered tokens and bonus tokens all occur.
"""

from __future__ import annotations

import pytest

from specdec.protocol import SamplingParams
from tests.support.distribution import PARAMS, TUNED, assert_matches, exact_distribution, sample


def test_sampled_output_matches_target_distribution(client, target_engine):
    exact = exact_distribution(target_engine)
    assert abs(sum(exact.values()) - 1) < 1e-5
    assert_matches(exact, sample(client, PARAMS))


def test_temperature_and_top_p_keep_the_target_distribution(client, target_engine):
    exact = exact_distribution(target_engine, params=TUNED)
    assert abs(sum(exact.values()) - 1) < 1e-5
    assert_matches(exact, sample(client, TUNED))


def test_the_chi_square_test_catches_a_wrong_distribution_over_grpc(client, target_engine):
    """Negative control: the service's samples at TUNED, tested against the distribution of
    temperature 1 without top-p (what a service ignoring them would produce), must fail."""
    wrong = exact_distribution(target_engine, params=SamplingParams(temperature=1.0, top_k=6))
    with pytest.raises(AssertionError, match="p-value"):
        assert_matches(wrong, sample(client, TUNED))


def test_a_restricted_draft_head_keeps_the_target_distribution(target_engine, model_dirs):
    """The draft scores only the first 200 token ids (--draft-vocab): q is 0 elsewhere, and the
    target's tokens there are reached through the residual, exactly."""
    from draft_service.engine import DraftEngine
    from orchestrator.client import Client
    from specdec.modeling import load_model
    from tests.support.servers import start_stack, stop_stack

    restricted = DraftEngine(load_model(str(model_dirs["draft"]), dtype="float64", head_rows=200, role="draft"))
    stack = start_stack(target_engine, restricted)
    try:
        exact = exact_distribution(target_engine)
        assert sum(p for seq, p in exact.items() if any(t >= 200 for t in seq)) > 0.3, "mass outside the head"
        with Client(stack["address"], timeout_s=120) as client:
            assert_matches(exact, sample(client, PARAMS))
    finally:
        stop_stack(stack)
