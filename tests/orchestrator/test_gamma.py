"""orchestrator/gamma.py: the step's gammas from the one formula, learnt only from step records.

Every test here feeds synthetic records (tests/support/policy.py): decisions, not timings."""

from __future__ import annotations

import pytest

from orchestrator.gamma import (DRAFT, EXPLORE_SHARE, MARGIN, PLAIN, Acceptance, GammaPolicy, LinearCost, StepModel,
                                StepRecord, StepRequest)
from tests.support.policy import Feed, accepting, costs, learnt, measured

CPU_TARGET = measured(lambda r: 0.110 + 0.017 * r)  # a 2-core CPU: 126 ms at 1 row, ~790 ms at 40
CPU_DRAFT = measured(lambda r: 0.040 + 0.004 * r)
FLAT_TARGET = measured(lambda r: 0.030 + 0.00001 * r)  # a GPU: rows are almost free
FLAT_DRAFT = measured(lambda r: 0.004 + 0.000001 * r)


def best(requests: list[StepRequest], target: LinearCost, draft: LinearCost, acceptance: Acceptance,
         made: float = 0.0) -> list[int]:
    return StepModel(requests, costs(target, draft, acceptance, made)).best()


def best_gamma(cap: int, sessions: int, target: LinearCost, draft: LinearCost, acceptance: Acceptance) -> int:
    return max(best([StepRequest(cap, "d")] * sessions, target, draft, acceptance))


def test_linear_cost_recovers_a_line_from_varied_rows():
    alpha, beta = CPU_TARGET.fit()
    assert alpha == pytest.approx(0.110, rel=0.05) and beta == pytest.approx(0.017, rel=0.05)


def test_with_one_row_count_the_prior_slope_fills_in():
    cost = LinearCost()
    for _ in range(20):
        cost.observe(5, 0.2)
    assert cost(5) == pytest.approx(0.2, rel=0.01)
    assert cost(40) > cost(5) * 2  # the CPU prior: 40 rows cost several 5-row passes


def test_acceptance_by_position_is_conditional():
    acc = Acceptance()
    for _ in range(100):
        acc.observe(4, 4)  # all kept
        acc.observe(4, 1)  # first kept, second rejected: positions 2, 3 not judged
    assert acc.rate(0) > 0.9
    assert acc.rate(1) == pytest.approx(0.5, abs=0.05)
    assert acc.expected_tokens(0) == 1.0
    assert acc.expected_tokens(2) == pytest.approx(1 + acc.rate(0) + acc.rate(0) * acc.rate(1))
    assert acc.rate(7) == acc.rate(3)  # never judged: as likely as the last position judged


def test_gamma_shrinks_as_the_batch_grows_on_a_cpu_and_reaches_zero():
    chosen = [best_gamma(8, b, CPU_TARGET, CPU_DRAFT, accepting(0.8)) for b in (1, 2, 4, 8, 16, 32)]
    assert chosen[0] >= 2, chosen
    assert all(a >= b for a, b in zip(chosen, chosen[1:])), chosen
    assert chosen[-1] == 0, chosen


def test_on_flat_costs_a_lone_request_drafts_long_and_a_batch_keeps_drafting():
    """Where rows are nearly free (a GPU) a request alone drafts most of its gamma, and 32 requests
    sharing the passes still draft."""
    assert best_gamma(8, 1, FLAT_TARGET, FLAT_DRAFT, accepting(0.8)) >= 4
    assert best_gamma(8, 32, FLAT_TARGET, FLAT_DRAFT, accepting(0.8)) >= 1


def test_poor_acceptance_means_no_drafts_and_the_cap_bounds_gamma():
    assert best_gamma(8, 1, CPU_TARGET, CPU_DRAFT, accepting(0.05)) == 0
    assert best_gamma(3, 1, FLAT_TARGET, FLAT_DRAFT, accepting(0.99)) <= 3
    assert best_gamma(5, 8, LinearCost(), LinearCost(), accepting(0.99)) == 5  # nothing measured: the cap
    assert best_gamma(0, 1, CPU_TARGET, CPU_DRAFT, accepting(0.99)) == 0


