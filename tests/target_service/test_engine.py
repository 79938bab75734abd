"""target_service.engine: one verify pass per round; a retried Verify changes nothing."""

from __future__ import annotations

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
