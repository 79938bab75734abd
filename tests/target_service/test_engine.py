"""target_service.engine: one verify pass per round; a retried Verify changes nothing."""

from __future__ import annotations

import torch

from specdec.protocol import SamplingParams

GREEDY = SamplingParams(temperature=0)


def test_verify_retry_is_harmless(target_engine):
    target_engine.open_session("retry", [1, 2, 3])
    try:
        first = target_engine.verify("retry", 3, [], [4, 5], GREEDY)
        again = target_engine.verify("retry", 3, [], [4, 5], GREEDY)
        assert first.argmax == again.argmax and again.length == 5
    finally:
        target_engine.close_session("retry")


def test_a_verification_reports_the_rows_and_seconds_of_its_pass(target_engine):
    target_engine.open_session("timed", [5, 6, 7])
    try:
        v = target_engine.verify("timed", 3, [], [8, 9], SamplingParams(temperature=0))
    finally:
        target_engine.close_session("timed")
    assert v.batch_rows >= 3  # the uncached last prompt token and the two drafts
    assert 0 < v.pass_s <= v.compute_s


def test_more_top_logprobs_than_the_vocabulary_gives_the_whole_vocabulary(target_engine):
    """A model whose vocabulary is smaller than the alternatives asked for (up to 20) answers
    with all its tokens instead of failing the call (it was an internal error)."""
    logits = torch.tensor([[0.5, 2.0, -1.0], [3.0, 0.0, 1.0]], dtype=torch.float64)  # 3 tokens, 2 positions
    argmax, _, bases, top, _ = target_engine._score(logits, GREEDY, 20, first=0, tokens=[])
    assert argmax == [1, 0] and len(bases) == 2
    assert [ids for ids, _ in top] == [[1, 0, 2], [0, 2, 1]]
