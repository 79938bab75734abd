"""Decoding controls under speculation: repetition, frequency and presence penalties, logit_bias,
min_p, min_tokens, stop_token_ids and ignore_eos, exact whatever gamma, batch or draft.

Each control is a function of a position's logits and of the prefix it sees; both workers apply it
at every position (specdec/sampling.py, apply_controls), the round's drafts included in the prefix.
The definition the service must meet is computed from the target model alone (tests/support/
reference.py, controlled): one forward pass per token, the controls applied to its logits, then the argmax (greedy) or the seed's
Gumbel-max choice (coupled). apply_controls itself is checked against vLLM's formulas, written out
densely here, so that the reference is not the code under test restated.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import grpc
import pytest
import torch

from draft_service.engine import DraftEngine
from orchestrator.proposers.ngram import NgramDraft
from orchestrator.decoder import SpeculativeDecoder
from specdec.errors import ServiceError
from specdec.protocol import GenerationRequest, SamplingParams
from specdec.sampling import apply_controls, process_logits
from tests.support.distribution import PROMPT, assert_matches, exact_distribution, sample
from tests.support.reference import CONTROLLED_NEW as NEW, controlled as reference

# request fields -> each changes the tiny target's greedy output on PROMPT (checked below)
CONTROLS = {
    "repetition": dict(repetition_penalty=1.6),
    "frequency": dict(frequency_penalty=1.5),
    "presence": dict(presence_penalty=2.0),
    "negative presence": dict(presence_penalty=-2.0, frequency_penalty=-0.5),
    "logit_bias": dict(logit_bias={44: 4.0, 45: -100.0, 50: 3.0}),
    "min_tokens": dict(min_tokens=20, stop_token_ids=[180, 168]),  # both in the plain greedy output
    "all at once": dict(repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=0.4,
                        logit_bias={47: 2.5, 52: -1.0}),
}


def params_of(decoder: SpeculativeDecoder, request: GenerationRequest, prompt: list[int]) -> SamplingParams:
    """The params the decoder sends its workers for this request (output_start, stop tokens)."""
    return decoder.checks.params(request, len(prompt))


@pytest.fixture(scope="module")
def decoder(target_engine, draft_engine):
    return SpeculativeDecoder(target_engine, draft_engine, target_engine.tokenizer)


def request(gamma: int, prompt=PROMPT, temperature: float = 0.0, **kw) -> GenerationRequest:
    return GenerationRequest(token_ids=prompt, temperature=temperature, gamma=gamma, **{"max_new_tokens": NEW, **kw})


# ---- the controls themselves ------------------------------------------------------------------


def vllm_controls(logits: torch.Tensor, params: SamplingParams, prefix: list[int]) -> torch.Tensor:
    """One position, densely, as vLLM's sampler writes it (logit bias, min-tokens, then
    apply_penalties: prompt/output masks, bin counts)."""
    out = logits.clone().double()
    for token, bias in params.logit_bias:
        out[token] += bias
    if len(prefix) - params.output_start < params.min_tokens:
        out[list(params.stop_token_ids)] = -math.inf
    n = out.numel()
    counts = torch.bincount(torch.tensor(prefix[params.output_start:], dtype=torch.long), minlength=n)[:n].double()
    seen = torch.bincount(torch.tensor(prefix, dtype=torch.long), minlength=n)[:n] > 0
    r = torch.where(seen, torch.tensor(params.repetition_penalty, dtype=torch.double), torch.tensor(1.0).double())
    out = torch.where(out > 0, out / r, out * r)
    out -= params.frequency_penalty * counts
    out -= params.presence_penalty * (counts > 0).double()
    return out


@pytest.mark.parametrize("rows", [1, 4])
def test_apply_controls_is_vllms_formula_at_every_row(rows):
    gen = torch.Generator().manual_seed(0)
    n, prompt_len = 64, 10
    tokens = torch.randint(0, 20, (prompt_len + 12,), generator=gen).tolist()  # repeats: counts above 1
    first = len(tokens) - rows + 1  # row i sees tokens[:first + i]: the last rows - 1 are "drafts"
    params = SamplingParams(0.8, repetition_penalty=1.7, frequency_penalty=0.6, presence_penalty=-0.9,
                            logit_bias=((3, 5.0), (7, -100.0), (63, 1.5)), output_start=prompt_len,
                            min_tokens=first - prompt_len + max(rows - 1, 1), stop_token_ids=(5, 6))
    logits = torch.randn(rows, n, generator=gen) * 3
    got = apply_controls(logits.clone(), params, tokens, first)
    for i in range(rows):
        want = vllm_controls(logits[i], params, tokens[: first + i])
        torch.testing.assert_close(got[i].double(), want, rtol=1e-6, atol=1e-5)
    # min_tokens holds the stop tokens back at the first min_tokens output positions only
    assert math.isinf(got[0, 5]) and (rows == 1 or not math.isinf(got[rows - 1, 5]))
    # each row is what it would be alone: the same controls, one row at a time
    for i in range(rows):
        alone = apply_controls(logits[i : i + 1].clone(), params, tokens, first + i)
        assert torch.equal(alone[0], got[i])


def test_raw_logit_undoes_the_controls_for_any_token():
    params = SamplingParams(0.8, repetition_penalty=1.4, frequency_penalty=0.5, presence_penalty=0.3,
                            logit_bias=((2, -3.0), (9, 2.0)), output_start=3)
    prefix = [1, 2, 9, 2, 2, 9, 4]
    raw = torch.tensor([-2.0, 1.5, 0.7, -0.2, 3.0, 0.0, 2.2, -1.1, 0.4, -4.0]).repeat(1, 1)
    controlled = apply_controls(raw.clone(), params, prefix, len(prefix))[0]
    for t in range(10):
        assert params.raw_logit(float(controlled[t]), t, prefix) == pytest.approx(float(raw[0, t]), abs=1e-5)


def test_min_tokens_never_leaves_a_position_without_a_token():
    """Where only stop tokens remain (logit_bias -100 on the rest cannot do it; a tiny vocabulary
    can), min_tokens yields rather than produce a distribution of nothing."""
    params = SamplingParams(0.0, output_start=0, min_tokens=5, stop_token_ids=(0, 1, 2))
    logits = apply_controls(torch.randn(1, 3), params, [0], 1)
    assert torch.isfinite(logits).all()


def test_min_p_keeps_the_tokens_within_its_ratio_of_the_best():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04]))
    q = process_logits(logits, SamplingParams(1.0, min_p=0.15))  # keeps p >= 0.075: the first three
    assert q.dense().nonzero()[:, 0].tolist() == [0, 1, 2]
    torch.testing.assert_close(q.dense()[:3], torch.tensor([0.5, 0.3, 0.1]) / 0.9)
    assert process_logits(logits, SamplingParams(1.0, min_p=0.15, top_k=2)).dense().nonzero()[:, 0].tolist() == [0, 1]
    with_top_p = process_logits(logits, SamplingParams(1.0, min_p=0.15, top_p=0.6))  # of 5/9, 3/9, 1/9
    assert with_top_p.dense().nonzero()[:, 0].tolist() == [0, 1]


# ---- exact under speculation -------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CONTROLS))
def test_greedy_output_is_the_controlled_targets_whatever_gamma(decoder, target_engine, name):
    controls = CONTROLS[name]
    plain = reference(target_engine, PROMPT, params_of(decoder, request(0), PROMPT))
    expected = None
    for gamma in (0, 1, 2, 3, 5, 8):
        req = request(gamma, **controls)
        if expected is None:
            params = params_of(decoder, req, PROMPT)
            expected = reference(target_engine, PROMPT, params, stops=frozenset(req.stop_token_ids))
            assert expected != plain, f"{name} does not change this output: the test could not fail"
        r = decoder.generate(req)
        assert r.token_ids == expected, (name, gamma)
        if gamma:
            assert r.stats["drafted_tokens"] > 0


@pytest.mark.parametrize("name", ["repetition", "all at once", "min_tokens"])
def test_coupled_output_is_the_controlled_targets_whatever_gamma(decoder, target_engine, name):
    controls = dict(CONTROLS[name], min_p=0.05, top_k=8)
    for seed in (0, 7):
        expected = None
        for gamma in (0, 2, 5, 8):
            req = request(gamma, temperature=0.9, seed=seed, **controls)
            if expected is None:
                params = replace(params_of(decoder, req, PROMPT), coupling_seed=seed)
                expected = reference(target_engine, PROMPT, params, stops=frozenset(req.stop_token_ids))
            r = decoder.generate(req)
            assert r.stats["sampling"] == "coupled"
            assert r.token_ids == expected, (name, seed, gamma)


def test_controls_are_exact_under_concurrency_over_grpc(client, decoder, target_engine):
    """Requests with different controls and gammas at once, batched by the step loop: each row of
    a shared verify pass sees its own request's prefix and controls."""
    jobs = [(name, gamma) for name in CONTROLS for gamma in (0, 3, 6)]

    def one(job):
        name, gamma = job
        return client.generate(token_ids=PROMPT, max_new_tokens=NEW, temperature=0, gamma=gamma, **CONTROLS[name])

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, jobs))
    for (name, gamma), r in zip(jobs, results):
        req = request(gamma, **CONTROLS[name])
        expected = reference(target_engine, PROMPT, params_of(decoder, req, PROMPT), stops=frozenset(req.stop_token_ids))
        assert r.token_ids == expected, (name, gamma)


