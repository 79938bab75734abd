"""A feature head drafts exactly: the target returns its hidden states with every Verify, the
orchestrator hands them to the head with its next Propose, and the output is the target's own
(greedy: token for token; sampled: its distribution, by a chi-square test; seeded: the seed's
tokens whatever the draft). Random heads in float64, in both layouts vLLM loads."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from draft_service.engine import DraftEngine
from orchestrator.decoder import SpeculativeDecoder
from orchestrator.workers import check_pair
from specdec.errors import FailedPrecondition, InvalidArgument
from specdec.modeling import load_model
from specdec.protocol import GenerationRequest, SamplingParams
from specdec.wire import Features
from specdec_tools.testing.tiny_models import build_head_dir
from tests.support.distribution import PARAMS, PROMPT, assert_matches, exact_distribution, sample
from tests.support.drafts import FailingDraft
from tests.support.reference import PROMPTS, SEEDS, coupled as seeded_reference, coupled_request as seeded_request
from tests.support.reference import greedy as reference

LAYERS = (0, 1, 1)  # the tiny target has two layers


def _head(target_engine, model_dirs, tmp_path_factory, name: str, **kw) -> DraftEngine:
    config = target_engine.model.config
    path = build_head_dir(tmp_path_factory.mktemp("heads") / name, target_hidden=config.hidden_size,
                          target_vocab=config.vocab_size, seed=11, feature_layers=LAYERS, **kw)
    return DraftEngine(load_model(str(path), dtype="float64", role="draft", target_model=str(model_dirs["target"])))


def _frequent(target_engine, n: int) -> list[int]:
    """The n tokens the target's greedy continuations of PROMPTS use most."""
    counts = Counter(t for p in PROMPTS for t in reference(target_engine, target_engine.tokenizer(p).input_ids, 24))
    return [t for t, _ in counts.most_common(n)]


@pytest.fixture(scope="module")
def heads(target_engine, model_dirs, tmp_path_factory):
    """vllm: a random head over all tokens; speculators: one that always proposes the target's most
    frequent greedy token (so greedy rounds accept drafts, all of them now and then)."""
    return {"vllm": _head(target_engine, model_dirs, tmp_path_factory, "vllm", layout="vllm"),
            "speculators": _head(target_engine, model_dirs, tmp_path_factory, "speculators", layout="speculators",
                                 draft_ids=_frequent(target_engine, 1))}


@pytest.mark.parametrize("layout", ["vllm", "speculators"])
@pytest.mark.parametrize("gamma", [0, 1, 3, 6])
def test_greedy_output_is_the_targets_own_with_a_feature_head(heads, target_engine, layout, gamma):
    decoder = SpeculativeDecoder(target_engine, heads[layout], target_engine.tokenizer)
    accepted = 0
    for prompt in PROMPTS:
        ids = target_engine.tokenizer(prompt).input_ids
        r = decoder.generate(GenerationRequest(token_ids=ids, max_new_tokens=24, temperature=0, gamma=gamma))
        assert r.token_ids == reference(target_engine, ids, 24), (prompt, gamma)
        assert r.stats["rounds"] == r.stats["target_forward_passes"]
        accepted += r.stats["accepted_tokens"]
    if layout == "speculators" and gamma:
        assert accepted > 0  # the accept path ran, with the head fed the target's features after it


def test_the_target_returns_features_only_to_a_session_that_asked(heads, target_engine):
    ids = target_engine.tokenizer(PROMPTS[0]).input_ids
    target_engine.open_session("plain", ids)
    target_engine.open_session("fed", ids, feature_layers=LAYERS)
    try:
        assert target_engine.opened_features("plain") is None
        opened = target_engine.opened_features("fed")
        assert (opened.start, opened.rows.shape) == (0, (len(ids) - 1, 3 * target_engine.model.config.hidden_size))
        with torch.inference_mode():
            hidden = target_engine.model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        want = torch.cat([hidden[i][0] for i in LAYERS], dim=-1)
        assert torch.allclose(opened.rows, want[:-1].to(opened.rows.dtype))
        greedy = SamplingParams(temperature=0)
        assert target_engine.verify("plain", len(ids), [], [5, 6], greedy).features is None
        v = target_engine.verify("fed", len(ids), [], [5, 6], greedy)
        assert (v.features.start, v.features.rows.shape[0]) == (len(ids) - 1, 3)  # the last prompt token and 2 drafts
    finally:
        target_engine.close_session("plain")
        target_engine.close_session("fed")


def test_a_head_refuses_calls_that_cannot_feed_it(heads, target_engine):
    head = heads["vllm"]
    greedy = SamplingParams(temperature=0)
    with pytest.raises(FailedPrecondition, match="opens on one token"):
        head.open_session("many", [1, 2, 3])
    head.open_session("h", [40])
    try:
        with pytest.raises(FailedPrecondition, match="must bring the target's features"):
            list(head.propose("h", 1, [41, 42], 2, greedy, 0))
        wrong = Features(0, torch.zeros(2, 7))
        with pytest.raises(InvalidArgument, match="needs features of positions 0..1"):
            list(head.propose("h", 1, [41, 42], 2, greedy, 0, features=wrong))
        right = Features(0, torch.zeros(2, head.model.feature_size))
        assert len(list(head.propose("h", 1, [41, 42], 2, greedy, 0, features=right))) == 2
    finally:
        head.close_session("h")
    with pytest.raises(InvalidArgument, match="feature_layers"):
        target_engine.open_session("bad", [1, 2], feature_layers=(7,))


