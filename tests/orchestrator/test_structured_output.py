"""Structured output under speculation: JSON schemas, any JSON object, regexes, choices and grammars,
exact whatever gamma, batch or draft, and valid.

Both workers mask every output position they score by the grammar's state after the output before
it (specdec/grammar.py, applied first in specdec/sampling.py's apply_controls); the draft proposes
the tokens the grammar forces without a forward pass. The definition the service must meet is
computed from the target model alone (tests/support/reference.py, controlled): one pass per token,
its logits masked by a matcher that follows the output, then the argmax or the seed's Gumbel-max
choice.
"""

from __future__ import annotations

import itertools
import json
import re
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import pytest
import torch

from draft_service.engine import DraftEngine
from orchestrator.proposers.ngram import NgramDraft
from orchestrator.decoder import SpeculativeDecoder
from specdec.errors import ServiceError
from specdec.protocol import GenerationRequest, GrammarSpec, SamplingParams
from specdec.wire import DraftOptions
from tests.support.distribution import IN_FLIGHT, PROMPT, assert_matches
from tests.support.reference import controlled as reference  # the target alone, under its controls

SCHEMA = {
    "type": "object",
    "properties": {
        "role": {"enum": ["engineer", "manager", "designer"]},
        "active": {"type": "boolean"},
        "level": {"type": "integer", "minimum": 0, "maximum": 9},
        "tags": {"type": "array", "items": {"enum": ["ab", "cd"]}, "maxItems": 2},
    },
    "required": ["role", "active", "level", "tags"],
    "additionalProperties": False,
}
SPECS = {
    "json_schema": GrammarSpec("json_schema", json.dumps(SCHEMA)),
    "regex": GrammarSpec("regex", r"[a-c]{2,4}-\d{2}"),
    "choice": GrammarSpec("choice", json.dumps(["yes", "no", "maybe not"])),
    "grammar": GrammarSpec("grammar", 'start: "(" item ("," item)* ")"\nitem: "x" | "yy" | "zzz"'),
}
NEW = 80


def params_for(spec: GrammarSpec, temperature: float = 0.0, seed: int | None = None, **kw) -> SamplingParams:
    return SamplingParams(temperature, output_start=len(PROMPT), grammar=spec, coupling_seed=seed, **kw)


def request(spec: GrammarSpec, gamma: int, **kw) -> GenerationRequest:
    return GenerationRequest(token_ids=PROMPT, structured_output=spec, gamma=gamma,
                             **{"max_new_tokens": NEW, "temperature": 0.0, **kw})


def valid(kind: str, text: str) -> bool:
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    if kind == "regex":
        return re.fullmatch(r"[a-c]{2,4}-[0-9]{2}", text) is not None
    if kind == "choice":
        return text in ("yes", "no", "maybe not")
    return re.fullmatch(r"\((x|yy|zzz)(,(x|yy|zzz))*\)", text) is not None


@pytest.fixture(scope="module")
def decoder(target_engine, draft_engine):
    return SpeculativeDecoder(target_engine, draft_engine, target_engine.tokenizer)


@pytest.mark.parametrize("kind", list(SPECS))
def test_greedy_structured_output_is_the_targets_whatever_gamma_and_valid(decoder, target_engine, kind):
    spec = SPECS[kind]
    expected = reference(target_engine, PROMPT, params_for(spec), NEW)
    assert expected[-1] in target_engine.info.eos_token_ids, "the reference must complete its grammar"
    for gamma in (0, 1, 2, 3, 5, 8):
        r = decoder.generate(request(spec, gamma))
        assert r.token_ids == expected, (kind, gamma)
        assert r.finish_reason == "eos" and valid(kind, r.text), r.text
        if gamma:
            assert r.stats["drafted_tokens"] > 0