def test_drafting_must_promise_a_margin_over_plain_decoding():
    """At the last acceptance where the model keeps gamma 0, drafting still promised more than
    gamma 0, by no more than MARGIN."""
    def goodput(acc, g):
        return StepModel([StepRequest(4, "d")], costs(CPU_TARGET, CPU_DRAFT, acc)).goodput([g])

    rates = [i / 100 for i in range(101)]
    first = next(r for r in rates if best_gamma(4, 1, CPU_TARGET, CPU_DRAFT, accepting(r)) > 0)
    below = accepting(first - 0.01)
    assert 1 < max(goodput(below, g) for g in range(1, 5)) / goodput(below, 0) <= 1 + MARGIN


def test_costs_and_acceptance_are_learnt_from_the_records_and_keyed_by_worker():
    policy = learnt(lambda r: 0.110 + 0.017 * r, lambda r: 0.040 + 0.004 * r, acceptance=0.95, target="t:1",
                    draft="d:1")
    alpha, beta = policy.costs["t:1"].target.fit()
    assert alpha == pytest.approx(0.110, rel=0.05) and beta == pytest.approx(0.017, rel=0.05)
    assert policy.costs["t:1"].drafts["d:1"].acceptance.rate(0) == pytest.approx(0.95, abs=0.03)
    one = policy.choose_step("t:1", [StepRequest(4, "d:1")])[0]
    assert one == [4]
    assert max(policy.choose_step("t:1", [StepRequest(4, "d:1")] * 64)[0]) < 4
    assert policy.choose_step("t:2", [StepRequest(4, "d:1")] * 64)[0] == [4] * 64  # another target: nothing known
    assert GammaPolicy(adaptive=False).choose_step("t:1", [StepRequest(4, "d:1")] * 64)[0] == [4] * 64