def test_a_head_made_for_another_target_is_refused_when_paired(heads, target_engine):
    info = heads["vllm"].describe()
    assert info.draft_kind == "eagle3" and info.feature_layers == LAYERS
    check_pair(target_engine.describe(), info)
    import dataclasses

    for other in (dataclasses.replace(info, feature_layers=(0, 1, 5)),
                  dataclasses.replace(info, feature_size=info.feature_size + 3)):
        with pytest.raises(FailedPrecondition, match="made for another target"):
            check_pair(target_engine.describe(), other)


@pytest.fixture(scope="module")
def head_stack(target_engine, model_dirs, tmp_path_factory):
    """The stack over gRPC with a head whose vocabulary is the target's likely tokens here (its
    top-3 then overlaps the target's: rejections and acceptances both occur)."""
    from tests.support.servers import start_stack, stop_stack

    exact = exact_distribution(target_engine)
    likely = sorted({t for seq in exact for t in seq})
    head = _head(target_engine, model_dirs, tmp_path_factory, "likely", layout="vllm", draft_ids=likely)
    stack = start_stack(target_engine, head)
    yield stack
    stop_stack(stack)


def test_sampled_output_follows_the_targets_distribution_over_grpc(head_stack, target_engine):
    from orchestrator.client import Client

    with Client(head_stack["address"], timeout_s=120) as client:
        assert_matches(exact_distribution(target_engine), sample(client, PARAMS, requests=1600))


def test_over_grpc_greedy_is_exact_and_seeded_output_is_the_seeds(head_stack, target_engine):
    from orchestrator.client import Client

    with Client(head_stack["address"], timeout_s=120) as client:
        ids = target_engine.tokenizer(PROMPTS[1]).input_ids
        for gamma in (0, 2, 5):
            r = client.generate(token_ids=ids, max_new_tokens=20, temperature=0, gamma=gamma)
            assert r.token_ids == reference(target_engine, ids, 20)
        params = SamplingParams(0.7, top_k=6, top_p=0.8)
        for seed in SEEDS[:2]:
            want = seeded_reference(target_engine, PROMPT, params, seed)
            for gamma in (1, 4):
                r = client.generate(token_ids=PROMPT, max_new_tokens=16, temperature=0.7, top_k=6, top_p=0.8,
                                    seed=seed, gamma=gamma)
                assert r.token_ids == want, (seed, gamma)


def test_a_failed_head_leaves_the_request_to_the_target_alone(heads, target_engine):
    """A feature head that fails mid-request is dropped (a new one would need every position's
    features): the request goes on at gamma 0, with the target's own tokens."""
    decoder = SpeculativeDecoder(target_engine, FailingDraft(heads["speculators"]), target_engine.tokenizer)
    ids = target_engine.tokenizer(PROMPTS[0]).input_ids
    r = decoder.generate(GenerationRequest(token_ids=ids, max_new_tokens=24, temperature=0, gamma=3))
    assert r.token_ids == reference(target_engine, ids, 24)
    assert r.stats["draft_failovers"] == 1


def test_seeded_output_is_the_seeds_with_a_feature_head(heads, target_engine):
    decoder = SpeculativeDecoder(target_engine, heads["vllm"], target_engine.tokenizer)
    params = SamplingParams(0.9)
    for seed in SEEDS:
        want = seeded_reference(target_engine, PROMPT, params, seed)
        for gamma in (1, 3):
            assert decoder.generate(seeded_request(params, seed, gamma)).token_ids == want, (seed, gamma)


def test_choices_forked_from_one_prefill_feed_their_heads(heads, target_engine):
    """n choices: one target prefill, its features shared by every choice's head; each choice is
    its seed's answer, greedy choices the greedy answer."""
    from orchestrator.decoder import choice_seed

    decoder = SpeculativeDecoder(target_engine, heads["speculators"], target_engine.tokenizer)
    ids = target_engine.tokenizer(PROMPTS[0]).input_ids
    r = decoder.generate(GenerationRequest(token_ids=ids, max_new_tokens=16, temperature=0, gamma=3, n=2))
    assert [c.token_ids for c in r.choices] == [reference(target_engine, ids, 16)] * 2
    params = SamplingParams(0.9)
    r = decoder.generate(GenerationRequest(token_ids=PROMPT, max_new_tokens=12, temperature=0.9, seed=7, gamma=3, n=3))
    for i, c in enumerate(r.choices):
        assert c.token_ids == seeded_reference(target_engine, PROMPT, params, choice_seed(7, i), 12), i


def test_a_draft_pool_serves_one_kind_of_draft(heads, target_engine, draft_engine):
    """A request's draft fails over within its pool, so a head beside a model draft is refused
    (a model after it would get no features, a head after a model none either)."""
    from orchestrator.pool import REFUSED, SERVING, WorkerPool, pair_pools

    targets = WorkerPool.fixed("target", [target_engine])
    drafts = WorkerPool.fixed("draft", [heads["vllm"], draft_engine])
    pair_pools(targets, drafts)
    targets.poll()
    drafts.poll()
    head, model = drafts.members()
    assert head.state == SERVING and model.state == REFUSED and "one kind of draft" in model.message