@pytest.mark.parametrize("kind", ["json_schema", "grammar"])
def test_coupled_structured_output_is_the_seeds_whatever_gamma(decoder, target_engine, kind):
    spec = SPECS[kind]
    for seed in (0, 5):
        expected = reference(target_engine, PROMPT, params_for(spec, 1.0, seed), NEW)
        for gamma in (0, 3, 8):
            r = decoder.generate(request(spec, gamma, temperature=1.0, seed=seed))
            assert r.stats["sampling"] == "coupled" and r.token_ids == expected, (kind, seed, gamma)
            if r.finish_reason == "eos":
                assert valid(kind, r.text), r.text


def test_sampled_structured_output_always_validates(decoder):
    """Rejection sampling at temperature 1 (a random tiny model wanders): every finished output
    is valid, and the grammar never lets the model end early."""
    for seed in range(12):
        r = decoder.generate(request(SPECS["json_schema"], 4, temperature=1.0, seed=seed, sampling_mode="rejection",
                                     max_new_tokens=160))
        assert r.finish_reason in ("eos", "length")
        if r.finish_reason == "eos":
            assert valid("json_schema", r.text), r.text


def test_grammar_masked_sampling_follows_the_targets_masked_distribution_over_grpc(client, target_engine):
    """Rejection sampling under a regex (gamma 2, a draft unlike the target): the outputs follow the
    target's distribution masked by the grammar at each position (chi-square over 1,600 seeds), and
    the unmasked-then-filtered distribution fails the same test (the negative control)."""
    tok = target_engine.tokenizer
    letters = [tok.convert_tokens_to_ids(c) for c in "abc"]
    eos = target_engine.info.eos_token_ids[0]

    def probs(prefix):
        with torch.inference_mode():
            return torch.softmax(target_engine.model(torch.tensor([prefix]), logits_to_keep=1).logits[0, -1].double(), -1)

    exact, filtered = {}, {}
    for a, b in itertools.product(letters, letters):
        p0, p1, p2 = probs(PROMPT), probs(PROMPT + [a]), probs(PROMPT + [a, b])
        exact[(a, b, eos)] = float(p0[a] / p0[letters].sum() * p1[b] / p1[letters].sum())
        filtered[(a, b, eos)] = float(p0[a] * p1[b] * p2[eos])  # unmasked, then kept if valid
    total = sum(filtered.values())
    filtered = {k: v / total for k, v in filtered.items()}

    def one(seed):
        r = client.generate(token_ids=PROMPT, max_new_tokens=4, temperature=1.0, gamma=2, seed=seed,
                            sampling_mode="rejection", structured_output={"regex": "[a-c]{2}"})
        return tuple(r.token_ids), r.stats["accepted_tokens"], r.stats["drafted_tokens"]

    with ThreadPoolExecutor(IN_FLIGHT) as pool:
        results = list(pool.map(one, range(1600)))
    assert_matches(exact, results)
    with pytest.raises(AssertionError, match="p-value"):
        assert_matches(filtered, results)


def test_structured_output_is_exact_under_concurrency_over_grpc(client, target_engine):
    jobs = [(kind, gamma) for kind in SPECS for gamma in (0, 2, 5)]

    def one(job):
        kind, gamma = job
        spec = SPECS[kind]
        so = {"choice": json.loads(spec.text)} if kind == "choice" else {kind: spec.text}
        return client.generate(token_ids=PROMPT, max_new_tokens=NEW, temperature=0, gamma=gamma,
                               structured_output=so)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, jobs))
    for (kind, gamma), r in zip(jobs, results):
        assert r.token_ids == reference(target_engine, PROMPT, params_for(SPECS[kind]), NEW), (kind, gamma)


class UnmaskedDraft(DraftEngine):
    """A draft that ignores the request's grammar: it proposes from its unmasked distribution."""

    def grammar_at(self, session, params, position):
        return None