def test_the_policy_is_a_function_of_its_records():
    """Two policies fed the same records choose the same steps: no clock, no timing of their own."""
    choices = []
    for _ in range(2):
        policy = learnt(lambda r: 0.03 + 0.004 * r, lambda r: 0.01 + 0.001 * r, acceptance=0.7)
        feed = Feed(policy, target_cost=lambda r: 0.03 + 0.004 * r)
        requests = [StepRequest(4, "d", remaining=40)] * 3
        choices.append([feed.step(requests, lambda g, s: 0.05 + 0.01 * sum(g), lambda g, s: 3 + sum(g) // 2)
                        for _ in range(300)])
    assert choices[0] == choices[1]


def test_an_average_starts_as_the_plain_mean_then_forgets_slowly():
    """The first observation must not stand for the ~30 before it (a first slow draft phase once
    kept drafting off for ~100 steps), and later ones weigh 1 - DECAY."""
    from orchestrator.gamma import DECAY, Ratio

    extra = Ratio()
    for seconds in [0.040] + [0.004] * 9:
        extra.observe(seconds)
    assert extra.value() == pytest.approx((0.040 + 9 * 0.004) / 10, rel=0.1)  # (weighed DECAY per step back)
    for _ in range(2000):
        extra.observe(0.002)
    extra.observe(0.102)
    assert extra.value() == pytest.approx(0.002 + (1 - DECAY) * 0.1, rel=0.01)


def dear_draft_policy() -> GammaPolicy:
    return learnt(lambda r: 0.110 + 0.017 * r, lambda r: 0.100 + 0.010 * r)  # a draft nearly as dear as the target


def test_when_drafts_do_not_pay_the_policy_still_explores_them_within_its_budget():
    policy = dear_draft_policy()
    feed = Feed(policy, target_cost=lambda r: 0.110 + 0.017 * r)
    drafting_s = total_s = 0.0
    for _ in range(600):
        gammas, _ = feed.step([StepRequest(4, "d")] * 16, lambda g, s: 0.45 if any(g) else 0.38,
                              lambda g, s: 17 if any(g) else 16)  # drafting: 0.9x
        drafting_s += 0.45 if any(gammas) else 0.0
        total_s += 0.45 if any(gammas) else 0.38
    assert 0 < drafting_s <= (EXPLORE_SHARE + 0.02) * total_s, drafting_s / total_s


def test_exploring_drafts_only_requests_whose_draft_holds_its_prompt():
    policy = dear_draft_policy()
    feed = Feed(policy)
    requests = [StepRequest(4, "d", lag=300, holds_prompt=False), StepRequest(4, "d", lag=2)]
    seen = [feed.step(requests, 0.3, 2)[0] for _ in range(200)]
    assert all(g[0] == 0 for g in seen) and any(g[1] > 0 for g in seen)
    lagging = [feed.step([requests[0]] * 2, 0.3, 2)[0] for _ in range(200)]
    assert lagging == [[0, 0]] * 200  # nobody to explore with: no exploring


def test_a_request_alone_explores_drafting_even_with_its_drafts_catch_up():
    """At one request nobody else waits for a draft's catch-up: drafting is still explored with a
    request whose draft lags by its whole prompt, but not where another request prefills."""
    policy = dear_draft_policy()
    feed = Feed(policy, target_cost=lambda r: 0.110 + 0.017 * r)
    lagging = StepRequest(4, "d", lag=300, holds_prompt=False)
    seen = [feed.step([lagging], 0.1, 1, load=1)[0][0] for _ in range(400)]
    assert policy.level(DRAFT, "t", 1).running == PLAIN and any(seen[-200:])
    assert all(feed.step([lagging], 0.1, 1, load=2)[0] == [0] for _ in range(200))


def wave_policy() -> GammaPolicy:
    """A policy whose model would draft, but whose arms at eight requests measured that drafting loses."""
    policy = learnt(lambda r: 0.030 + 0.00001 * r, lambda r: 0.004 + 0.000001 * r, acceptance=0.8)
    eight = policy.level(DRAFT, "t", 8)
    eight.running = PLAIN
    for arm, rate in ((DRAFT, 20.0), (PLAIN, 40.0)):
        for _ in range(10):
            eight.rates[arm].observe(rate, 1.0)
    return policy


def test_the_load_level_counts_requests_still_prefilling_and_is_remembered_for_a_few_steps():
    """A wave: one request decodes while seven prefill. The step is judged at the level of eight,
    and so are the next steps of a lone request until MIN_STEPS steps at one have passed."""
    from orchestrator.gamma import MIN_STEPS

    policy = wave_policy()
    lone = [StepRequest(4, "d")]
    assert policy.choose_step("t", lone)[0] == [4]  # nothing remembered: alone, the model's choice
    feed = Feed(policy)
    assert feed.step(lone, 0.1, 1, load=8)[0] == [0]
    remembered = [feed.step(lone, 0.1, 1)[0] for _ in range(MIN_STEPS)]
    assert remembered == [[0]] * MIN_STEPS
    assert policy.choose_step("t", lone)[0] == [4]


def test_a_draft_that_has_not_run_yet_is_not_taken_as_free():
    """Priced at PRIOR_DRAFT_COST of a target pass before it ran: sixteen requests do not draft,
    one alone does (for the arms to measure); a draft measured nearly free then drafts."""
    policy = learnt(lambda r: 0.040 + 0.002 * r)
    assert policy.choose_step("t", [StepRequest(4, "d")] * 16)[0] == [0] * 16
    assert policy.choose_step("t", [StepRequest(4, "d")])[0][0] > 0
    learnt(lambda r: 0.040 + 0.002 * r, lambda r: 0.0005 + 0.00001 * r, policy=policy)
    assert min(policy.choose_step("t", [StepRequest(4, "d")] * 16)[0]) > 0


def test_a_catch_up_is_spread_over_later_steps_only_where_drafting_is_established():
    """Four requests whose drafts must first take in 60-token prompts: at a load whose arms have
    not shown that drafting pays, the step is charged all of the catch-up (plain); where drafting
    is established, or a request is alone, it is spread over the steps it has left."""
    def policy() -> GammaPolicy:
        return learnt(lambda r: 0.030 + 0.00001 * r, lambda r: 0.002 + 0.0005 * r, acceptance=0.9)

    lagging = [StepRequest(4, "d", lag=60, remaining=48, holds_prompt=False)] * 4
    assert policy().choose_step("t", lagging)[0] == [0] * 4
    assert min(policy().choose_step("t", [StepRequest(4, "d", remaining=48)] * 4)[0]) > 0
    assert policy().choose_step("t", lagging[:1])[0][0] > 0
    established = policy()
    four = established.level(DRAFT, "t", 4)
    four.running = DRAFT
    for arm, rate in ((DRAFT, 40.0), (PLAIN, 20.0)):
        for _ in range(10):
            four.rates[arm].observe(rate, 1.0)
    assert min(established.choose_step("t", lagging)[0]) > 0


def test_before_any_pass_is_measured_no_draft_catches_up_under_load():
    lagging = StepRequest(4, "d", lag=55, remaining=48, holds_prompt=False)
    assert GammaPolicy().choose_step("t", [lagging] * 8, load=8)[0] == [0] * 8
    assert GammaPolicy().choose_step("t", [lagging], load=1)[0] == [4]  # alone: nobody waits for it
    assert GammaPolicy().choose_step("t", [lagging, StepRequest(4, "d", remaining=48)])[0] == [0, 4]


def test_a_draft_drafting_ahead_is_charged_only_where_the_proposals_may_be_missing():
    """After a round that kept every draft (made_ahead) a draft on hardware of its own likely made
    the next proposals while the target verified: charged in full, a draft costing 0.6 of the
    target does not pay at acceptance 0.6; found made 4 times in 5, it does. Several requests on
    one draft skip its passes only if every one finds its proposals."""
    target, draft = measured(lambda r: 0.100 + 0.017 * r), measured(lambda r: 0.060 + 0.002 * r)
    known = costs(target, draft, accepting(0.6), made=0.8)
    missed, made = [StepRequest(8, "d")], [StepRequest(8, "d", made_ahead=True)]
    assert StepModel(missed, known).best() == [0] and StepModel(made, known).best()[0] >= 2
    (tokens, seconds), (tokens_made, seconds_made) = (StepModel(r, known).estimate([3]) for r in (missed, made))
    assert tokens == tokens_made and seconds - seconds_made == pytest.approx(0.8 * 3 * draft(1), rel=1e-6)
    both = [StepRequest(8, "d", made_ahead=True)] * 2
    one = [StepRequest(8, "d", made_ahead=True), StepRequest(8, "d")]
    gap = StepModel(one, known).estimate([3, 3])[1] - StepModel(both, known).estimate([3, 3])[1]
    assert gap == pytest.approx(0.64 * 3 * draft(2), rel=1e-6)


def test_the_chance_of_finding_proposals_made_is_learnt_from_the_records():
    policy = GammaPolicy()
    request = StepRequest(4, "d", made_ahead=True)
    for found in [True, True, True, False] * 10:
        policy.observe(StepRecord("t", [request], [4], 1, 0.0, found_made={0: found}, ended=0.1))
    drafts = policy.costs["t"].drafts
    assert drafts["d"].made.value() == pytest.approx(0.75, abs=0.05) and "e" not in drafts


def test_a_step_that_caught_up_or_was_overlapped_teaches_no_draft_extra_and_no_overhead():
    policy = GammaPolicy()
    lagging = StepRequest(4, "d", lag=100)
    policy.observe(StepRecord("t", [lagging], [4], 1, 0.0, drafts={"d": (101, 0.5, 0.3)}, draft_end=0.8,
                              target_rows=5, own_rows=5, target_pass_s=0.1, ended=1.0))
    drafts = policy.costs["t"].drafts
    assert not drafts["d"].line.known and not drafts["d"].extra.steps
    policy.observe(StepRecord("t", [StepRequest(4, "d")], [4], 1, 1.0, drafts={"d": (1, 0.01, 0.3)}, draft_end=1.1,
                              target_rows=5, own_rows=5, target_pass_s=0.1, ended=1.3, overlapped=True))
    assert drafts["d"].line.known and not drafts["d"].extra.steps
    assert policy.costs["t"].overhead.steps == 1  # the overlapped step's waits were not its own