@pytest.mark.parametrize("draft", ["n-gram", "lookup and drafting ahead", "the target itself"])
def test_controls_are_exact_whatever_the_draft(target_engine, draft_engine, draft):
    from specdec.wire import DraftOptions

    made = {
        "n-gram": lambda: (NgramDraft(), DraftOptions()),
        "lookup and drafting ahead": lambda: (draft_engine, DraftOptions(lookup=3, ahead=6)),
        "the target itself": lambda: (DraftEngine(target_engine.loaded), DraftOptions()),
    }[draft]()
    decoder = SpeculativeDecoder(target_engine, made[0], target_engine.tokenizer, draft_options=made[1])
    prompt = PROMPT + [44, 40, 41, 42, 43]  # repeats itself: lookups find guesses
    for name in ("repetition", "all at once"):
        req = request(4, prompt=prompt, **CONTROLS[name])
        r = decoder.generate(req)
        assert r.token_ids == reference(target_engine, prompt, params_of(decoder, req, prompt)), (draft, name)
        if draft == "the target itself":  # the draft applies the same controls: every draft is the target's
            assert r.stats["acceptance_rate"] == 1.0


def test_a_penalized_and_biased_sampled_distribution_is_the_targets_over_grpc(client, target_engine, decoder):
    """Rejection sampling with penalties, bias and min_p (gamma 2, a draft unlike the target): the
    3-token continuations follow the controlled target distribution exactly (chi-square); the
    uncontrolled distribution fails the same test (the negative control)."""
    controls = dict(repetition_penalty=1.8, frequency_penalty=0.9, logit_bias={41: 1.5}, min_p=0.02)
    req = GenerationRequest(token_ids=PROMPT, max_new_tokens=3, temperature=1.0, top_k=3, **controls)
    params = params_of(decoder, req, PROMPT)
    results = sample(client, params, requests=1600, **controls)
    assert_matches(exact_distribution(target_engine, params=params), results)
    with pytest.raises(AssertionError, match="p-value|impossible continuations"):
        assert_matches(exact_distribution(target_engine, params=SamplingParams(1.0, top_k=3)), results)


