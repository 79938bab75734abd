"""n > 1: one prefill, the choices decode from copies of the prompt's caches (Placement.fork,
WorkerEngine.fork_session), each with its own seed (choice_seed); every choice is exactly what a
request with that seed alone would give, and every session is closed after."""

from __future__ import annotations

import grpc
import pytest

from orchestrator.decoder import SpeculativeDecoder, choice_seed
from specdec.errors import ServiceError
from specdec.protocol import GenerationRequest
from tests.support.distribution import PROMPT


@pytest.fixture
def counted(target_engine, draft_engine, monkeypatch):
    """The decoder, counting the workers' prefills (open_session) and copies (fork_session)."""
    calls = {"open": 0, "fork": 0}
    for engine in (target_engine, draft_engine):
        for name, key in (("open_session", "open"), ("fork_session", "fork")):
            real = getattr(engine, name)
            monkeypatch.setattr(engine, name, lambda *a, _real=real, _key=key, **k: (
                calls.__setitem__(_key, calls[_key] + 1), _real(*a, **k))[1])
    return SpeculativeDecoder(target_engine, draft_engine, target_engine.tokenizer), calls


def request(**kw) -> GenerationRequest:
    return GenerationRequest(token_ids=PROMPT, **{"max_new_tokens": 16, "gamma": 3, **kw})


def test_one_prefill_and_each_choice_is_its_seeds_answer(counted, target_engine, draft_engine):
    decoder, calls = counted
    r = decoder.generate(request(temperature=0.9, seed=42, n=4))
    assert calls == {"open": 2, "fork": 6}  # one session per worker prefilled, three copies of each
    assert [c.stats["seed"] for c in r.choices] == [choice_seed(42, i) for i in range(4)]
    assert r.choices[0] is r and choice_seed(42, 0) == 42
    for i, c in enumerate(r.choices):
        alone = decoder.generate(request(temperature=0.9, seed=choice_seed(42, i), gamma=i))  # coupled: any gamma
        assert c.token_ids == alone.token_ids, i
    assert len({tuple(c.token_ids) for c in r.choices}) > 1, "different seeds, different choices"
    assert target_engine.describe().open_sessions == 0 and draft_engine.describe().open_sessions == 0


def test_greedy_choices_are_the_greedy_answer(counted):
    decoder, _ = counted
    one = decoder.generate(request(temperature=0))
    r = decoder.generate(request(temperature=0, n=3))
    assert [c.token_ids for c in r.choices] == [one.token_ids] * 3


def test_streamed_choices_over_grpc_interleave_and_each_ends(client):
    chunks = list(client.stream(token_ids=PROMPT, max_new_tokens=12, temperature=1.0, seed=5, n=3,
                                sampling_mode="rejection"))
    assert {c.index for c in chunks} == {0, 1, 2}
    assert sorted(c.index for c in chunks if c.finish_reason) == [0, 1, 2]
    whole = client.generate(token_ids=PROMPT, max_new_tokens=12, temperature=1.0, seed=5, n=3)
    assert [c.stats["seed"] for c in whole.choices] == [choice_seed(5, i) for i in range(3)]
    by_index = {i: [t for c in chunks if c.index == i for t in c.token_ids] for i in range(3)}
    assert all(len(by_index[i]) == len(whole.choices[i].token_ids) or whole.choices[i].finish_reason != "length"
               for i in range(3))


@pytest.mark.parametrize("n", [0, 17])
def test_n_out_of_range_is_invalid_argument(client, n):
    with pytest.raises(ServiceError) as err:
        client.generate(token_ids=PROMPT, max_new_tokens=4, n=n)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "n (choices)" in err.value.message


def test_a_fork_needs_the_parents_secret_and_tokens(target_engine):
    from specdec.errors import FailedPrecondition, NotFound

    target_engine.open_session("parent-x", PROMPT)
    try:
        with pytest.raises(NotFound):  # a caller that knows only the id copies nothing
            target_engine.fork_session("child-x", "parent-x", PROMPT, secret=b"0" * 16)
        with pytest.raises(FailedPrecondition):
            target_engine.fork_session("child-x", "parent-x", PROMPT[:-1], secret=target_engine.secret_of("parent-x"))
        target_engine.fork_session("child-x", "parent-x", PROMPT, secret=target_engine.secret_of("parent-x"))
        child, parent = target_engine.session("child-x"), target_engine.session("parent-x")
        assert child.tokens == parent.tokens and child.cached == parent.cached > 0
        assert child.cache.layers[0].keys is not parent.cache.layers[0].keys  # a copy, not a share
        target_engine.close_session("child-x")
    finally:
        target_engine.close_session("parent-x")