@pytest.mark.parametrize("draft", ["n-gram", "lookup and drafting ahead", "the target itself", "an unmasked draft"])
def test_structured_output_is_exact_whatever_the_draft(target_engine, draft_engine, draft):
    made = {
        "n-gram": lambda: (NgramDraft(), DraftOptions()),
        "lookup and drafting ahead": lambda: (draft_engine, DraftOptions(lookup=3, ahead=6)),
        "the target itself": lambda: (DraftEngine(target_engine.loaded), DraftOptions()),
        "an unmasked draft": lambda: (UnmaskedDraft(draft_engine.loaded), DraftOptions()),
    }[draft]()
    decoder = SpeculativeDecoder(target_engine, made[0], target_engine.tokenizer, draft_options=made[1])
    for kind in ("json_schema", "grammar"):
        r = decoder.generate(request(SPECS[kind], 4))
        assert r.token_ids == reference(target_engine, PROMPT, params_for(SPECS[kind]), NEW), (draft, kind)
        if draft == "the target itself":
            assert r.stats["acceptance_rate"] == 1.0


def test_forced_tokens_cost_no_draft_pass_and_change_nothing(target_engine, draft_engine):
    """Much of a schema's output is forced (keys, punctuation, enum tails): the draft proposes
    those tokens without a forward pass, so it makes fewer passes than proposals (each pass
    proposes one token here: no lookup), prefill included; the output is the target's."""
    spec = SPECS["json_schema"]
    draft = DraftEngine(draft_engine.loaded)
    decoder = SpeculativeDecoder(target_engine, draft, target_engine.tokenizer, draft_options=DraftOptions(lookup=0))
    passes = []
    work = draft.work  # a pass's work for one session
    draft.work = lambda *a, **k: (passes.append(1), work(*a, **k))[1]
    try:
        r = decoder.generate(request(spec, 6))
    finally:
        draft.close()
    assert r.token_ids == reference(target_engine, PROMPT, params_for(spec), NEW)
    assert draft.forced_made > 10
    assert len(passes) + draft.forced_made <= r.stats["drafted_tokens"] + 1  # + 1: the prefill
    assert len(passes) < r.stats["drafted_tokens"]


@pytest.mark.parametrize("so, words", [
    ({"json_schema": '{"type": "object", "properties": {"a": {"type": "nope"}}}'}, "json_schema"),
    ({"json_schema": "[1, 2"}, "not valid JSON"),
    ({"regex": "[a-"}, "regex"),
    ({"choice": []}, "choice"),
    ({"grammar": "start: undefined_rule"}, "grammar"),
    ({"grammar": "{\"grammars\": []}"}, "not JSON"),
])
def test_bad_specs_are_invalid_argument_and_leave_nothing_behind(client, target_engine, draft_engine, so, words):
    with pytest.raises(ServiceError) as err:
        client.generate(token_ids=PROMPT, max_new_tokens=8, temperature=0, gamma=2, structured_output=so)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and words in err.value.message, err.value.message
    assert target_engine.describe().open_sessions == 0 and draft_engine.describe().open_sessions == 0
    assert client.generate(token_ids=PROMPT, max_new_tokens=2, temperature=0).finish_reason == "length"


def test_a_draft_whose_head_holds_no_allowed_token_stops_proposing(target_engine, model_dirs):
    """A draft that scores only the first 80 ids (--draft-vocab) where the grammar allows only ids
    past them ([x-z] are 87-89): it cannot propose there, so its call ends (it used to propose id
    0, which its own grammar then refused); the output is still the target's."""
    from specdec.modeling import load_model

    restricted = DraftEngine(load_model(str(model_dirs["draft"]), dtype="float64", head_rows=80, role="draft"))
    decoder = SpeculativeDecoder(target_engine, restricted, target_engine.tokenizer)
    spec = GrammarSpec("regex", "([a-c][x-z]){6}")
    r = decoder.generate(request(spec, 4))
    assert r.token_ids == reference(target_engine, PROMPT, params_for(spec), NEW)
    assert re.fullmatch("([a-c][x-z]){6}", r.text)
    assert r.stats["drafted_tokens"] > 0
    restricted.close()