def test_logprobs_stay_the_raw_models_under_controls(decoder, target_engine):
    """Asked for logprobs, a controlled request gets the raw model's log-probabilities of its
    tokens (temperature 1, no control), as vLLM's default raw_logprobs: greedy, coupled and
    rejection sampling (where the orchestrator undoes the controls on p)."""
    controls = CONTROLS["all at once"]
    for kw in (dict(temperature=0.0), dict(temperature=0.9, seed=3),
               dict(temperature=0.9, seed=3, sampling_mode="rejection")):
        r = decoder.generate(request(4, logprobs=True, top_logprobs=2, **controls, **kw))
        tokens = list(PROMPT)
        for lp in r.logprobs:
            with torch.inference_mode():
                logits = target_engine.model(torch.tensor([tokens]), logits_to_keep=1).logits[0, -1]
            want = torch.log_softmax(logits.double(), -1)
            assert lp.logprob == pytest.approx(float(want[lp.token_id]), abs=1e-4), kw
            assert [t for t, _ in lp.top] == want.topk(2).indices.tolist()
            tokens.append(lp.token_id)


def test_processed_logprobs_are_those_of_the_distribution_each_token_was_drawn_from(decoder, target_engine):
    """logprobs_mode "processed" (vLLM's processed_logprobs): greedy, the log-softmax of the
    controlled logits; sampled (coupled and rejection), log p after temperature, min_p and top-k."""
    controls = CONTROLS["all at once"]
    for kw in (dict(temperature=0.0), dict(temperature=0.8, seed=3, top_k=5, min_p=0.05),
               dict(temperature=0.8, seed=3, top_k=5, sampling_mode="rejection")):
        req = request(4, logprobs=True, top_logprobs=3, logprobs_mode="processed", **controls, **kw)
        params = params_of(decoder, req, PROMPT)
        r = decoder.generate(req)
        tokens = list(PROMPT)
        for lp in r.logprobs:
            with torch.inference_mode():
                logits = target_engine.model(torch.tensor([tokens]), logits_to_keep=1).logits[0, -1]
            controlled = apply_controls(logits[None].float().clone(), params, tokens, len(tokens))[0]
            want = torch.log_softmax(controlled, -1) if params.greedy else \
                process_logits(controlled, params, target_engine.vocab_size).dense().log()
            assert lp.logprob == pytest.approx(float(want[lp.token_id]), abs=1e-4), kw
            assert [t for t, _ in lp.top] == want.topk(3).indices.tolist()
            tokens.append(lp.token_id)
        raw = decoder.generate(replace(req, logprobs_mode="raw"))
        assert raw.token_ids == r.token_ids or "rejection" in kw.values()
        if not params.greedy:
            assert any(a.logprob != pytest.approx(b.logprob, abs=1e-3) for a, b in zip(raw.logprobs, r.logprobs))
    with pytest.raises(ServiceError) as err:
        decoder.generate(request(2, logprobs=True, logprobs_mode="logits"))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "logprobs_mode" in err.value.message


