"""specdec_tools/synthetic_target.py: a benchmark's target that keeps greedy drafts by a coin."""

from __future__ import annotations

import random

import numpy as np
import pytest
from scipy import stats

from orchestrator.rejection_sampler import greedy_verify
from specdec.protocol import SamplingParams
from specdec_tools.synthetic_target import parse_acceptance, synthetic_choices, synthetic_engine

GREEDY = SamplingParams(temperature=0)


def test_synthetic_acceptance_keeps_a_geometric_number_of_drafts():
    """Each draft kept w.p. a whatever the target says, so the number the orchestrator keeps of
    gamma (its own greedy_verify) follows a truncated geometric law, P(n >= k) = a^k, and the round
    ends with the target's token at the first draft not kept."""
    a, gamma, rounds = 0.8, 4, 20_000
    coin = random.Random(1)
    drafts, argmax = [10, 11, 12, 13], [20, 21, 22, 23, 24]
    counts = np.zeros(gamma + 1)
    for _ in range(rounds):
        r = greedy_verify(drafts, synthetic_choices(drafts, argmax, a, coin))
        assert r.token_ids == [*drafts[:r.num_accepted], argmax[r.num_accepted]]
        counts[r.num_accepted] += 1
    expected = np.array([(a ** n) * ((1 - a) if n < gamma else 1) for n in range(gamma + 1)]) * rounds
    assert stats.chisquare(counts, expected).pvalue > 1e-3
    with pytest.raises(AssertionError):
        synthetic_choices(drafts, argmax, 1.0, coin)  # every draft kept forever is no benchmark


def test_synthetic_acceptance_flag_is_checked():
    from specdec_tools.bench_serve import parse_acceptance as bench_acceptance

    assert parse_acceptance(["--synthetic-acceptance", "0.8", "--model", "m"]) == (0.8, ["--model", "m"])
    with pytest.raises(SystemExit):
        parse_acceptance(["--synthetic-acceptance", "1.5", "--model", "m"])
    assert bench_acceptance("0.8") == 0.8
    with pytest.raises(Exception, match=r"\[0, 1\)"):
        bench_acceptance("1")


def test_the_synthetic_target_changes_greedy_answers_only_by_its_coin(model_dirs, target_engine):
    """The worker's answer to a greedy Verify: the first drafts kept by the coin, then the model's
    own choices, as the real target gives them; the coin differs from call to call, and a call
    sent again gets the same answer (a benchmark's requests are reproducible)."""
    from specdec.modeling import load_model

    synthetic = synthetic_engine(0.8)(load_model(str(model_dirs["target"]), dtype="float64"))
    rng = random.Random(0)
    kept_any = 0
    try:
        for call in range(60):
            prompt = [rng.randrange(1, 100) for _ in range(4)]
            drafts = [rng.randrange(1, 100) for _ in range(4)]
            answers = []
            for engine in (target_engine, synthetic, synthetic):
                engine.open_session(f"s{call}", prompt)
                try:
                    answers.append(engine.verify(f"s{call}", len(prompt), [], drafts, GREEDY).argmax)
                finally:
                    engine.close_session(f"s{call}")
            real, coin, again = answers
            assert coin == again
            kept = next((i for i in range(len(drafts)) if coin[i] != drafts[i]), len(drafts))
            assert coin[kept:] == real[kept:]
            kept_any += kept > 0
    finally:
        synthetic.close()
    assert 36 <= kept_any <= 59  # 60 calls at 0.8 keep a first draft 48 times on average (sd 3)


def test_a_synthetic_stack_runs_the_synthetic_target_and_no_suffix_drafts():
    """specdec bench serve --synthetic-acceptance: the stack's target is this module's worker and its
    orchestrators make no suffix drafts (the coin would keep them too), its own as the others'."""
    from specdec_tools.stack import ProcessStack

    stack = ProcessStack("/t", "/d", synthetic_acceptance=0.8)
    target, _, orchestrator = stack.commands
    assert target[:3] == ["specdec_tools.synthetic_target", "--synthetic-acceptance", "0.8"]
    assert orchestrator[orchestrator.index("--suffix-drafts") + 1] == "off"
    extra = stack.add_orchestrator("--gamma-policy", "fixed")
    assert extra and "--suffix-drafts" in stack.commands[-1]
    assert stack._argv(target)[0][1:3] == ["-m", "specdec_tools.synthetic_target"]
    plain = ProcessStack("/t", "/d")
    assert plain.commands[0][0] == "target_service" and "--suffix-drafts" not in plain.commands[2]
