"""Prefix caching across requests (specdec/worker/prefixes.py): a session whose prompt begins with
an ended session's tokens starts from a copy of that KV and computes what a prefill computes;
scopes and openers never share; the store stays within its bound; through the services the
reused tokens show in the usage, the output unchanged."""

from __future__ import annotations

import pytest
import torch

from draft_service.engine import DraftEngine
from specdec.modeling import load_model
from specdec.protocol import SamplingParams
from specdec.worker.paged import EagerGraph
from specdec.worker.prefixes import MIN_PREFIX, PrefixStore
from target_service.engine import TargetEngine

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module", params=["dynamic", "pages"])
def cached_target(model_dirs, request):
    pages = dict(kv_pages=True, graph_class=EagerGraph, max_sessions=8, max_cached_tokens=2048) \
        if request.param == "pages" else {}
    engine = TargetEngine(load_model(str(model_dirs["target"]), dtype="float64"), prefix_cache_tokens=200, **pages)
    yield engine
    engine.close()


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _next_logits(engine, session_id: str, prompt: list[int], scope: str = "") -> tuple[torch.Tensor, int]:
    """Opens a session on the prompt and scores its last token -> (the logits there, tokens reused)."""
    _, _, cached = engine.open_session(session_id, prompt, scope=scope)
    session = engine.session(session_id)
    with session.lock:
        logits = engine.run(session, 1, "verify", lambda x: x.clone())
    return logits[0], cached


def test_a_prompt_that_begins_with_an_ended_session_reuses_its_keys(cached_target, target_engine):
    first, follow = _prompt(40, 1), _prompt(12, 2)
    _next_logits(cached_target, "turn-1", first)
    cached_target.close_session("turn-1")  # its 40 tokens stay in the store
    got, reused = _next_logits(cached_target, "turn-2", first + follow)
    want, _ = _next_logits(target_engine, "turn-2-fresh", first + follow)
    target_engine.close_session("turn-2-fresh")
    assert reused == 40
    torch.testing.assert_close(got, want, rtol=0, atol=1e-9)
    cached_target.close_session("turn-2")
    # a shorter prompt inside the retained tokens: all but its last token come from the copy
    got, reused = _next_logits(cached_target, "turn-3", first[:30])
    assert reused == 29
    cached_target.close_session("turn-3")


def test_scopes_and_openers_never_share(cached_target):
    prompt = _prompt(30, 3)
    _next_logits(cached_target, "tenant-a", prompt, scope="token:a")
    cached_target.close_session("tenant-a")
    assert _next_logits(cached_target, "tenant-b", prompt, scope="token:b")[1] == 0
    cached_target.close_session("tenant-b")
    assert _next_logits(cached_target, "tenant-a-again", prompt, scope="token:a")[1] == 29
    cached_target.close_session("tenant-a-again")
    _, _, cached = cached_target.open_session("other-opener", prompt, owner="spiffe://other", scope="token:a")
    assert cached == 0
    cached_target.close_session("other-opener")


def test_the_store_is_bounded_and_prefers_the_newest():
    freed = []
    store = PrefixStore(100, lambda cache, n: (cache, n), freed.append)
    scope = ("", "")
    store.retain(scope, list(range(60)), "a")
    store.retain(scope, list(range(60)) + [7] * 10, "a+")  # begins with a: a goes
    assert freed == ["a"] and store.held_tokens == 70
    store.retain(scope, list(range(100, 150)), "b")  # 120 > 100: the oldest (a+) goes
    assert freed == ["a", "a+"] and store.held_tokens == 50
    store.retain(scope, list(range(MIN_PREFIX - 1)), "short")  # too short to keep
    assert freed[-1] == "short"
    assert store.copy_longest(scope, list(range(100, 140)) + [1]) == (("b", 40), 40)
    assert store.copy_longest(scope, list(range(100, 100 + MIN_PREFIX - 1)) + [0]) == (None, 0)


