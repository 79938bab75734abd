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


def test_a_grammar_that_allows_no_token_is_an_invalid_argument():
    """A position where the grammar leaves every logit at -inf (a layout no token of the vocabulary
    spells) ends the request with INVALID_ARGUMENT (HTTP 400) saying so, where the round reaches
    it: the first row always; a later row in a greedy round when the drafts before it are the
    argmax; any row of a sampled round. Rows the round cannot reach are no error."""
    import math

    import pytest as _pytest

    from specdec.grammar import UnsatisfiableGrammar
    from specdec.protocol import SamplingParams
    from target_service.engine import _check_satisfiable

    def logits(dead: set[int], argmax: list[int]):
        x = torch.zeros(len(argmax), 8)
        for i, a in enumerate(argmax):
            x[i, a] = 1.0
        for i in dead:
            x[i] = -math.inf
        return x

    greedy, sampled = SamplingParams(temperature=0.0, output_start=3), SamplingParams(temperature=0.8, output_start=3)
    tokens = [1, 2, 3, 5, 6, 0]  # output from position 3; the round's drafts 5, 6 at first = 3
    _check_satisfiable(logits(set(), [5, 6, 7]), greedy, tokens, 3)
    with _pytest.raises(UnsatisfiableGrammar, match="after 0 generated tokens the grammar allows none"):
        _check_satisfiable(logits({0}, [5, 6, 7]), greedy, tokens, 3)
    with _pytest.raises(UnsatisfiableGrammar, match="after 2 generated tokens"):  # both drafts taken: row 2 reached
        _check_satisfiable(logits({2}, [5, 6, 7]), greedy, tokens, 3)
    _check_satisfiable(logits({2}, [5, 4, 7]), greedy, tokens, 3)  # draft 6 rejected: row 2 never reached
    with _pytest.raises(UnsatisfiableGrammar):
        _check_satisfiable(logits({2}, [5, 4, 7]), sampled, tokens, 3)
    assert UnsatisfiableGrammar("x").code.name == "INVALID_ARGUMENT"


def test_a_batched_verify_is_one_pass_and_each_call_fails_on_its_own(target_engine, monkeypatch):
    """VerifyBatch runs as given: every call's rows in one pass, each call's verification that of
    the call alone; a call with a bad token fails alone, before any pass."""
    from specdec.errors import InvalidArgument
    from specdec.wire import VerifyCall
    from tests.support.engines import count_passes

    prompts = {f"vbatch-{i}": [3 + i, 8, 2 * i + 1] for i in range(3)}
    drafts = {name: [4, 5 + i] for i, name in enumerate(prompts)}
    alone = {}
    for name, prompt in prompts.items():
        target_engine.open_session(name, prompt)
        alone[name] = target_engine.verify(name, len(prompt), [], drafts[name], GREEDY).argmax
        target_engine.truncate(name, len(prompt))
    try:
        rows = count_passes(target_engine, monkeypatch)
        calls = [VerifyCall(name, len(prompt), [], drafts[name], GREEDY) for name, prompt in prompts.items()]
        calls.insert(1, VerifyCall("vbatch-0", 3, [10**7], [], GREEDY))  # the same session twice: refused
        results = target_engine.verify_batch(calls)
    finally:
        for name in prompts:
            target_engine.close_session(name)
    assert isinstance(results[1], InvalidArgument)
    assert [r.argmax for r in results[:1] + results[2:]] == list(alone.values())
    assert rows == [3 * 3]  # one pass: each session's last prompt token and its two drafts