# ---- stop tokens, ignore_eos, min_tokens ------------------------------------------------------


def test_stop_token_ids_end_the_output_and_ignore_eos_does_not(decoder, target_engine):
    plain = decoder.generate(request(3))
    stop = plain.token_ids[5]
    r = decoder.generate(request(3, stop_token_ids=[stop]))
    assert r.token_ids == plain.token_ids[: plain.token_ids.index(stop) + 1] and r.finish_reason == "stop_token"
    eos = target_engine.info.eos_token_ids[0]
    forced = dict(logit_bias={eos: 100.0})  # EOS at every position
    assert decoder.generate(request(3, **forced)).token_ids == [eos]
    ignored = decoder.generate(request(3, ignore_eos=True, **forced))
    assert ignored.token_ids == [eos] * NEW and ignored.finish_reason == "length"
    held = decoder.generate(request(3, min_tokens=6, **forced))  # EOS held back for six tokens, then it comes
    assert len(held.token_ids) == 7 and held.token_ids[-1] == eos and eos not in held.token_ids[:6]


@pytest.mark.parametrize("field, value, words", [
    ("repetition_penalty", 0.0, "repetition_penalty"),
    ("repetition_penalty", float("nan"), "repetition_penalty"),
    ("frequency_penalty", 2.5, "frequency_penalty"),
    ("presence_penalty", -3.0, "presence_penalty"),
    ("min_p", 1.5, "min_p"),
    ("logit_bias", {5: 101.0}, "logit_bias"),
    ("logit_bias", {10**6: 1.0}, "outside the vocabulary"),
    ("logit_bias", {-1: 1.0}, "logit_bias"),
    ("logit_bias", {i: 1.0 for i in range(301)}, "at most 300"),
    ("min_tokens", NEW + 1, "min_tokens"),
    ("min_tokens", -1, "min_tokens"),
    ("stop_token_ids", [10**6], "outside the vocabulary"),
    ("stop_token_ids", list(range(65)), "at most 64"),
])
def test_bad_controls_are_invalid_argument_over_grpc(client, field, value, words):
    with pytest.raises(ServiceError) as err:
        client.generate(token_ids=PROMPT, max_new_tokens=NEW, temperature=0, gamma=2, **{field: value})
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and words in err.value.message, err.value.message
    assert client.generate(token_ids=PROMPT, max_new_tokens=2, temperature=0).finish_reason == "length"