def test_through_the_services_usage_counts_the_reused_tokens(model_dirs, target_engine):
    """Two requests with one long system prompt, one after the other, through gRPC: the second's
    stats count the reused tokens; both outputs are the target's greedy output."""
    from tests.support.reference import greedy as reference
    from tests.support.servers import client_of, start_stack, stop_stack

    target = TargetEngine(load_model(str(model_dirs["target"]), dtype="float64"), prefix_cache_tokens=1024)
    draft = DraftEngine(load_model(str(model_dirs["draft"]), dtype="float64"), prefix_cache_tokens=1024)
    stack = start_stack(target, draft)
    try:
        system = "You are a careful assistant. Answer in one line. " * 4
        with client_of(stack["address"]) as client:
            results = [client.generate(prompt=system + question, max_new_tokens=12, temperature=0, gamma=3)
                       for question in ("What is 2 + 2?", "Name a colour.")]
        for question, r in zip(("What is 2 + 2?", "Name a colour."), results):
            ids = target.tokenizer(system + question).input_ids
            assert r.token_ids == reference(target_engine, ids, 12)
        assert results[0].stats["cached_tokens"] == 0
        assert results[1].stats["cached_tokens"] >= len(target.tokenizer(system).input_ids) - 2
    finally:
        stop_stack(stack)
        target.close()
        draft.close()


def test_each_bearer_token_has_its_own_cache_over_grpc_and_http(model_dirs):
    """A request finds only its own client's prompts cached (the bearer token it sent, with or
    without --auth-token-file): over gRPC with a token per call (a gateway forwarding its users'),
    and over the HTTP door."""
    import httpx

    from tests.support.servers import client_of, start_stack, stop_stack

    target = TargetEngine(load_model(str(model_dirs["target"]), dtype="float64"), prefix_cache_tokens=1024)
    draft = DraftEngine(load_model(str(model_dirs["draft"]), dtype="float64"), prefix_cache_tokens=1024)
    stack = start_stack(target, draft, http_port=0)
    try:
        prompt = "You are a careful assistant. Answer in one line. " * 4 + "Name a colour."
        with client_of(stack["address"]) as client:
            cached = [client.generate(prompt=prompt, max_new_tokens=2, temperature=0, token=who).stats["cached_tokens"]
                      for who in ("alice", "bob", "alice")]
        assert cached[0] == 0 and cached[1] == 0 and cached[2] > 20
        base = f"http://127.0.0.1:{stack['orchestrator'].http.port}/v1/completions"
        model = stack["orchestrator"].slot.decoder.target_info.model_name

        def over_http(who: str) -> int:
            r = httpx.post(base, json={"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0},
                           headers={"authorization": f"Bearer {who}"}, timeout=60)
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert over_http("carol") == 0 and over_http("carol") > 20 and over_http("dave") == 0
    finally:
        stop_stack(stack)
        target.close()
        draft.close()


def test_a_draft_catching_up_starts_from_a_cached_prefix(model_dirs, draft_engine):
    """The orchestrator opens a draft session on one token and its first Propose catches up the
    whole prompt: that catch-up copies a cached prefix too, and proposes what a fresh draft does."""
    draft = DraftEngine(load_model(str(model_dirs["draft"]), dtype="float64"), prefix_cache_tokens=512)
    try:
        prompt = _prompt(50, 5)
        for engine, name in ((draft, "first"), (draft, "second"), (draft_engine, "fresh")):
            engine.open_session(name, prompt[:1])
        first = [p.token_id for p in draft.propose("first", 1, prompt[1:], 4, GREEDY, seed=1)]
        draft.close_session("first")
        held = draft._prefixes.held_tokens
        assert held >= 50
        second = [p.token_id for p in draft.propose("second", 1, prompt[1:], 4, GREEDY, seed=1)]
        fresh = [p.token_id for p in draft_engine.propose("fresh", 1, prompt[1:], 4, GREEDY, seed=1)]
        assert second == first == fresh
        assert draft._prefixes.hits == 1 and draft._prefixes.tokens_reused >= 49
        draft_engine.close_session("fresh")
    finally:
        draft.close()
